"""Device-specific speed machinery behind one seam, chosen once from device and dtype.

:class:`Backend` holds the process-wide settings (:meth:`Backend.configure_process`) and the
weights a rollout's decode steps run on (:meth:`Backend.decode_weights`); :func:`backend_for`
picks it. The CPU backend keeps freed memory (:mod:`~torchtune_grpo.backends.allocator`) and
decodes on oneDNN-reordered, fused layers (:mod:`~torchtune_grpo.backends.cpu_decode`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["Backend", "CpuBackend", "backend_for"]


class Backend:
    """Nothing device-specific: what every device gets (the CUDA caching allocator already
    keeps freed memory; decode runs the model's own modules)."""

    #: Short name, for logs.
    name = "generic"
    #: Decode steps between checks of whether every row has stopped (the config's
    #: ``stop_check_interval: null``): each check is a host sync, which stalls an accelerator's
    #: queue; 16 decodes at most 15 steps of padding past the longest completion.
    stop_check_interval = 16
    #: Whether a rollout decodes all its rows as one batch (``rollout_batch_size: null``): on an
    #: accelerator a larger batch costs little more per step than a small one.
    decode_all_rows = True
    #: Whether the decode batch sheds its stopped rows at a check (two more host reads and a
    #: copy of the cache rows that stay): a smaller batch is hardly faster on an accelerator.
    shrink_finished_rows = False

    def configure_process(self, keep_freed_memory: bool = True) -> bool:
        """Process-wide settings, before the model and the step's tensors are allocated.

        Args:
            keep_freed_memory: the config's ``keep_freed_cpu_memory``.

        Returns:
            Whether a setting was applied.
        """
        return False

    @contextlib.contextmanager
    def decode_weights(self, model: nn.Module, enabled: bool = True) -> Iterator[int]:
        """Around one rollout's decode steps: run ``model`` on faster weights where this
        device has them; every module is restored on exit.

        Args:
            model: a torchtune decoder.
            enabled: False changes nothing (the engine's ``packed_weights: false``).

        Yields:
            The number of linear layers that decode on such weights (0 here).
        """
        yield 0


class CpuBackend(Backend):
    """The CPU: glibc's allocator keeps freed memory; decode steps on oneDNN-packed weights."""

    name = "cpu"
    #: A check reads memory the CPU just wrote: free, and it lets the batch shed stopped rows.
    stop_check_interval = 1
    #: Step time grows with the rows: ``forward_batch_size`` rows at a time, shedding stopped ones.
    decode_all_rows = False
    #: Step time is proportional to the rows: shedding stopped ones pays.
    shrink_finished_rows = True

    def configure_process(self, keep_freed_memory: bool = True) -> bool:
        """:func:`~torchtune_grpo.backends.allocator.keep_freed_memory` when asked."""
        if not keep_freed_memory:
            return False
        from torchtune_grpo.backends import allocator

        return allocator.keep_freed_memory()

    def decode_weights(self, model: nn.Module, enabled: bool = True
                       ) -> contextlib.AbstractContextManager[int]:
        """:func:`~torchtune_grpo.backends.cpu_decode.packed_linear_weights` (float32 CPU
        weights only; FSDP2, LoRA and other dtypes keep ``F.linear``)."""
        from torchtune_grpo.backends.cpu_decode import packed_linear_weights

        return packed_linear_weights(model, enabled)


def backend_for(device: torch.device | str) -> Backend:
    """The backend of ``device``: :class:`CpuBackend` for the CPU, :class:`Backend` elsewhere.

    The CPU backend's decode weights check each layer's dtype themselves (only float32 weights
    are packed), so the choice needs the device alone.
    """
    return CpuBackend() if torch.device(device).type == "cpu" else Backend()
