"""Estimate the peak memory of a GRPO config on one rank, before launching it.

:func:`estimate_memory` builds the model on the ``meta`` device and adds up, in bytes, the
static state (weights, optimizer state, reference model, reward models, and on CUDA the
context and NCCL buffers of :mod:`~torchtune_grpo.cli.memory_terms`) and the largest of the
phases (load on CPU, rollout, reference, rewards, update). ``docs/memory.md`` gives every
component's formula; the estimate leaves out allocator fragmentation. A model read from a
folder that is not downloaded yet is built from its released shape
(:mod:`torchtune_grpo.cli.known_shapes`), and the estimate says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from torchtune_grpo.cli.known_shapes import config_text, model_node
from torchtune_grpo.cli.memory_rewards import DTYPE_BYTES, by_device, learned_reward_memory
from torchtune_grpo.cli.memory_terms import (
    activation_bytes_per_token,
    component_notes,
    fp32_output_weight_bytes,
    head_weight_grad_bytes,
    optimizer_states,
    rollout_rows,
    runtime_bytes,
)
from torchtune_grpo.policy.logprobs import auto_chunk_size

#: Prompt tokens assumed when the dataset sets no ``max_prompt_tokens`` (GSM8K prompts with a
#: chat template are ~100-250 tokens).
DEFAULT_PROMPT_TOKENS = 256
#: Float32 ``[chunk, V]`` blocks alive at once in the checkpointed log-prob backward (logits,
#: their float copy, log-softmax, probabilities for the entropy, and the gradients of the
#: recompute): the path taken when the entropy is differentiated (``loss.entropy_coeff != 0``)
#: or the output projection is not a plain linear map (LoRA on the output).
LOGIT_COPIES = 6
#: Float32 ``[chunk, V]`` blocks of the fused log-prob function (``logprobs._FusedLinearLogProbs``),
#: reused by every chunk: the logits buffer and the probabilities (the metric entropy in the
#: forward, the softmax gradient in the backward); plus one block in ``dtype`` when that is not
#: float32 (the matmul's own output).
FUSED_LOGIT_COPIES = 2
GIB = 1024**3
#: Prompt lengths of shipped datasets whose prompts are far from the default, by builder name.
KNOWN_PROMPT_TOKENS = {"addition_dataset": 16}


@dataclass(frozen=True)
class ModelDims:
    """Shapes of a decoder, read from the model built on the meta device.

    Attributes:
        num_params: every parameter (tied embeddings counted once).
        trainable_params: parameters that get gradients (LoRA: the adapters only).
        layer_params: parameters of the largest transformer layer.
        largest_param: elements of the largest single parameter.
        num_layers: transformer layers.
        num_heads: query heads.
        num_kv_heads: key/value heads.
        head_dim: dimension per head.
        embed_dim: model dimension ``D``.
        hidden_dim: MLP hidden dimension ``F``.
        vocab_size: rows of the output projection ``V``.
        max_seq_len: the model's context length.
        is_lora: the config builds LoRA/DoRA adapters.
        root_params: parameters outside the transformer layers (embedding, final norm, an
            untied output projection): FSDP2's root module, which torchtune's per-layer shard
            conditions leave to the root's own (unsharded during forward and backward) group.
        root_trainable: the trainable ones among them.
        source: ``None`` when the shape is the config's or its folder's ``config.json``; the
            HF repo id whose released shape (:data:`~.known_shapes.KNOWN_SHAPES`) stood in for
            a folder without one (not downloaded yet).
    """

    num_params: int
    trainable_params: int
    layer_params: int
    largest_param: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    embed_dim: int
    hidden_dim: int
    vocab_size: int
    max_seq_len: int
    is_lora: bool
    source: str | None = None
    root_params: int = 0
    root_trainable: int = 0


def model_dims(cfg_model: DictConfig, *, header: str | None = None) -> ModelDims:
    """Instantiate ``cfg_model`` on the meta device and read its dimensions (no allocation).

    A model read from a folder (``model_dir``) without a ``config.json`` is built from the
    released shape of the model the folder is for (:func:`~.known_shapes.known_shape`; the
    config file's text ``header`` names its repo), and ``source`` names that repo.
    """
    from torchtune import config

    with model_node(cfg_model, header) as (node, source), torch.device("meta"):
        model = config.instantiate(node)
    return _read_dims(model, source)


def _read_dims(model: torch.nn.Module, source: str | None) -> ModelDims:
    """The :class:`ModelDims` of a model built on the meta device."""
    from torchtune.modules.peft import get_adapter_params

    from torchtune_grpo.policy.kv_cache import attention_modules
    from torchtune_grpo.policy.model import output_vocab_size

    adapters = get_adapter_params(model)
    params = dict(model.named_parameters())  # de-duplicates tied weights
    attn = attention_modules(model)[0]
    layers = list(getattr(model, "layers", []))
    layer_params = max((sum(p.numel() for p in layer.parameters()) for layer in layers),
                       default=0)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = [(n, p) for n, p in params.items() if id(p) not in in_layers]
    hidden_dim = 0
    for name, p in params.items():
        if name.endswith(("mlp.w1.weight", "mlp.w1.base_weight")):
            hidden_dim = int(p.shape[0])
            break
    if not hidden_dim:  # LoRA linears keep the frozen weight as ``weight`` too
        for module in model.modules():
            w1 = getattr(module, "w1", None)
            if w1 is not None and hasattr(w1, "out_dim"):
                hidden_dim = int(w1.out_dim)
                break
    return ModelDims(
        num_params=sum(p.numel() for p in params.values()),
        trainable_params=(sum(p.numel() for p in adapters.values()) if adapters
                          else sum(p.numel() for p in params.values())),
        layer_params=layer_params,
        largest_param=max(p.numel() for p in params.values()),
        num_layers=len(attention_modules(model)),
        num_heads=int(attn.num_heads),
        num_kv_heads=int(attn.num_kv_heads),
        head_dim=int(attn.head_dim),
        embed_dim=int(attn.embed_dim),
        hidden_dim=hidden_dim,
        vocab_size=output_vocab_size(model),
        max_seq_len=int(getattr(model, "max_seq_len", 0) or 0),
        is_lora=bool(adapters),
        source=source,
        root_params=sum(p.numel() for _, p in root),
        root_trainable=sum(p.numel() for n, p in root if not adapters or n in adapters),
    )


@dataclass
class MemoryEstimate:
    """Estimated peak memory of one rank, broken down by component (bytes).

    Attributes:
        config: the config's name (for tables).
        world_size: ranks the estimate is for.
        components: device bytes by component (``weights``, ``gradients``,
            ``optimizer_state``, ``reference_model``, ``kv_cache``, ``activations``, ``logits``,
            ``head_weight_grad``, ``fsdp_root``, ``gathered_weights``, ``fp32_output_weight``,
            ``cuda_runtime``, ``other``, ...); ``settings["notes"]`` says what each counts.
        phases: device bytes at the peak of each phase (``load`` only on CPU).
        peak_bytes: the largest phase.
        peak_phase: which phase it is.
        host_bytes: host memory of offloaded state (``fsdp_cpu_offload``), not in the peak.
        other_devices: bytes of learned-reward models on other devices, by device; not in the
            peak.
        settings: the numbers the estimate used (rows, lengths, dtype, ...).
        dims: the model's dimensions.
    """

    config: str
    world_size: int
    components: dict[str, int]
    phases: dict[str, int]
    peak_bytes: int
    peak_phase: str
    host_bytes: int = 0
    other_devices: dict[str, int] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    dims: ModelDims | None = None

    @property
    def peak_gib(self) -> float:
        """The peak in GiB."""
        return self.peak_bytes / GIB

    @property
    def allocated_peak_bytes(self) -> int:
        """The peak without the CUDA context and NCCL buffers: what PyTorch's allocator holds
        (``torch.cuda.max_memory_allocated`` measures this)."""
        return self.peak_bytes - self.components.get("cuda_runtime", 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (bytes and GiB)."""
        out = asdict(self)
        out["peak_gib"] = round(self.peak_gib, 3)
        return out

    def table(self) -> str:
        """A plain-text breakdown: one row per component, then the phases and the peak."""
        s = self.settings
        kind = "LoRA" if s["lora"] else "full"
        dims = self.dims
        lines = [
            (f"{self.config}  (world_size={self.world_size}, dtype={s['dtype']}, {kind}, "
             f"activation_checkpointing={s['activation_checkpointing']})"),
            (f"  model: {dims.num_params / 1e9:.3f}B params, "
             f"{dims.trainable_params / 1e6:.1f}M trainable, {dims.num_layers} layers, "
             f"V={dims.vocab_size}"),
            (f"  rows per rank={s['rows']} ({s['generation_rows']} decoded at once, update "
             f"micro-batch {s['micro_batch']}), P={s['prompt_tokens']}, "
             f"T={s['max_generated_tokens']}"),
        ]
        if s.get("shape_note"):
            lines.append(f"  shape: {s['shape_note']}")
        lines.append(f"  {'component':<18}{'GiB':>10}  what it counts")
        notes = s.get("notes", {})
        for name, value in self.components.items():
            lines.append(f"  {name:<18}{value / GIB:>10.2f}  {notes.get(name, '')}".rstrip())
        lines.append(f"  {'phase':<18}{'GiB':>10}")
        for name, value in self.phases.items():
            mark = "  <- peak" if name == self.peak_phase else ""
            lines.append(f"  {name:<18}{value / GIB:>10.2f}{mark}")
        if self.host_bytes:
            lines.append(f"  {'host (offloaded)':<18}{self.host_bytes / GIB:>10.2f}")
        lines.append(f"  {'PEAK':<18}{self.peak_gib:>10.2f}")
        lines += [f"  {'rewards on ' + device:<18}{value / GIB:>10.2f}  (not in the peak)"
                  for device, value in self.other_devices.items()]
        lines += [f"  not counted: {note}" for note in s.get("not_counted", [])]
        return "\n".join(lines)


def _prompt_tokens(cfg: DictConfig, default: int) -> int:
    """``dataset.max_prompt_tokens``, a known dataset's prompt length, else ``default``."""
    dataset = cfg.get("dataset") or {}
    value = dataset.get("max_prompt_tokens")
    if value:
        return int(value)
    builder = str(dataset.get("_component_", "")).rsplit(".", 1)[-1]
    return int(KNOWN_PROMPT_TOKENS.get(builder, default))


def estimate_memory(cfg: DictConfig, world_size: int = 1, *,
                    prompt_tokens: int | None = None, name: str = "config",
                    verbose: bool = False) -> MemoryEstimate:
    """Estimate the peak memory per rank of a GRPO training config.

    Args:
        cfg: a training config (as from :func:`torchtune_grpo.config.loading.load_config`).
        world_size: ranks; for an asynchronous config all processes, of which the trainer
            ranks' estimate is returned.
        prompt_tokens: assumed prompt length ``P``; default ``dataset.max_prompt_tokens``, else
            :data:`KNOWN_PROMPT_TOKENS` for the dataset, else :data:`DEFAULT_PROMPT_TOKENS`.
        name: the config's name, for the table.
        verbose: print the breakdown table.

    Returns:
        The :class:`MemoryEstimate`.
    """
    from torchtune_grpo.config.schema import per_rank_batch_size

    if cfg.get("rollout_ranks") is not None:
        # async_grpo_full_finetune_distributed: the trainer ranks' peak, FSDP2 over the
        # world_size - rollout_ranks trainers (each also keeps max_staleness shard copies of the
        # weights, a small extra not counted; a rollout rank holds the whole model and its KV
        # cache, about the one-rank estimate's rollout phase)
        world_size = max(1, world_size - int(cfg.rollout_ranks))
    dims = model_dims(cfg.model, header=config_text(name))
    dtype = str(cfg.get("dtype", "bf16"))
    b = DTYPE_BYTES[dtype]
    device = str(cfg.get("device", "cuda"))
    fsdp = world_size > 1
    offload = fsdp and bool(cfg.get("fsdp_cpu_offload", False))
    reshard = bool(cfg.get("fsdp_reshard_after_forward", True))
    gather_once = fsdp and bool(cfg.get("rollout_gather_weights", True))
    native = str((cfg.get("generator") or {}).get("_component_", "NativeGenerator")).endswith(
        "NativeGenerator")
    ac = bool(cfg.get("enable_activation_checkpointing", False))
    kl = float((cfg.get("loss") or {}).get("kl_coeff", 0.0) or 0.0) != 0.0

    rows = per_rank_batch_size(cfg, world_size) * int(cfg.group_size)
    accum = int(cfg.get("gradient_accumulation_steps", 1) or 1)
    fbs = int(cfg.get("forward_batch_size") or rows)
    gen_rows = rollout_rows(cfg, rows // accum, device)  # one KV cache of this many rows
    micro = min(fbs, rows)
    group = int(cfg.group_size)
    t_gen = int(cfg.max_generated_tokens)
    p = prompt_tokens if prompt_tokens is not None else _prompt_tokens(cfg, DEFAULT_PROMPT_TOKENS)
    seq = p + t_gen
    vocab, d = dims.vocab_size, dims.embed_dim
    chunk = cfg.get("logprob_chunk_size")
    chunk = auto_chunk_size(vocab) if chunk is None else int(chunk)

    # ---- static state
    shard = world_size if fsdp else 1
    weights = dims.num_params * b / shard
    # FSDP2 gathers the layer it computes (and prefetches the next); without resharding the
    # gathered layers stay until the backward. torchtune's shard conditions shard per layer:
    # the rest (embedding, final norm, untied output) is the root's group, gathered from the
    # forward's start to the backward's end, with its unsharded gradient in the backward.
    gathered = root = root_grad = 0.0
    if fsdp:
        root = dims.root_params * b
        root_grad = dims.root_trainable * b
        gathered = (2 if reshard else dims.num_layers) * dims.layer_params * b + root
    grads = dims.trainable_params * b / shard
    states = optimizer_states(cfg.get("optimizer"))
    optimizer = dims.trainable_params * b * states / shard
    fused = bool((cfg.get("optimizer") or {}).get("fused", False)) and device == "cuda"
    if device == "cuda" and not fused:  # foreach AdamW: about one parameter-sized temporary
        opt_temp = dims.trainable_params * b / shard
    else:  # fused kernel, or the per-parameter loop used on CPU
        opt_temp = 2 * min(dims.largest_param, dims.trainable_params) * b / shard
    reference = dims.num_params * b / shard if kl and not dims.is_lora else 0.0
    # rollout_gather_weights: a no-grad phase holds one full copy (policy or reference) instead
    # of FSDP's per-forward layers
    full_copy = dims.num_params * b if gather_once else 0.0
    rollout_gathered = full_copy if native and gather_once else gathered
    reference_gathered = full_copy if gather_once else gathered

    # ---- rollout: KV cache of one generation micro-batch, prefill and sampling temporaries
    # with tools a turn's prompt is a row's whole sequence so far: up to max_seq_len positions
    kv_positions = max(seq, dims.max_seq_len) if cfg.get("tools") else seq
    kv_cache = (gen_rows * dims.num_layers * 2 * dims.num_kv_heads * dims.head_dim
                * kv_positions * b)
    prompts_per_micro = max(1, -(-gen_rows // group))
    act = activation_bytes_per_token(dims, b)
    prefill = prompts_per_micro * p * (act["layer"] + b * dims.num_heads * p)
    sampling = gen_rows * vocab * 4 * 4
    # NativeGenerator(packed_weights=True) on CPU: oneDNN-reordered copies of the float32
    # linear weights (body and output projection; not LoRA layers, not FSDP shards) for the
    # rollout's duration
    gen_cfg = cfg.get("generator") or {}
    packed = 0.0
    if (native and device == "cpu" and dtype == "fp32" and not fsdp
            and bool(gen_cfg.get("packed_weights", True))
            and not bool(gen_cfg.get("compile_decode", False))):
        body = 0 if dims.is_lora else dims.num_layers * dims.layer_params
        packed = (body + dims.vocab_size * dims.embed_dim) * b
    # a low-precision model's float32 output projection on CPU: float32 copies of the hidden
    # rows and of a block of the weight per log-prob call (decode steps, reference, update)
    upcast = fp32_output_weight_bytes(vocab, d, b, device, max(chunk, gen_rows))
    generation = kv_cache + prefill + sampling + rollout_gathered + packed + upcast

    # ---- update: one micro-batch of `micro` rows of `seq` tokens
    tokens = micro * seq
    response_tokens = micro * t_gen
    mask_layer = micro * seq * seq * b  # SDPA turns the bool mask into an additive float mask
    if ac:
        activations = (dims.num_layers * b * d + act["layer"]) * tokens + mask_layer
    else:
        activations = dims.num_layers * (act["layer"] * tokens + mask_layer)
    activations += act["final"] * response_tokens
    loss_cfg = cfg.get("loss") or {}
    entropy_grad = float(loss_cfg.get("entropy_coeff", 0.0) or 0.0) != 0.0
    lora_output = bool((cfg.model or {}).get("apply_lora_to_output", False))
    fused = not (entropy_grad or lora_output)
    block = min(chunk, response_tokens) * vocab
    low = block * b if b != 4 else 0  # the fused matmul's own low-precision output block
    logits = (FUSED_LOGIT_COPIES * block * 4 + low) if fused else LOGIT_COPIES * block * 4
    if fused:  # softmax blocks the forward keeps for the backward (logprob_keep_probs_mib)
        keep = int(cfg.get("logprob_keep_probs_mib", 512)) * 2**20 // 4
        kept = (response_tokens if response_tokens * vocab <= keep
                else keep // vocab // chunk * chunk)
        logits += kept * vocab * 4
    # rollout buffers kept through the update: the [N, S, S] bool mask, tokens, log-probs
    buffers = rows * seq * seq + rows * seq * 8 + rows * t_gen * 4 * 4 + micro * seq * seq
    # the log-prob backward runs first, beside every saved activation: the output weight's
    # float32 gradient accumulator (and its chunk products); later the layers' backward holds
    # the root's unsharded gradient instead (FSDP2 reduce-scatters it at the backward's end)
    head_grad = head_weight_grad_bytes(vocab, d, b, fused=fused,
                                       trainable=not dims.is_lora)
    backward = activations + gathered + max(logits + head_grad + upcast, root_grad)
    update = grads + max(backward, opt_temp) + buffers
    ref_logits = (block * 4 + low) if fused else 3 * block * 4  # no grad: one block when fused
    reference_pass = (act["layer"] * tokens + mask_layer + ref_logits + upcast + buffers
                      + reference_gathered) if kl else 0.0

    host = 0.0
    if offload:  # FSDP keeps shards, gradients and optimizer state on the host
        host = weights + grads + optimizer + reference
        weights = grads = optimizer = reference = 0.0
        update = backward + buffers

    learned, not_counted = learned_reward_memory(cfg)
    local, other_devices = by_device(learned, device)
    reward_models = float(sum(r.weights for r in local))

    runtime = runtime_bytes(device, world_size)  # CUDA context and NCCL: every phase
    static = weights + optimizer + reference + reward_models + runtime
    phases = {"rollout": static + generation}
    if kl:
        phases["reference"] = static + reference_pass
    if local:  # components score one after the other: the largest batch counts
        phases["rewards"] = static + buffers + max(r.scoring for r in local)
    phases["update"] = static + update
    if device == "cpu":  # the checkpoint's state dict and the fresh model side by side
        phases["load"] = 2 * weights + reference + reward_models
    peak_phase = max(phases, key=phases.get)
    components = {
        "weights": weights,
        "gradients": grads if not offload else 0.0,
        "optimizer_state": optimizer,
        "reference_model": reference,
        "kv_cache": kv_cache,
        "activations": activations,
        "logits": logits,
        "head_weight_grad": head_grad,
        "fsdp_root": root + root_grad,
        "gathered_weights": full_copy if native or kl else 0.0,
        "packed_weights": packed,
        "fp32_output_weight": upcast,
        "reward_models": reward_models,
        "cuda_runtime": runtime,
        "other": buffers + gathered - root + sampling + prefill,
    }
    notes = component_notes(
        rows=gen_rows, positions=kv_positions, micro=micro, seq=seq, chunk=chunk, vocab=vocab,
        dim=d, dtype=dtype, fused=fused, world_size=world_size, states=states)
    estimate = MemoryEstimate(
        config=name,
        world_size=world_size,
        components={k: int(v) for k, v in components.items()},
        phases={k: int(v) for k, v in phases.items()},
        peak_bytes=int(phases[peak_phase]),
        peak_phase=peak_phase,
        host_bytes=int(host),
        other_devices=other_devices,
        settings={
            "dtype": dtype, "device": device, "lora": dims.is_lora, "kl": kl,
            "activation_checkpointing": ac, "fsdp_cpu_offload": offload,
            "rollout_gather_weights": gather_once,
            "rows": rows, "micro_batch": micro, "generation_rows": gen_rows,
            "prompt_tokens": p, "max_generated_tokens": t_gen, "logprob_chunk_size": chunk,
            "optimizer_states_per_param": states, "kv_positions": kv_positions,
            "learned_rewards": [asdict(r) for r in learned], "not_counted": not_counted,
            "notes": {k: notes[k] for k in components},
            "shape_note": None if dims.source is None else (
                f"the released config.json of {dims.source} (known shapes, "
                f"torchtune_grpo/cli/known_shapes.py): model_dir {cfg.model.model_dir} has no "
                "config.json yet; after the download, run again to check it against the "
                "folder's own"),
        },
        dims=dims,
    )
    if verbose:
        print(estimate.table())
    return estimate


def training_configs() -> list[str]:
    """Shipped configs that train (not ``eval_*``), by name."""
    from torchtune_grpo.config.loading import list_shipped_configs

    return [n for n in list_shipped_configs() if "eval" not in n.rsplit("/", 1)[-1]]


def summary_table(estimates: list[MemoryEstimate]) -> str:
    """One Markdown row per estimate: the components and the peak, in GiB."""
    cols = ["weights", "gradients", "optimizer_state", "reference_model", "kv_cache",
            "activations", "logits", "head_weight_grad", "fsdp_root", "gathered_weights",
            "packed_weights", "cuda_runtime", "other"]
    short = ["weights", "grads", "optim", "ref", "KV", "acts", "logits", "head grad", "root",
             "gathered", "packed", "runtime", "other"]
    head = "| config | ranks | " + " | ".join(short) + " | peak (phase) |"
    lines = [head, "|" + "---|" * (len(cols) + 3)]
    for e in estimates:
        cells = " | ".join(f"{e.components[c] / GIB:.2f}" for c in cols)
        lines.append(f"| {e.config} | {e.world_size} | {cells} | "
                     f"**{e.peak_gib:.2f}** ({e.peak_phase}) |")
    return "\n".join(lines)


def dump_json(estimates: list[MemoryEstimate], path: str) -> None:
    """Write the estimates to ``path`` as a JSON list."""
    with open(path, "w") as f:
        json.dump([e.to_dict() for e in estimates], f, indent=1)


def intended_world_size(config: str) -> int:
    """Ranks a config's header comment launches it with (``--nproc_per_node N``), else 1."""
    import re

    from torchtune_grpo.config.loading import resolve_config_path

    text = resolve_config_path(config).read_text()
    match = re.search(r"--nproc_per_node[ =](\d+)", text)
    return int(match.group(1)) if match else 1
