"""The optimizer of the bf16 configs, and one readable line when an optimizer fails to compile.

:class:`AdamW` is AdamW with float32 arithmetic and bf16 weights written back by stochastic
rounding, on plain or FSDP2-sharded (``DTensor``) parameters, without ``torch.compile``.
Why not torchao's ``_AdamW``, which the GPU configs used before:

* its stochastic rounding fails on FSDP2 shards (torchao 0.15, the last release torchtune 0.6.1
  imports with; pytorch/ao#2296): every run on several GPUs stopped at its first optimizer step
  (found by running it as ``tests/recipes/test_optimizer.py`` runs the optimizers);
* it compiles each parameter's step with ``torch.compile(fullgraph=True)``, which needs a C++
  compiler on CPU and Triton on a GPU. The update is a few memory-bound element-wise passes
  over each parameter shard, run eagerly here; ``scripts/gpu_check.sh`` (its optimizer part)
  times it against torchao's compiled step on a GPU.

:func:`explained_compile_errors` turns a ``torch._dynamo`` / inductor error raised while an
optimizer steps (torchao's compile their step) into an :class:`OptimizerCompileError`: one line
with the reason and the config key that avoids the compile.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtune_grpo.errors import UserError, one_line

__all__ = ["AdamW", "OptimizerCompileError", "compile_failure_line", "explained_compile_errors",
           "stochastic_round_bf16"]


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None
                          ) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16, away from zero with probability equal to the 16
    dropped mantissa bits read as a fraction, so that the expectation of the result is ``x``.

    Adding uniform 16-bit noise to the bit pattern and clearing the low 16 bits does exactly
    that (the pattern is sign and magnitude). The draws come from ``generator`` (default: the
    global one of ``x``'s device). Shape: any; returns the same shape in bfloat16.
    """
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device,
                          generator=generator)
    return noise.add_(bits).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s shard on this rank (the storage itself, updated in place); else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


#: Elements updated at once: a parameter shard above this is updated in slices, so that the
#: float32 temporaries of one update stay under ~64 MiB each (an embedding shard can be 1e8).
CHUNK = 1 << 24


