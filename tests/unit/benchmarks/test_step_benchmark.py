"""benchmarks.step: the FLOP counts behind its bounds and the torchtune-dev peer's errors."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest
import torch

from benchmarks import step


def test_phase_flops_count_real_tokens_only():
    from torchtune_grpo.algorithm.trajectory import Trajectory
    from torchtune_grpo.quickstart.tiny import tiny_llama

    model = tiny_llama(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32,
                       max_seq_len=64)
    n, p, t = 4, 6, 5
    prompt_mask = torch.ones(n, p, dtype=torch.bool)
    prompt_mask[2:, :2] = False  # a shorter prompt for the second group
    response_mask = torch.ones(n, t, dtype=torch.bool)
    response_mask[1, 3:] = False
    traj = Trajectory(tokens=torch.zeros(n, p + t, dtype=torch.long), prompt_mask=prompt_mask,
                      response_mask=response_mask, logprobs=torch.zeros(n, t),
                      stopped=torch.zeros(n, dtype=torch.bool), pad_id=0)
    flops = step.phase_flops(model, traj, group_size=2)
    assert flops["update"] == 3 * flops["reference"]
    assert 0 < flops["generation_decode"] < flops["generation"]
    # padding costs nothing: a padded copy of the same real tokens counts the same
    padded = Trajectory(tokens=torch.zeros(n, p + 2 + t + 3, dtype=torch.long),
                        prompt_mask=torch.cat([torch.zeros(n, 2, dtype=torch.bool),
                                               prompt_mask], 1),
                        response_mask=torch.cat([response_mask,
                                                 torch.zeros(n, 3, dtype=torch.bool)], 1),
                        logprobs=torch.zeros(n, t + 3), stopped=traj.stopped, pad_id=0)
    assert step.phase_flops(model, padded, group_size=2) == flops
    # the output projection dominates the decode FLOPs of a large vocabulary
    body = 2 * sum(m.weight.numel() for m in model.modules()
                   if isinstance(m, torch.nn.Linear) and m is not model.output)
    assert flops["generation_decode"] > int(response_mask.sum()) * (body + 2 * 64 * 32)


def test_peer_that_cannot_run_says_how_to_install(tmp_path):
    args = Namespace(peer_python=tmp_path / "no-venv" / "bin" / "python",
                     torchtune_src=tmp_path / "torchtune", device="cpu", new_tokens=8, steps=1,
                     threads=1)
    with pytest.raises(step.PeerUnavailable, match="setup_torchtune_dev.sh"):
        step.run_peer(tmp_path, args, prompts=[{"tokens": [[1, 2]], "answers": ["1"]}])


def test_peer_python_without_the_recipe_is_refused(tmp_path):
    """A Python that exists but cannot import the dev recipe (no checkout there)."""
    import sys

    args = Namespace(peer_python=Path(sys.executable), torchtune_src=tmp_path / "missing",
                     device="cpu", new_tokens=8, steps=1, threads=1)
    with pytest.raises(step.PeerUnavailable, match="cannot be run"):
        step.run_peer(tmp_path, args, prompts=[{"tokens": [[1, 2]], "answers": ["1"]}])
