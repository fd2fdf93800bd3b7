"""``tune-grpo difficulty`` and ``dataset.difficulty_file``: pass rates written as they come,
resumed after an interruption, refused when made otherwise, and used to choose prompts."""

from __future__ import annotations

import json

import pytest

from tests.recipes._helpers import quickstart_config
from torchtune_grpo.datasets.difficulty import read_difficulty, select_by_difficulty
from torchtune_grpo.evaluation.difficulty import score_difficulty

SPLIT = "train"
LIMIT = 24


def _cfg(base, tmp_path, *extra):
    cfg = quickstart_config(base, tmp_path / "unused", f"dataset.limit={LIMIT}",
                            "temperature=1.5", *extra)
    # success = a completion of 4 or more characters: the under-trained quickstart model
    # stops early on some prompts more often than on others
    cfg.rewards = [{"_component_": "tests.recipes.components.length_reward", "success": True,
                    "success_threshold": 4.0}]
    return cfg


def test_difficulty_file_is_written_resumed_and_used(base_model, tmp_path, capsys):
    out = tmp_path / "difficulty.jsonl"
    cfg = _cfg(base_model, tmp_path)
    score_difficulty(cfg, out, num_samples=4, chunk_prompts=8, progress=False)
    settings, rows = read_difficulty(out)
    assert settings["num_samples"] == 4 and settings["temperature"] == 1.5
    assert sorted(rows) == list(range(LIMIT))
    rates = [r["pass_rate"] for r in rows.values()]
    assert all(r["num_correct"] == r["pass_rate"] * 4 for r in rows.values())
    # pass rates differ between prompts
    assert len(set(rates)) > 1, rates
    assert "solved sometimes" in capsys.readouterr().out

    # an interrupted run: the last 10 rows lost and a half-written line left behind
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-10]) + lines[-10][:15])
    score_difficulty(cfg, out, num_samples=4, chunk_prompts=8, progress=False)
    again = read_difficulty(out)[1]
    assert sorted(again) == list(range(LIMIT))
    # rows of the first run kept as they were; the re-scored ones are the same (seeded sampling)
    assert again == rows
    assert len(out.read_text().splitlines()) == LIMIT + 1

    # another setting on the same file is refused before any model loads
    with pytest.raises(ValueError, match="other settings"):
        score_difficulty(cfg, out, num_samples=8, progress=False)

    # the dataset keeps the rows solved sometimes (and a band of them)
    from torchtune import config as tt_config

    tokenizer = tt_config.instantiate(cfg.tokenizer)
    full = tt_config.instantiate(cfg.dataset, tokenizer=tokenizer)
    kept = tt_config.instantiate(cfg.dataset, tokenizer=tokenizer, difficulty_file=str(out))
    expected = sorted(i for i, r in rows.items() if 0 < r["pass_rate"] < 1)
    assert expected and sorted(kept[i]["index"] for i in range(len(kept))) == expected
    assert kept.dropped_by_difficulty == len(full) - len(expected)
    if any(r >= 0.5 for r in rates):
        low = tt_config.instantiate(cfg.dataset, tokenizer=tokenizer, difficulty_file=str(out),
                                    difficulty_band=[0.0, 0.5])
        assert all(rows[low[i]["index"]]["pass_rate"] < 0.5 for i in range(len(low)))


def _file(tmp_path, rows, settings=None):
    path = tmp_path / "d.jsonl"
    head = settings or {"format": "torchtune_grpo.difficulty/1"}
    path.write_text("\n".join(json.dumps(r) for r in [head, *rows]) + "\n")
    return path


def test_selection_errors_name_the_row_and_the_file(tmp_path):
    samples = [("q0", "1", 0), ("q1", "2", 1), ("q2", "3", 2)]
    path = _file(tmp_path, [{"index": 0, "question": "q0", "pass_rate": 0.5},
                            {"index": 1, "question": "q1", "pass_rate": 0.0}])
    with pytest.raises(ValueError,
                       match=r"no pass rate for 1 of its 3 rows \(first: row 3, index 2\)"):
        select_by_difficulty(samples, path, name="ds")
    kept, dropped = select_by_difficulty(samples[:2], path, name="ds")
    assert kept == [("q0", "1", 0)] and dropped == 1
    with pytest.raises(ValueError,
                       match=r"row 2 \(index 1\) of difficulty_file .* another question"):
        select_by_difficulty([("q0", "1", 0), ("other", "2", 1)], path, name="ds")
    with pytest.raises(ValueError, match="no row .* strictly between 0.6 and 1.0"):
        select_by_difficulty(samples[:2], path, band=[0.6, 1.0], name="ds")
    with pytest.raises(ValueError, match="difficulty_band must be"):
        select_by_difficulty(samples[:2], path, band=[0.5, 0.2], name="ds")
    with pytest.raises(FileNotFoundError, match="tune-grpo difficulty"):
        select_by_difficulty(samples, tmp_path / "missing.jsonl", name="ds")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"index": 0}\n')
    with pytest.raises(ValueError, match="not a difficulty file"):
        read_difficulty(bad)
    broken = _file(tmp_path, [{"index": 0, "pass_rate": 0.5}, {"nope": 1},
                              {"index": 2, "pass_rate": 0.5}])
    with pytest.raises(ValueError, match="line 3: not a valid row"):
        read_difficulty(broken)


def test_every_shipped_dataset_builder_takes_a_difficulty_file():
    import inspect

    import torchtune_grpo.datasets as ds

    builders = [getattr(ds, name) for name in ds.__all__ if name.endswith("_dataset")]
    assert len(builders) >= 6
    for builder in builders:
        params = inspect.signature(builder).parameters
        assert "difficulty_file" in params and "difficulty_band" in params, builder.__name__