def _chunks(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Slices of :data:`CHUNK` elements of same-shape tensors (flat views, written through), or
    the tensors whole when they are small or not contiguous."""
    size = CHUNK
    if tensors[0].numel() <= size or not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, flat[0].numel(), size):
        yield [f[start:start + size] for f in flat]


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) computed in float32; bf16 weights are written back with
    :func:`stochastic_round_bf16`.

    With round-to-nearest a bf16 weight keeps its value whenever the step is under half its
    spacing (~0.4% of the weight): at ``lr: 1e-6`` ``torch.optim.AdamW`` leaves such a model
    unchanged. Stochastic rounding lands those updates on average. Float32 weights are updated
    exactly as ``torch.optim.AdamW`` (``foreach=False``) does, to the bit.

    The state (``step``, ``exp_avg``, ``exp_avg_sq``) has ``torch.optim.AdamW``'s names and
    layout: the moments in the parameter's dtype and sharding, so that checkpoints save and
    load it alike. Under FSDP2 each rank updates its own shard. The rounding's random draws are
    a function of ``(seed, the parameter's step count, its index, the rank)`` alone, drawn from
    the optimizer's own generator: a resumed run rounds as the uninterrupted one would, and
    nothing else that draws from the global generator changes them.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: ``(beta1, beta2)``.
        eps: added to the denominator.
        weight_decay: decoupled weight decay (``p -= lr * weight_decay * p``).
        bf16_stochastic_round: round bf16 weights stochastically (True) or to nearest (False;
            then the update matches ``torch.optim.AdamW``'s up to its bf16 moment arithmetic).
            The name is torchao's, so a torchao ``_AdamW`` block switches by its
            ``_component_`` alone.
        seed: the seed of the rounding's draws.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, bf16_stochastic_round: bool = True,
                 seed: int = 0) -> None:
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0):
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, "
                             f"{weight_decay}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {tuple(betas)}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay})
        self.bf16_stochastic_round = bool(bf16_stochastic_round)
        self.seed = int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every parameter that has a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p,
                                                           memory_format=torch.preserve_format)
                state["step"] += 1  # a CPU scalar: reading it is no device sync
                step = float(state["step"])
                tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                generator = self._generator(tensors[0].device,
                                            hash((self.seed, int(step), index, rank)))
                for chunk in _chunks(tensors):
                    self._update(*chunk, step, group, generator)
        return loss

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        """This optimizer's generator on ``device``, seeded with ``seed`` (no device sync)."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device)
        return self._generators[device].manual_seed(seed & (2**63 - 1))

    def _update(self, p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: float, group: dict,
                generator: torch.Generator) -> None:
        """One parameter (shard): the moments and the weight, in float32; ``p`` and the moments
        are written in place in their own dtype."""
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = float(group["lr"]), group["eps"], group["weight_decay"]
        # float32 views: the tensors themselves when they are float32 (updated in place, as
        # torch.optim.AdamW does), else float32 copies written back below
        g, m, v = grad.float(), exp_avg.float(), exp_avg_sq.float()
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        for state, value in ((exp_avg, m), (exp_avg_sq, v)):
            if state is not value:
                state.copy_(value)
        denom = (v.sqrt_() if v is not exp_avg_sq else v.sqrt())
        denom.div_((1 - beta2**step) ** 0.5).add_(eps)
        new = p.float().mul(1 - lr * weight_decay)
        new.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
        if p.dtype == torch.bfloat16 and self.bf16_stochastic_round:
            new = stochastic_round_bf16(new, generator)
        p.copy_(new)


class OptimizerCompileError(UserError, RuntimeError):
    """An optimizer whose step ``torch.compile`` could not compile (no C++ compiler, no Triton,
    an unsupported parameter type): the reason and the key that avoids the compile."""


def _is_compile_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from ``torch._dynamo`` or inductor (compiling, not running)."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(exc, TorchDynamoException) or type(exc).__module__.startswith(
        ("torch._inductor", "torch._dynamo"))


def compile_failure_line(optimizer: torch.optim.Optimizer, exc: BaseException) -> str:
    """The one line of :class:`OptimizerCompileError` for ``optimizer`` and its error."""
    inner = getattr(exc, "inner_exception", None) or exc
    text = one_line(str(inner).split("Set TORCHDYNAMO_VERBOSE")[0])
    # dynamo reports an op that failed on fake tensors as "... got RuntimeError('why')"
    failed_op = re.search(r"got (\w+)\((['\"])(.+?)\2\)", text)
    if failed_op:
        text = f"{failed_op.group(1)}: {failed_op.group(3)}"
    reason = f"{type(inner).__name__}: {text}" if text else type(inner).__name__
    if len(reason) > 400:
        reason = reason[:397] + "..."
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    drop = (" and remove optimizer.bf16_stochastic_round"
            if hasattr(optimizer, "bf16_stochastic_round") else "")
    return (f"the optimizer {name} failed to compile its step with torch.compile ({reason}); "
            "set optimizer._component_=torchtune_grpo.optim.AdamW (the same AdamW, not "
            f"compiled; bf16 weights rounded stochastically) or optimizer._component_="
            f"torch.optim.AdamW{drop}")


@contextlib.contextmanager
def explained_compile_errors(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around ``optimizer.step()``: a ``torch._dynamo`` / inductor error becomes an
    :class:`OptimizerCompileError` (one line, exit 2 at the entry point); any other error passes
    unchanged. ``TUNE_GRPO_DEBUG=1`` shows the original traceback as its cause."""
    try:
        yield
    except Exception as exc:
        if not _is_compile_error(exc):
            raise
        raise OptimizerCompileError(compile_failure_line(optimizer, exc)) from exc
