"""The bf16 optimizer of the GPU configs (``torchtune_grpo.optim.AdamW``) for 2 optimizer steps
in a 2-rank FSDP2 run on CPU (gloo), against ``torch.optim.AdamW`` on the same run.

The GPU configs used torchao's ``_AdamW`` with ``bf16_stochastic_round: true`` before: in this
run it stops at its first step (torchao 0.15 cannot round FSDP2 shards, pytorch/ao#2296), and
the recipe prints one line naming ``optimizer._component_`` (the fast test of that line is in
``tests/unit/test_optim.py``).
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from tests.recipes._helpers import (
    LENGTH_REWARD_OVERRIDE,
    launch,
    metrics,
    model_weights,
    quickstart_overrides,
    recipe_env,
    tune_cmd,
)

pytestmark = pytest.mark.slow

LR = 1e-3  # the quickstart's
#: The GPU configs' schedule, without warm-up (a warm-up's first step has lr 0).
COSINE = "lr_scheduler=" + json.dumps({
    "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
    "num_warmup_steps": 0})


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at ``|x|`` (8 significant bits)."""
    return 2.0 ** (torch.floor(torch.log2(x.abs().clamp(min=2**-126))) - 7)


def test_bf16_adamw_on_two_fsdp2_ranks_is_torch_adamw_up_to_one_rounding(base_model, tmp_path):
    """Both optimizers run 2 steps (bf16 weights, the GPU configs' keys and schedule) on 2
    FSDP2 ranks. Step 1 starts from the same weights, so both see the same rollout and the same
    gradient; each writes back one of the two bf16 values around its float32 result (nearest
    for torch, random for ours), so every weight differs by at most one bf16 spacing, plus
    ``0.01 lr`` for torch's moments kept in bf16 (measured: 0.008 lr). The RMSNorm scales
    (~1.0, where bf16's spacing is 8x the update) never move under torch's AdamW; under ours a
    fraction ~lr / spacing of them does. Step 2 runs with a finite loss."""
    outs = {name: tmp_path / name for name in ("ours", "torch")}
    components = {"ours": "torchtune_grpo.optim.AdamW", "torch": "torch.optim.AdamW"}
    procs = {name: subprocess.Popen(
        tune_cmd(*launch(2), *quickstart_overrides(
            base_model, out, "num_steps=2", "save_every_n_steps=1", "dtype=bf16",
            "global_batch_size=8", "batch_size=null", "group_size=4",
            "optimizer.weight_decay=0.0", f"optimizer._component_={components[name]}",
            COSINE, LENGTH_REWARD_OVERRIDE)),
        cwd=tmp_path, env=recipe_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for name, out in outs.items()}  # side by side: each waits on gloo a lot
    for name, proc in procs.items():
        text = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, f"{name}:\n{text[-4000:]}"
    rows = {name: metrics(out) for name, out in outs.items()}
    for name in outs:
        assert [r["step"] for r in rows[name]] == [1, 2]
        assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows[name]), name
    for key in ("loss", "grad_norm", "reward/mean"):  # the same first step
        assert rows["ours"][0][key] == rows["torch"][0][key], key
    base = {k: v.to(torch.bfloat16).float() for k, v in model_weights(base_model).items()}
    ours = {k: v.float() for k, v in model_weights(outs["ours"] / "step_1").items()}
    theirs = {k: v.float() for k, v in model_weights(outs["torch"] / "step_1").items()}
    norms_moved = []
    for key, start in base.items():
        a, b = ours[key], theirs[key]
        assert not torch.equal(a, start), key
        spacing = _bf16_ulp(torch.maximum(torch.maximum(a.abs(), b.abs()), start.abs()))
        excess = ((a - b).abs() - spacing).max().item()
        assert excess <= 0.01 * LR, (key, excess / LR)
        if key.endswith("norm.weight"):
            assert torch.equal(b, start), key  # torch's AdamW rounds these updates away
            norms_moved.append((a != start).float().mean().item())
    assert len(norms_moved) == 5 and min(norms_moved) > 0.05, norms_moved
    second = {k: v.float() for k, v in model_weights(outs["ours"] / "step_2").items()}
    assert any(not torch.equal(second[k], ours[k]) for k in ours)
