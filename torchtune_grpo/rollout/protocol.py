"""The generator protocol: the methods a rollout engine offers the training recipe.

Built-in engines: :class:`~torchtune_grpo.rollout.native.NativeGenerator` (the default, the
KV-cache sampler run on the policy) and :class:`~torchtune_grpo.rollout.vllm_engine.VLLMGenerator`
(a colocated vLLM engine). Per process the recipe calls::

    setup(context); sync_weights(policy)
    for every step:
        runs_policy(); generate(policy, request)  # once per gradient-accumulation chunk
        pop_stats(); before_update(); needs_policy_logprobs(top_k=...)
        ...reference and policy forwards, optimizer steps...
        sync_weights(policy)
    close()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.progress import Progress
from torchtune_grpo.rollout.seeding import mix_seeds
from torchtune_grpo.rollout.tool_trajectory import ToolStats

__all__ = ["GenerationContext", "GenerationRequest", "Generator", "global_max"]


@dataclasses.dataclass
class GenerationContext:
    """What a generator may need to know about the run (built by the recipe's ``setup``).

    Attributes:
        model_dir (str): folder of the base model in HF format (``config.json`` + weights).
        model_type (str): the checkpointer's ``model_type`` (``LLAMA3_2``, ``QWEN2``, ...).
        hf_config (dict): the model's ``config.json``.
        device (torch.device): the rank's device.
        dtype (torch.dtype): the policy's parameter dtype.
        world_size (int): number of processes.
        rank (int): this process's rank.
        max_len (int): longest prompt plus ``max_generated_tokens``.
        allowed_tokens (torch.Tensor): ``[V]`` bool, the ids sampling may emit.
        lora (dict | None): ``{"rank": r, "alpha": a}`` for a LoRA policy (its adapters are merged
            before weights are copied), else None.
    """

    model_dir: str
    model_type: str
    hf_config: dict
    device: torch.device
    dtype: torch.dtype
    world_size: int
    rank: int
    max_len: int
    allowed_tokens: torch.Tensor
    lora: dict | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class GenerationRequest:
    """What one :meth:`Generator.generate` call samples; frozen (engines that generate in parts
    derive new requests with :func:`dataclasses.replace`).

    Attributes:
        prompt_tokens: ``[B, P]`` long, left-padded prompts.
        prompt_mask: ``[B, P]`` bool, True on real prompt tokens.
        max_generated_tokens: the most tokens generated per completion (``>= 1``).
        temperature: sampling temperature; 0 is greedy.
        stop_tokens: ``[s]`` long ids that end a completion.
        pad_id: id written after a completion ended.
        group_size: ``G``, completions per prompt (``>= 1``).
        top_k: sample among the ``top_k`` most likely ids (None: all).
        logit_bias: ``[V]`` float32, 0 on allowed ids and ``-inf`` elsewhere (None: every id
            allowed).
        prompt_seeds: ``[B]`` int64, one seed per prompt (needed when ``temperature > 0``); the
            rows' own seeds are :meth:`sample_seeds`.
        forward_batch_size: rows per forward pass of an engine that batches on the policy
            (None: all ``B * G`` rows at once).
        rollout_batch_size: rows a step-by-step engine decodes at once, one KV cache of that
            many rows (None: ``forward_batch_size``).
        stop_check_interval: a step-by-step engine asks whether every row has stopped (a host
            read, and a collective with ``all_done``) only every this many decode steps;
            stopped rows decode padding in between. The trajectory is the same for any
            interval.
        all_done: given whether this rank's rows have all stopped (a bool, or a one-element
            bool tensor on the device), says whether every rank's have (a collective in
            distributed runs); None: this rank alone.
        cache_dtype: dtype of a KV cache the engine allocates (None: the policy's).
        progress: where an engine that decodes step by step reports its decode step and the
            rows it finished (:class:`~torchtune_grpo.progress.Progress`; attribute writes
            only, no device sync), or None.

    Raises:
        ValueError: ``prompt_tokens`` not ``[B, P]``, a ``prompt_mask`` of another shape,
            ``prompt_seeds`` not ``[B]``, or ``group_size``, ``max_generated_tokens``,
            ``forward_batch_size``, ``rollout_batch_size`` or ``stop_check_interval`` below 1.
    """

    prompt_tokens: torch.Tensor
    prompt_mask: torch.Tensor
    _: dataclasses.KW_ONLY
    max_generated_tokens: int
    temperature: float
    stop_tokens: torch.Tensor
    pad_id: int
    group_size: int = 1
    top_k: int | None = None
    logit_bias: torch.Tensor | None = None
    prompt_seeds: torch.Tensor | None = None
    forward_batch_size: int | None = None
    rollout_batch_size: int | None = None
    stop_check_interval: int = 1
    all_done: Callable[[bool | torch.Tensor], bool] | None = None
    cache_dtype: torch.dtype | None = None
    progress: Progress | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens.dim() != 2:
            raise ValueError("GenerationRequest.prompt_tokens must be [B, P], got shape "
                             f"{tuple(self.prompt_tokens.shape)}")
        if self.prompt_mask.shape != self.prompt_tokens.shape:
            raise ValueError(f"GenerationRequest.prompt_mask has shape "
                             f"{tuple(self.prompt_mask.shape)}, prompt_tokens "
                             f"{tuple(self.prompt_tokens.shape)}")
        if self.prompt_seeds is not None and tuple(self.prompt_seeds.shape) != (
                self.num_prompts,):
            raise ValueError(f"GenerationRequest.prompt_seeds must be [{self.num_prompts}], got "
                             f"shape {tuple(self.prompt_seeds.shape)}")
        for name in ("group_size", "max_generated_tokens", "forward_batch_size",
                     "rollout_batch_size", "stop_check_interval"):
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                raise ValueError(f"GenerationRequest.{name} must be >= 1, got {value!r}")

    @property
    def num_prompts(self) -> int:
        """``B``, the number of prompts."""
        return int(self.prompt_tokens.shape[0])

    @property
    def num_rows(self) -> int:
        """``N = B * G``, the number of completions."""
        return self.num_prompts * int(self.group_size)

    @property
    def rows_per_forward(self) -> int:
        """``forward_batch_size``, or ``N`` when it is None."""
        return int(self.forward_batch_size or self.num_rows)

    @property
    def rows_per_decode(self) -> int:
        """``rollout_batch_size``, else :attr:`rows_per_forward`."""
        return int(self.rollout_batch_size or self.rows_per_forward)

    def sample_seeds(self) -> torch.Tensor | None:
        """``[N]`` int64 on the CPU: row ``b * G + g``'s seed ``mix_seeds(prompt_seeds[b],
        g)``; None without ``prompt_seeds``."""
        if self.prompt_seeds is None:
            return None
        group = int(self.group_size)
        sample_index = torch.arange(group).repeat(self.num_prompts)
        return mix_seeds(self.prompt_seeds.cpu().repeat_interleave(group), sample_index)


@runtime_checkable
class Generator(Protocol):
    """A rollout engine: samples completions for the recipe and follows the policy's weights.

    Every method is called on every rank, in the order of the module docstring. Subclassing
    this protocol gives the answers of an engine with weights of its own
    (:meth:`needs_policy_logprobs`, :meth:`runs_policy` False, :meth:`pop_stats` zero); a
    wrapping engine forwards them.
    """

    def setup(self, context: GenerationContext) -> None:
        """Prepare the engine; called once, after the policy is built, before any other call.

        What the engine builds here holds the *base* weights; :meth:`sync_weights` follows.

        Args:
            context: the run's model folder, dtype, device, ranks, longest sequence and allowed ids.

        Raises:
            ValueError | ImportError: the engine cannot run in this setting (e.g. a single-device
                option, or a missing optional dependency).
        """
        ...

    def generate(self, model: nn.Module, request: GenerationRequest) -> Trajectory:
        """Sample ``request.group_size`` completions for each prompt of ``request``.

        Row ``b * G + g`` of the ``N = B * G`` rows is sample ``g`` of prompt ``b``: ``tokens
        [N, P + T]`` (``pad_id`` after the stop token), ``response_mask [N, T]`` (up to and
        including the stop token), ``stopped [N]``, ``T <= max_generated_tokens``, all on
        ``prompt_tokens.device``. Only ids with a finite ``logit_bias`` are sampled;
        ``logprobs [N, T]`` float32 are ``log_softmax(logits / temperature + logit_bias)`` of the
        sampled tokens (else :meth:`needs_policy_logprobs` is True). A sample depends only on the
        weights, its prompt and :meth:`GenerationRequest.sample_seeds`; an engine running
        collectives decodes until ``all_done(local_done)``.

        Args:
            model: the policy (FSDP-sharded or not), in eval mode; engines with weights of their own
                may ignore it.
            request: the prompts and how to sample them.

        Returns:
            A :class:`~torchtune_grpo.algorithm.trajectory.Trajectory` of ``N`` rows.
        """
        ...

    def needs_policy_logprobs(self, *, top_k: int | None) -> bool:
        """Whether the rollout's log-probs must be recomputed with the policy (one more no-grad
        forward), because they are not those of the training forward's distribution.

        Args:
            top_k: the run's ``top_k``.

        Returns:
            bool; this base answers False.
        """
        return False

    def runs_policy(self) -> bool:
        """Whether :meth:`generate` runs the ``model`` it is given, so the caller holds an FSDP2
        policy's gathered weights for the rollout; this base answers False.
        """
        return False

    def pop_stats(self) -> ToolStats:
        """The engine's counts since the last call (then reset), for the ``tools/...`` metrics; this
        base returns zeros.
        """
        return ToolStats()

    def before_update(self) -> None:
        """The step's rollouts are done: the engine may free memory until :meth:`sync_weights`,
        but a :meth:`generate` call in between must still work.
        """
        ...

    def sync_weights(self, model: nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights; called on every rank together
        (collectives allowed) after :meth:`setup` and after every update.

        Args:
            model: the policy (FSDP-sharded or not; LoRA adapters unmerged).
        """
        ...

    def close(self) -> None:
        """Release the engine's resources; called once, when the recipe cleans up."""
        ...


def global_max(value: int, all_done: Callable[[bool], bool] | None) -> int:
    """The maximum of a non-negative int over ranks, from ``all_done(value <= k)`` questions
    (an exponential then a binary search, the same questions on every rank).

    Args:
        value: this rank's value, ``>= 0``.
        all_done: a request's ``all_done`` collective (None: this rank alone).

    Returns:
        The largest ``value`` over ranks.

    Raises:
        ValueError: a negative ``value``.
    """
    if value < 0:
        raise ValueError(f"global_max needs a non-negative value, got {value}")
    if all_done is None:
        return value
    high = 1
    while not all_done(value <= high):
        high *= 2
    low = 0
    while low < high:
        mid = (low + high) // 2
        if all_done(value <= mid):
            high = mid
        else:
            low = mid + 1
    return low
