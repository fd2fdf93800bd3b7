"""Terms of the memory estimate that :mod:`torchtune_grpo.cli.memory_estimate` adds to its
model-state and activation formulas: the rows the rollout decodes at once, the output layer's
gradient in the fused log-prob backward, FSDP2's unsharded root module, the float32 copies of
a low-precision output projection on CPU, and the CUDA context and NCCL buffers of each
process (``docs/memory.md`` gives every formula).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from torchtune_grpo.backends import backend_for

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "NCCL_BUFFER_BYTES",
    "activation_bytes_per_token",
    "component_notes",
    "fp32_output_weight_bytes",
    "head_weight_grad_bytes",
    "optimizer_states",
    "rollout_rows",
    "runtime_bytes",
]

#: Device memory a CUDA process holds outside PyTorch's allocator (so outside
#: ``torch.cuda.max_memory_allocated``): the CUDA context with its lazily loaded kernel images,
#: cuBLAS/cuBLASLt workspaces and the caching allocator's own bookkeeping. 1 GiB: a bare
#: ``import torch`` plus one CUDA tensor already shows ~0.8 GB in ``nvidia-smi``
#: (pytorch/pytorch#34323, 781 MB), and the matmul/attention libraries a training step loads
#: add their modules and workspaces on top.
CUDA_CONTEXT_BYTES = 1 << 30
#: Device memory NCCL allocates per rank once the process group has run its collectives
#: (FSDP2's all-gather and reduce-scatter, the recipe's all-reduces): staging buffers of
#: ``NCCL_BUFFSIZE`` (4 MiB by default) per channel and peer, up to 32 channels on an H100
#: node, plus NVLink SHARP buffers where NVLS is on. 1.5 GiB: NVIDIA/nccl#864 reports ~1.6 GB
#: for one communicator after an all-reduce; NVIDIA/nccl#1685 ~1.06 GB outside PyTorch's
#: allocator per H100 of an 8-GPU node (context included) before its first all-to-all (this
#: project runs none). A smaller ``NCCL_BUFFSIZE`` or ``NCCL_NVLS_ENABLE=0`` trades bandwidth
#: for it.
NCCL_BUFFER_BYTES = 3 << 29


def rollout_rows(cfg: DictConfig, rows: int, device: str) -> int:
    """Rows the native engine decodes at once, i.e. the rows of its one KV cache.

    ``rollout_batch_size`` when set; unset or null: all ``rows`` of the rank on CUDA, and
    ``forward_batch_size`` (all rows when that is null) on CPU. Never more than ``rows``: the
    rows one rollout chunk holds (``batch_size * group_size / gradient_accumulation_steps``).

    Args:
        cfg: a training config (``rollout_batch_size`` read with ``get``: configs from before
            the key still size).
        rows: the rows of one rollout chunk on this rank.
        device: the config's ``device``.
    """
    value = cfg.get("rollout_batch_size")
    if value is None:
        value = rows if backend_for(device).decode_all_rows else (
            cfg.get("forward_batch_size") or rows)
    return max(1, min(int(value), rows))


def head_weight_grad_bytes(vocab: int, dim: int, dtype_bytes: int, *, fused: bool,
                           trainable: bool) -> int:
    """Peak bytes of the output weight's gradient while the log-prob backward runs, beyond the
    parameter's own ``.grad``.

    The fused function (``policy/logprobs.py``, ``_FusedLinearLogProbs.backward``) accumulates
    ``dL/dW [V, D]`` in float32 over the chunks (``4 V D``); in a lower precision each chunk's
    ``grad_z.T @ h`` is a ``[V, D]`` product in that dtype and its float32 copy before it is
    added (``(b + 4) V D`` more, alive at once with the accumulator). In float32 the chunks
    ``addmm_`` into the accumulator. The checkpointed path (entropy bonus) lets autograd
    accumulate: one ``[V, D]`` chunk gradient in ``dtype`` beside the parameter's ``.grad``.
    Zero when the output weight is frozen (LoRA).
    """
    if not trainable:
        return 0
    elements = vocab * dim
    if not fused:
        return elements * dtype_bytes
    return elements * (4 if dtype_bytes == 4 else 4 + dtype_bytes + 4)


def fp32_output_weight_bytes(vocab: int, dim: int, dtype_bytes: int, device: str,
                             rows: int) -> int:
    """Float32 copies that a low-precision model's float32 output projection makes on CPU per
    log-prob call (``policy/logprobs.py``, ``float_matmul``): the ``[rows, D]`` hidden states in
    float32 and the ``[V, D]`` weight ``UPCAST_BLOCK_ELEMENTS`` at a time (16 MiB; the whole
    weight where the block size is not defined). 0 in float32, and on CUDA, where the matmul
    writes float32 from the low-precision operands without a copy."""
    if dtype_bytes == 4 or str(device).startswith("cuda"):
        return 0
    from torchtune_grpo.policy import logprobs

    block = min(int(getattr(logprobs, "UPCAST_BLOCK_ELEMENTS", vocab * dim)), vocab * dim)
    return 4 * (block + rows * dim)


def runtime_bytes(device: str, world_size: int) -> int:
    """Device bytes outside PyTorch's allocator per process: :data:`CUDA_CONTEXT_BYTES` on
    CUDA, plus :data:`NCCL_BUFFER_BYTES` with several ranks; 0 on CPU."""
    if not str(device).startswith("cuda"):
        return 0
    return CUDA_CONTEXT_BYTES + (NCCL_BUFFER_BYTES if world_size > 1 else 0)


def component_notes(*, rows: int, positions: int, micro: int, seq: int, chunk: int,
                    vocab: int, dim: int, dtype: str, fused: bool, world_size: int,
                    states: float) -> dict[str, str]:
    """What each component of the estimate counts, one line each (for its table)."""
    shard = f" / {world_size} ranks" if world_size > 1 else ""
    products = " (+ a chunk's product, its float32 copy)" if fused and dtype != "fp32" else ""
    nccl = f" + NCCL buffers ({NCCL_BUFFER_BYTES / 2**30:g} GiB)" if world_size > 1 else ""
    return {
        "weights": f"policy parameters in {dtype}{shard}",
        "gradients": f"gradients of the trainable parameters{shard}",
        "optimizer_state": f"{states:g} optimizer states per trainable parameter{shard}",
        "reference_model": f"frozen KL reference copy{shard}",
        "kv_cache": f"rollout KV cache: {rows} rows decoded at once x {positions} positions",
        "activations": f"update: activations of a micro-batch of {micro} rows x {seq} tokens",
        "logits": f"log-probs: float32 [{chunk}, V] blocks + softmax kept for the backward",
        "head_weight_grad": f"log-prob backward: float32 [{vocab}, {dim}] weight grad{products}",
        "fsdp_root": "FSDP2 root (embedding, final norm, untied output) gathered + its gradient",
        "gathered_weights": "one unsharded copy of the weights in the rollout/reference pass",
        "packed_weights": "CPU rollout: oneDNN-reordered copies of the linear weights",
        "fp32_output_weight": "CPU, low precision: float32 copies for the float32 logits",
        "reward_models": "learned reward models on this device",
        "cuda_runtime": (f"CUDA context ({CUDA_CONTEXT_BYTES / 2**30:g} GiB){nccl}, outside "
                         "torch's allocator"),
        "other": "rollout buffers, sampling and prefill temporaries, FSDP's gathered layers",
    }


def optimizer_states(cfg_optimizer: DictConfig | None) -> float:
    """Per-parameter states the optimizer keeps (in the parameter's dtype)."""
    if cfg_optimizer is None:
        return 2.0
    name = str(cfg_optimizer.get("_component_", "")).rsplit(".", 1)[-1].lower()
    if name == "sgd":
        return 1.0 if float(cfg_optimizer.get("momentum", 0.0) or 0.0) else 0.0
    if name in ("adamw", "adam"):
        return 3.0 if cfg_optimizer.get("amsgrad", False) else 2.0
    if "8bit" in name:
        return 0.5  # two 8-bit states at 2 bytes/param -> about half of two bf16 states
    return 2.0


def activation_bytes_per_token(dims: Any, dtype_bytes: int) -> dict[str, float]:
    """Bytes autograd saves per token: per transformer layer and once after the last layer
    (``dims``: a :class:`~torchtune_grpo.cli.memory_estimate.ModelDims`).

    Per layer: each RMSNorm saves its float32 input and its normalised output (``4 + b``
    bytes per value); RoPE saves float32 q and k; SDPA saves q, the (GQA-expanded) k and v and
    its output, and the output projection its input (``5 D`` values); the SwiGLU MLP saves
    ``w1(x)``, ``silu``, ``w3(x)`` and their product (``4 F``).
    """
    d, f = dims.embed_dim, dims.hidden_dim
    kv = dims.num_kv_heads * dims.head_dim
    q = dims.num_heads * dims.head_dim
    b = dtype_bytes
    norm = (4 + b) * d
    layer = 2 * norm + 4 * (q + kv) + b * (4 * q + d) + 4 * b * f
    return {"layer": float(layer), "final": float(norm + b * d)}
