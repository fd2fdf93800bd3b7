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
    from torchtune_grpo.training.config import load_config
    from torchtune_grpo.training.validation import validate_config

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
