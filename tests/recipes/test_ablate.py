"""Smoke test of ``benchmarks.ablate``: the reduced grid (``--quick``) end to end."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import ablate
from tests.recipes._helpers import recipe_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_grid_is_one_factor_at_a_time():
    grid = ablate.full_grid()
    assert {s.knob for s in grid} == {"ppo_epochs", "group_size", "aggregation", "kl_coeff",
                                      "importance"}
    assert {s.knob for s in grid} <= set(ablate.KNOBS)
    for setting in grid:
        keys = {o.split("=")[0] for o in setting.overrides}
        if setting.knob == "group_size" and setting.overrides:
            assert keys == {"batch_size", "group_size"}
            b, g = (int(o.split("=")[1]) for o in setting.overrides)
            assert b * g == ablate.COMPLETIONS_PER_STEP
        elif setting.knob == "importance":  # both sides at ppo_epochs=2 (see the docstring)
            assert "ppo_epochs" in keys
        elif setting.knob == "aggregation" and "constant" in setting.label:
            assert keys == {"loss.aggregation", "loss.max_generated_tokens"}
        else:
            assert len(keys) <= 1
    # shared settings (the default under every knob) are trained once per seed
    assert len(ablate.unique_runs(grid)) == 10


@pytest.mark.parametrize("task", ["smollm2_arithmetic", "smollm2_word_problems"])
def test_real_grid_settings_are_valid_configs(task):
    """Every setting of the real-model grid is a config the recipe accepts (a typo in an
    override would otherwise surface an hour into the ablation), and the settings differ."""
    from torchtune_grpo.config.loading import load_config
    from torchtune_grpo.config.validation import validate_config

    grid = ablate.real_grid()
    assert {s.knob for s in grid} == {"estimator", "loss", "group_size"}
    assert {s.knob for s in grid} <= set(ablate.KNOBS)
    runs = ablate.unique_runs(grid)
    assert len(runs) == 11  # the default is shared by the estimator and group_size knobs
    seen = set()
    for overrides in runs:
        cfg = load_config(ablate.TASKS[task].config,
                          ["model_dir=/nonexistent", *ablate.TASKS[task].overrides,
                           *overrides])
        validate_config(cfg)
        resolved = str(sorted((k, str(v)) for k, v in cfg.items()))
        assert resolved not in seen, overrides
        seen.add(resolved)
        if any(o.startswith("loss.") for o in overrides):
            assert int(cfg.ppo_epochs) == 2  # the loss knob compares at two epochs
        if "group_size" in " ".join(overrides):
            assert int(cfg.batch_size) * int(cfg.group_size) == 128


def test_quick_grid_writes_csv_and_plots(tmp_path):
    out = tmp_path / "ablate"
    budget = 1.5
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.ablate", "--quick", "--out", str(out),
         "--budget-s", str(budget), "--warmup-steps", "60"],
        cwd=ROOT, env=recipe_env(threads=1), capture_output=True, text=True, timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    with (out / "ablate.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ablate.CSV_COLUMNS
        rows = list(reader)
    settings = ablate.quick_grid()
    assert {(r["knob"], r["setting"]) for r in rows} == {(s.knob, s.label) for s in settings}
    assert {r["seed"] for r in rows} == {"0"}
    for setting in settings:
        run = [r for r in rows if r["setting"] == setting.label]
        assert len(run) >= 3  # step 0, at least one interval, the end
        assert [int(r["eval_index"]) for r in run] == list(range(len(run)))
        assert int(run[0]["step"]) == 0 and float(run[0]["generated_tokens"]) == 0
        assert [int(r["final"]) for r in run] == [0] * (len(run) - 1) + [1]
        steps = [int(r["step"]) for r in run]
        assert steps == sorted(steps) and steps[-1] > 0
        end = run[-1]
        # stopped at the end of the step that spent the budget
        assert float(end["train_seconds"]) >= budget
        assert float(end["generated_tokens"]) > 0
        assert 0.0 <= float(end["heldout_success"]) <= 1.0
        # the eval code path agrees with heldout_success() on the saved final checkpoint
        if setting.is_default:
            from torchtune_grpo.quickstart.prepare import heldout_success

            name = ablate._run_name(setting.overrides, 0)
            ckpt = out / "runs" / name / f"step_{end['step']}"
            assert heldout_success(ckpt) == pytest.approx(float(end["heldout_success"]),
                                                          abs=0.02)

    assert (out / "summary.csv").is_file() and (out / "summary.md").is_file()
    # a second invocation reads the finished runs back instead of training them again
    for setting in settings:
        assert (out / "runs" / ablate._run_name(setting.overrides, 0) / "result.json").is_file()
    first = (out / "ablate.csv").read_text()
    again = subprocess.run(
        [sys.executable, "-m", "benchmarks.ablate", "--quick", "--out", str(out),
         "--budget-s", str(budget), "--warmup-steps", "60"],
        cwd=ROOT, env=recipe_env(threads=1), capture_output=True, text=True, timeout=300,
        check=False,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "s wall)" in proc.stdout and "s wall)" not in again.stdout  # no run trained again
    assert (out / "ablate.csv").read_text() == first
    for name in ("ablate_ppo_epochs.png", "ablate_all.png"):
        png = out / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fake_result(out: Path, overrides: tuple[str, ...], seed: int, finals: tuple[float, ...],
                 task_overrides: tuple[str, ...] = ()) -> None:
    """A finished run's ``result.json``: evaluations at 0, 300 and 600 training seconds."""
    import json
    from dataclasses import asdict

    points = [ablate.EvalPoint(step=i * 10, optimizer_steps=i * 10, train_seconds=300.0 * i,
                               wall_seconds=310.0 * i, cpu_seconds=300.0 * i,
                               phase_seconds=300.0 * i, generated_tokens=1000.0 * i,
                               heldout_success=v, reward_mean=None, eval_seconds=5.0)
              for i, v in enumerate((0.1, *finals))]
    result = ablate.RunResult(overrides=(*task_overrides, *overrides), seed=seed,
                              points=points)
    run = out / "runs" / ablate._run_name(overrides, seed)
    run.mkdir(parents=True)
    (run / "result.json").write_text(json.dumps(asdict(result)))


