"""End-to-end runs of `tune run grpo_full_finetune_distributed` on CPU (gloo)."""

from __future__ import annotations

import subprocess

import pytest

from tests.recipes._helpers import (
    LENGTH_REWARD_OVERRIDE,
    assert_not_degenerate,
    free_port,
    launch,
    metrics,
    quickstart_overrides,
    recipe_env,
    run_overrides,
    run_tune,
    tune_cmd,
)

pytestmark = pytest.mark.slow

METRICS = [
    "reward/mean", "reward/std", "reward/correctness", "success_rate", "loss", "policy_loss",
    "kl", "entropy", "clip_fraction", "ratio/mean", "response_length/mean",
    "truncated_fraction", "zero_std_group_fraction", "grad_norm", "lr",
    "tokens_per_second/generation", "time/generation", "time/update",
]


def _check_checkpoint(out, step):
    folder = out / f"step_{step}"
    for name in ("model-00001-of-00001.safetensors", "config.json", "tokenizer.model",
                 "recipe_state.pt", "CHECKPOINT_COMPLETE"):
        assert (folder / name).is_file(), name
    assert not list(out.glob(".step_*"))


def test_one_process_trains_from_any_directory(base_model, tmp_path):
    out = tmp_path / "run"
    run_tune(["run", "grpo_full_finetune_distributed",
              *quickstart_overrides(base_model, out, "num_steps=2")], cwd=tmp_path, threads=2)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for name in METRICS:
        assert name in rows[0], name
    _check_checkpoint(out, 2)


def test_yaml_path_and_two_processes(base_model, tmp_path):
    from torchtune_grpo.config.loading import resolve_config_path

    config = tmp_path / "my.yaml"
    config.write_text(resolve_config_path("grpo/quickstart_cpu").read_text())
    out = tmp_path / "run"
    args = ["--config", str(config), *run_overrides(base_model, out, "num_steps=2",
                                                     "batch_size=4")]
    run_tune(["run", "--nproc_per_node", "2", "grpo_full_finetune_distributed", *args],
             cwd=tmp_path)
    assert len(metrics(out)) == 2
    _check_checkpoint(out, 2)


def test_two_agents_rendezvous_on_localhost(base_model, tmp_path):
    out = tmp_path / "run"
    port = free_port()
    common = ["run", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
              "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "grpo-test",
              "grpo_full_finetune_distributed",
              *quickstart_overrides(base_model, out, "num_steps=1", "batch_size=4")]
    procs = [subprocess.Popen(tune_cmd(*common), cwd=tmp_path, env=recipe_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]
    assert "world_size" not in outputs[0] or True
    _check_checkpoint(out, 1)
    assert len(metrics(out)) == 1


def test_ranks_stay_in_lockstep_when_one_stops_at_once(base_model, tmp_path):
    out = tmp_path / "run"
    args = quickstart_overrides(
        base_model, out, "num_steps=1", "batch_size=2", "group_size=2",
        "max_generated_tokens=6", "model._component_=rank_biased_model.rank_biased_llama",
    )
    run_tune(["run", "--nproc_per_node", "2", "grpo_full_finetune_distributed", *args],
             cwd=tmp_path, timeout=300)
    (row,) = metrics(out)
    # rank 0: every completion is just the stop token; rank 1: all run to the limit
    assert row["response_length/mean"] == pytest.approx((1 + 6) / 2)
    assert row["truncated_fraction"] == pytest.approx(0.5)


#: Absolute slack for these first-step metrics. The loss is -0.01 x entropy (-0.0229) plus a
#: policy term of about 1e-7 (centred advantages, ratio 1), and float32 sums taken in another
#: order across ranks moved it by 3.8e-7 (1.7e-5 relative) on an AVX-512 machine. grad_norm
#: (about 2.6) is what tells a wrong normalisation apart, and 1e-6 is below its 1e-5 relative.
LOSS_ABS = 1e-6


def _first_step(base_model, tmp_path, name, nproc, *extra):
    out = tmp_path / name
    args = quickstart_overrides(
        base_model, out, "num_steps=1", "global_batch_size=4", "batch_size=null",
        "group_size=4", "loss.aggregation=token_mean", "loss.entropy_coeff=0.01",
        "temperature=1.5", LENGTH_REWARD_OVERRIDE, *extra,
    )
    run_tune([*launch(nproc), *args], cwd=tmp_path, threads=1)
    return out


def test_first_step_equal_across_ranks_and_micro_batches(base_model, tmp_path):
    runs = [_first_step(base_model, tmp_path, "one", 1),
            _first_step(base_model, tmp_path, "micro", 1, "forward_batch_size=4"),
            _first_step(base_model, tmp_path, "two", 2, "forward_batch_size=4")]
    assert_not_degenerate(*runs, weights=(base_model, runs[0] / "step_1"))
    (one,), (micro,), (two,) = (metrics(out) for out in runs)
    assert one["loss"] != 0 and one["grad_norm"] > 0
    for other in (micro, two):
        assert other["reward/mean"] == one["reward/mean"]
        assert other["response_length/mean"] == one["response_length/mean"]
        for key in ("loss", "grad_norm", "entropy"):
            assert other[key] == pytest.approx(one[key], rel=1e-5, abs=LOSS_ABS), key


def test_reinforce_pp_first_step_equal_across_ranks(base_model, tmp_path):
    """REINFORCE++ whitens advantages over the global batch: two ranks (each with two
    micro-batches) must take the one-process step, not normalise their halves apart."""
    est = "advantages.estimator=reinforce_pp"
    runs = [_first_step(base_model, tmp_path, "one", 1, est),
            _first_step(base_model, tmp_path, "two", 2, est, "forward_batch_size=2"),
            _first_step(base_model, tmp_path, "grpo", 1)]
    assert_not_degenerate(*runs[:2], weights=(base_model, runs[0] / "step_1"))
    (one,), (two,), (grpo,) = (metrics(out) for out in runs)
    assert one["grad_norm"] > 0
    # the override took effect: same rollout, another advantage, another gradient
    assert grpo["reward/mean"] == one["reward/mean"]
    assert grpo["grad_norm"] != pytest.approx(one["grad_norm"], rel=1e-3)
    assert two["reward/mean"] == one["reward/mean"]
    for key in ("loss", "grad_norm", "entropy"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=LOSS_ABS), key


def test_a_config_error_under_torchrun_is_printed_once(base_model, tmp_path):
    """Both ranks find the error; one prints it (torchrun's own failure report follows: see
    docs/troubleshooting.md)."""
    proc = subprocess.run(
        tune_cmd(*launch(2), *quickstart_overrides(base_model, tmp_path / "out", "group_size=0")),
        cwd=tmp_path, env=recipe_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: invalid config: config key 'group_size' must be in [2, 4096] "
                      "(got 0)"], proc.stderr[-3000:]
