"""One update micro-batch (packed, prompts shared) waits for the host a fixed number of times,
whatever its rows and layers, and builds its attention masks once.

A CPU test of a GPU property: on a GPU every host read of a device value (``.item()``,
``bool(t)``, ``.tolist()``...) stalls the launch queue, and every ``.to(device)`` of a host
tensor is a host-to-device copy. On the CPU nothing stalls, so the test counts them: a
``TorchDispatchMode`` sees ``aten._local_scalar_dense`` / ``aten.is_nonzero`` and the ops whose
output shape depends on values (``nonzero``, indexing by a bool mask); wrapped ``Tensor``
methods see the Python-level reads and ``.to`` calls that a dispatch mode cannot see on a CPU.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchtune import modules, training

from torchtune_grpo import distributed as D
from torchtune_grpo.algorithm.loss import GRPOLoss
from torchtune_grpo.algorithm.trajectory import Trajectory, prompt_mask
from torchtune_grpo.policy import packing
from torchtune_grpo.quickstart.tiny import tiny_llama
from torchtune_grpo.training.update import PolicyUpdate, UpdateSettings

P, T, G = 12, 16, 4
aten = torch.ops.aten
_SYNC_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default}
_SHAPE_OPS = {aten.nonzero.default, aten.masked_select.default}
_HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__")


class _Counts(TorchDispatchMode):
    """Dispatch-level host syncs, and the ops whose output shape is data-dependent (a sync on
    CUDA)."""

    def __init__(self):
        super().__init__()
        self.syncs = 0
        self.dynamic_shapes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SYNC_OPS:
            self.syncs += 1
        elif func in _SHAPE_OPS or (
                func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default)
                and any(getattr(i, "dtype", None) == torch.bool for i in args[1])):
            self.dynamic_shapes += 1
        return func(*args, **(kwargs or {}))


def _counting(calls: dict, name: str, fn, counts=lambda *args, **kwargs: True):
    """``fn``, adding 1 to ``calls[name]`` at each call for which ``counts`` holds."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls[name] += bool(counts(*args, **kwargs))
        return fn(*args, **kwargs)
    return wrapper


def _names_a_device(tensor, *args, **kwargs) -> bool:
    """Whether a ``Tensor.to`` call may move ``tensor`` to another device (a host-to-device
    copy on a GPU when it starts on the host); a dtype cast alone does not."""
    return "device" in kwargs or any(
        isinstance(a, (torch.device, str, torch.Tensor)) for a in args)


def _trajectory(rows: int) -> Trajectory:
    """``rows`` completions, ``G`` per prompt, of varied prompt and response lengths."""
    gen = torch.Generator().manual_seed(rows)
    groups = rows // G
    prompt_lengths = torch.tensor([5 + 3 * (r // G) for r in range(rows)])
    response_lengths = torch.randint(1, T + 1, (rows,), generator=gen)
    p_mask = prompt_mask(torch.zeros(rows, P, dtype=torch.long), prompt_lengths)
    r_mask = torch.arange(T)[None, :] < response_lengths[:, None]
    tokens = torch.randint(1, 300, (rows, P + T), generator=gen)
    tokens[:, :P] = tokens[::G, :P].repeat_interleave(G, 0)[:groups * G]
    tokens = torch.where(torch.cat([p_mask, r_mask], dim=1), tokens, 0)
    logprobs = torch.where(r_mask, -torch.rand(rows, T, generator=gen) - 4.0, 0.0)
    return Trajectory(tokens, p_mask, r_mask, logprobs, torch.ones(rows, dtype=torch.bool), 0)


def micro_batch_counts(num_layers: int, rows: int, *, checkpointing: bool,
                       patch, mask_builder: str = "suffix_masks") -> dict[str, int]:
    """Counts of one micro-batch's forward and backward, the body of
    :meth:`PolicyUpdate.update` (packed, prompts shared) on a tiny ``num_layers`` policy.

    ``patch(obj, name, value)`` sets an attribute for the duration of the test (pytest's
    ``monkeypatch.setattr``); ``mask_builder``: the function of
    :mod:`~torchtune_grpo.policy.packing` that builds attention masks.
    """
    torch.manual_seed(0)
    model = tiny_llama(num_layers=num_layers)
    if checkpointing:
        training.set_activation_checkpointing(
            model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    loss_fn = GRPOLoss(entropy_coeff=0.01)
    settings = UpdateSettings(
        ppo_epochs=1, forward_batch_size=rows, group_size=G, seed=0, temperature=0.7,
        packed=True, share_prompt_forward=True, clip_grad_norm=None,
        skip_zero_advantage_sequences=False, gather_weights=False, chunk_size=1024,
        keep_probs=0)
    update = PolicyUpdate(
        model, None, None, loss_fn, D.Ranks(D.LOCAL), torch.device("cpu"), settings,
        logit_bias=torch.zeros(320), ref_model=None, is_lora=False,
        activation_offloading=contextlib.nullcontext())
    traj = _trajectory(rows)
    advantages = torch.randn(rows, generator=torch.Generator().manual_seed(1))
    normalizer = update.normalizer(traj.response_mask)
    idx = update.micro_batch_order(rows, step=0, epoch=0)

    calls = dict.fromkeys((*_HOST_READS, "to", "mask_builds"), 0)
    for name in _HOST_READS:
        patch(torch.Tensor, name, _counting(calls, name, getattr(torch.Tensor, name)))
    patch(torch.Tensor, "to", _counting(calls, "to", torch.Tensor.to, _names_a_device))
    patch(packing, mask_builder, _counting(calls, "mask_builds",
                                           getattr(packing, mask_builder)))
    with _Counts() as mode:
        logprobs, entropy = update.micro_batch_logprobs(
            model, traj, idx, return_entropy=True, entropy_grad=loss_fn.needs_entropy)
        loss, _ = loss_fn(logprobs, traj.logprobs[idx], advantages[idx],
                          traj.response_mask[idx], normalizer=normalizer, entropy=entropy)
        loss.backward()
    counts = {"syncs": mode.syncs, "dynamic_shapes": mode.dynamic_shapes,
              "host_reads": sum(calls[n] for n in _HOST_READS), "device_moves": calls["to"],
              "mask_builds": calls["mask_builds"]}
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters())
    return counts


@pytest.mark.parametrize("checkpointing", [False, True])
def test_host_waits_and_mask_builds_do_not_grow_with_rows_or_layers(monkeypatch,
                                                                    checkpointing):
    counts = {}
    for num_layers in (2, 4):
        for rows in (4, 8):
            with monkeypatch.context() as m:
                counts[num_layers, rows] = micro_batch_counts(
                    num_layers, rows, checkpointing=checkpointing, patch=m.setattr)
    first = counts[2, 4]
    assert first["syncs"] > 0 and first["host_reads"] > 0  # the counters see them
    assert all(c == first for c in counts.values()), counts
    assert first["mask_builds"] == 1  # once per micro-batch: every layer and recompute reuse it
