"""``grpo_eval``'s ``eval_output_dir``: the results, the partial files and the resume of a
stopped evaluation go there, the checkpoint folder stays as it was; an earlier evaluation's
results are named before they are replaced; an unwritable folder names the key to change."""

from __future__ import annotations

import json
import logging

import grpo_eval
import pytest
from omegaconf import OmegaConf

from torchtune_grpo.checkpoints.run_lock import LOCK_FILE, FolderLock, is_locked
from torchtune_grpo.config.loading import load_config
from torchtune_grpo.errors import UserError
from torchtune_grpo.evaluation.results import RESULTS_FILE, SAMPLES_FILE, partial_samples_path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An untrained quickstart model folder (weights, config.json, tokenizer files)."""
    from torchtune_grpo.quickstart.prepare import prepare_quickstart

    return prepare_quickstart(tmp_path_factory.mktemp("quickstart"), warmup_steps=0)


def _run(checkpoint, *overrides: str) -> None:
    """``tune run grpo_eval --config grpo/eval_quickstart`` on 6 problems, in this process."""
    cfg = load_config("grpo/eval_quickstart", [
        f"checkpoint_dir={checkpoint}", "dataset.limit=6", "forward_batch_size=2",
        "progress_bar=false", *overrides])
    grpo_eval.recipe_main.__wrapped__(cfg)


def _rows(folder):
    return [json.loads(line) for line in (folder / SAMPLES_FILE).read_text().splitlines()]


def test_results_and_resume_live_in_eval_output_dir(checkpoint, tmp_path, monkeypatch, caplog):
    before = sorted(p.name for p in checkpoint.iterdir() if p.name != LOCK_FILE)
    reference = tmp_path / "reference"
    _run(checkpoint, f"eval_output_dir={reference}")
    results = json.loads((reference / RESULTS_FILE).read_text())
    assert results["num_problems"] == 6 and results["model_path"] == str(checkpoint)
    assert not list(reference.glob("*.partial.jsonl"))

    # an evaluation that fails at the write keeps its rows in eval_output_dir ...
    out = tmp_path / "evals" / "addition"  # created, parents too

    def fail(result, cfg):
        raise OSError("disk full")

    monkeypatch.setattr(grpo_eval, "write_results", fail)
    with pytest.raises(OSError, match="disk full"):
        _run(checkpoint, f"eval_output_dir={out}")
    monkeypatch.undo()
    partial = partial_samples_path(out, 0)
    lines = partial.read_text().splitlines()
    assert len(lines) == 1 + 6  # the fingerprint, then every scored problem
    partial.write_text("\n".join(lines[:3]) + "\n")  # as if killed after two problems

    # ... and the same command continues from them there, with the rows of a whole run
    with caplog.at_level(logging.INFO):
        _run(checkpoint, f"eval_output_dir={out}")
    assert f"eval: 2 of 6 problems kept from an interrupted run of the same evaluation in {out}" \
        in caplog.text
    assert [r["completions"] for r in _rows(out)] == [r["completions"] for r in _rows(reference)]
    assert json.loads((out / RESULTS_FILE).read_text())["metrics"] == results["metrics"]
    assert sorted(p.name for p in out.iterdir()) == sorted([LOCK_FILE, RESULTS_FILE,
                                                            SAMPLES_FILE])
    # the checkpoint folder holds what it held (at most the readers' lock file besides)
    assert sorted(p.name for p in checkpoint.iterdir() if p.name != LOCK_FILE) == before

    # a second evaluation into the folder says, at start, which results it will replace
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _run(checkpoint, f"eval_output_dir={out}", "dataset.limit=3")
    assert f"{out / RESULTS_FILE} (of {checkpoint}) holds an earlier evaluation" in caplog.text
    assert json.loads((out / RESULTS_FILE).read_text())["num_problems"] == 3


def test_without_eval_output_dir_the_results_go_into_the_checkpoint(tmp_path):
    from torchtune_grpo.quickstart.prepare import prepare_quickstart

    ckpt = prepare_quickstart(tmp_path / "ckpt", warmup_steps=0)
    _run(ckpt, "dataset.limit=2")
    assert json.loads((ckpt / RESULTS_FILE).read_text())["num_problems"] == 2
    assert len(_rows(ckpt)) == 2


def test_earlier_results_note(tmp_path):
    assert grpo_eval.earlier_results_note(tmp_path) is None
    (tmp_path / RESULTS_FILE).write_text("not json")
    assert grpo_eval.earlier_results_note(tmp_path).startswith(
        f"{tmp_path / RESULTS_FILE} holds an earlier evaluation: this one replaces it")
    (tmp_path / RESULTS_FILE).write_text(json.dumps({"model_path": "/m/step_3"}))
    assert "(of /m/step_3) holds an earlier evaluation" in grpo_eval.earlier_results_note(
        tmp_path)


def test_an_unwritable_output_folder_names_the_key_to_change(tmp_path, monkeypatch):
    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(FolderLock, "acquire", denied)  # root ignores mode bits
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    cfg = OmegaConf.create({"checkpoint_dir": str(ckpt), "eval_output_dir": None})
    with pytest.raises(UserError) as info:
        grpo_eval.lock_output_dir(cfg)
    assert str(info.value) == (f"checkpoint_dir {ckpt} is not writable (Permission denied), "
                               "and the results are written into it: set eval_output_dir=DIR "
                               "to write them elsewhere")
    cfg.eval_output_dir = str(out)
    with pytest.raises(UserError, match=f"^eval_output_dir {out} is not writable "
                                        r"\(Permission denied\); choose another folder"):
        grpo_eval.lock_output_dir(cfg)


def test_a_checkpoint_read_from_elsewhere_is_not_pruned_meanwhile(tmp_path):
    """The shared lock makes a training run's pruning (``is_locked``) leave the folder."""
    assert not is_locked(tmp_path)
    handle = grpo_eval.hold_for_reading(tmp_path)
    assert handle is not None and is_locked(tmp_path)
    handle.close()
    assert not is_locked(tmp_path)
    with FolderLock(tmp_path, "grpo_eval"):  # an evaluation writing into it: held already
        assert grpo_eval.hold_for_reading(tmp_path) is None
    assert grpo_eval.hold_for_reading(tmp_path / "missing") is None


def test_eval_output_dir_is_a_key_of_the_eval_tree():
    from torchtune_grpo.config.schema import EVAL_KEYS, RECIPE_KEYS
    from torchtune_grpo.config.validation import ConfigError, validate_config

    spec = EVAL_KEYS["eval_output_dir"]
    assert spec.default is None and "checkpoint_dir" in spec.doc
    assert "eval_output_dir" not in RECIPE_KEYS  # training writes into its step folders
    validate_config(load_config("grpo/eval_quickstart", [
        "checkpoint_dir=/x", "eval_output_dir=/tmp/evals"]), schema=EVAL_KEYS)
    with pytest.raises(ConfigError, match=r"config key 'eval_output_dir' must be str\|null, got "):
        validate_config(load_config("grpo/eval_quickstart", [
            "checkpoint_dir=/x", "eval_output_dir=[a]"]), schema=EVAL_KEYS)