def test_collect_summarizes_the_finished_runs_without_training(tmp_path, capsys):
    """``--collect`` summarizes whatever runs exist (seeds may differ between settings),
    lists the missing ones, trains nothing, and reports held-out success only at points
    the sparse evaluations support (300 s here, not an interpolation at 37.5 s)."""
    out = tmp_path / "abl"
    grid = [s for s in ablate.real_grid() if s.knob == "estimator"]
    default, rloo = grid[0], next(s for s in grid if s.label == "rloo")
    task_overrides = ablate.TASKS["smollm2_arithmetic"].overrides
    for seed, finals in ((0, (0.30, 0.40)), (1, (0.20, 0.30))):
        _fake_result(out, default.overrides, seed, finals, task_overrides)
    _fake_result(out, rloo.overrides, 0, (0.25, 0.35), task_overrides)

    rc = ablate.main(["--task", "smollm2_arithmetic", "--grid", "real", "--knobs", "estimator",
                      "--seeds", "0", "1", "--budget-s", "600", "--threshold", "0.3",
                      "--collect", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"not finished (left out of the summary): {ablate._run_name(rloo.overrides, 1)}" \
        in printed
    assert "s wall)" not in printed  # nothing trained

    with (out / "summary.csv").open() as f:
        summary = {r["setting"]: r for r in csv.DictReader(f)}
    assert set(summary) == {default.label, rloo.label}  # unfinished settings left out
    assert int(summary[default.label]["seeds"]) == 2 and int(summary[rloo.label]["seeds"]) == 1
    assert float(summary[default.label]["final_mean"]) == pytest.approx(0.35)
    assert float(summary[default.label]["at_300s_mean"]) == pytest.approx(0.25)
    assert float(summary[rloo.label]["final_mean"]) == pytest.approx(0.35)
    assert not any(k.startswith("at_37.5s") for k in summary[default.label])
    table = (out / "summary.md").read_text().splitlines()
    assert "held-out at 300 s" in table[0]
    assert table[0].count("|") == table[1].count("|")  # the separator matches the header


def test_summary_fractions_follow_the_evaluation_spacing():
    def rows(spacing: float, budget: float) -> list[dict]:
        n = int(budget / spacing)
        return [{"knob": "k", "setting": "s", "is_default": 1, "seed": 0, "eval_index": i,
                 "train_seconds": spacing * i, "step": i, "heldout_success": 0.1,
                 "generated_tokens": 0.0} for i in range(n + 1)]

    assert ablate.summary_fractions(rows(8 / 32, 8.0), 8.0) == [1 / 16, 1 / 8, 1 / 4]
    assert ablate.summary_fractions(rows(300.0, 600.0), 600.0) == [1 / 2]
    assert ablate.summary_fractions(rows(600.0, 600.0), 600.0) == [1 / 2]  # never empty


def test_collect_strips_the_tasks_own_overrides(tmp_path):
    """A task's own overrides are saved in ``result.json`` but are not part of a setting's
    key: collected runs must match their settings again."""
    task = ablate.Task("grpo/smollm2_arithmetic_cpu", "smollm2", ("max_generated_tokens=24",))
    setting = next(s for s in ablate.real_grid() if s.label == "rloo")
    _fake_result(tmp_path, setting.overrides, 0, (0.2, 0.3), task.overrides)
    found, missing = ablate.collect_results([setting], [0, 1], tmp_path, task=task)
    assert [r.overrides for r in found] == [setting.overrides]
    assert missing == [ablate._run_name(setting.overrides, 1)]
    rows = ablate.result_rows([setting], found, clock="cpu", budget_s=600.0)
    assert len(rows) == 3 and {r["setting"] for r in rows} == {"rloo"}


def test_settings_filter_selects_by_label_and_rejects_unknown_names(tmp_path, capsys):
    """``--settings`` keeps only the named settings (a resume of a few runs of a knob) and
    names an unknown label with the valid ones before any work starts."""
    out = tmp_path / "abl"
    grid = [s for s in ablate.real_grid() if s.knob == "loss"]
    gspo = next(s for s in grid if s.label == "GSPO")
    task_overrides = ablate.TASKS["smollm2_arithmetic"].overrides
    for setting in grid:
        _fake_result(out, setting.overrides, 0, (0.2, 0.3), task_overrides)
    base = ["--task", "smollm2_arithmetic", "--grid", "real", "--knobs", "loss", "--seeds", "0",
            "--budget-s", "600", "--threshold", "0.3", "--collect", "--out", str(out)]
    assert ablate.main([*base, "--settings", "GSPO"]) == 0
    with (out / "summary.csv").open() as f:
        assert [r["setting"] for r in csv.DictReader(f)] == [gspo.label]
    with pytest.raises(SystemExit):
        ablate.main([*base, "--settings", "GSPO", "Nope"])
    err = capsys.readouterr().err
    assert "--settings ['Nope']" in err and "'CISPO'" in err
