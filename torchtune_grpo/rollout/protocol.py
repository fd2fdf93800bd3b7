"""The generator protocol: what a rollout engine must do for the training recipe.

A generator is the config's ``generator`` component. The recipe builds it, then drives it
through the methods of :class:`Generator` and nothing else, so any class with these methods
(and their guarantees) can replace the built-in engines:

* :class:`~torchtune_grpo.rollout.native.NativeGenerator` (the default): the project's own
  KV-cache sampler, run on the policy module itself;
* :class:`~torchtune_grpo.rollout.vllm_engine.VLLMGenerator`: a colocated vLLM engine that
  receives the policy's weights after every update.

The order of the calls, per process, is::

    setup(context); sync_weights(policy)
    for every step:
        runs_policy()                    # gather an FSDP2 policy's weights for the rollout?
        generate(policy, request)        # once per gradient-accumulation chunk
        pop_stats()                      # the engine's counts (tool calls) for the metrics
        before_update()
        needs_policy_logprobs(top_k=...)
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
from torchtune_grpo.rollout.seeding import mix_seeds
from torchtune_grpo.rollout.tool_trajectory import ToolStats

__all__ = ["GenerationContext", "GenerationRequest", "Generator"]


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
    """What one :meth:`Generator.generate` call samples: prompts, sampling settings, token
    rules, seeds and the lockstep stop decision.

    Built by the caller for every call (cheap: it holds references, no copies) and never
    changed; an engine that generates in parts (the multi-turn engine's turns, the native
    engine's micro-batches) derives new requests with :func:`dataclasses.replace`.

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
        prompt_seeds: ``[B]`` int64, one seed per prompt (needed when ``temperature > 0``;
            the recipe passes ``mix_seeds(seed, step, index)``); the rows' own seeds are
            :meth:`sample_seeds`.
        forward_batch_size: rows per forward pass of an engine that batches on the policy
            (the native engine; None: all ``B * G`` rows at once); others batch on their own.
        all_done: given whether this rank's rows have all stopped, says whether every rank's
            have (a collective in distributed runs); None: this rank alone.
        cache_dtype: dtype of a KV cache the engine allocates (None: the policy's).

    Raises:
        ValueError: ``prompt_tokens`` not ``[B, P]``, a ``prompt_mask`` of another shape,
            ``prompt_seeds`` not ``[B]``, or ``group_size``, ``max_generated_tokens`` or
            ``forward_batch_size`` below 1.
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
    all_done: Callable[[bool], bool] | None = None
    cache_dtype: torch.dtype | None = None

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
        for name in ("group_size", "max_generated_tokens", "forward_batch_size"):
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

    Every method is called on every rank, in the order of the module docstring. An
    implementation subclasses this protocol (as the built-in engines do), which gives it the
    answers of an engine with weights of its own and no counts for :meth:`needs_policy_logprobs`,
    :meth:`runs_policy` and :meth:`pop_stats`; an engine that wraps another
    (:class:`~torchtune_grpo.rollout.multiturn.ToolUseGenerator`) forwards them.
    ``isinstance(obj, Generator)`` checks that the methods exist, the tests in
    ``tests/unit/rollout/test_generator_protocol.py`` that the recipe calls no others.
    """

    def setup(self, context: GenerationContext) -> None:
        """Prepare the engine; called once, after the policy is built, before any other call.

        Args:
            context: the run's model folder, dtype, device, ranks, longest sequence and
                allowed ids. Whatever the engine builds here (e.g. a vLLM engine from
                ``context.model_dir``) holds the *base* weights; the recipe calls
                :meth:`sync_weights` right after, since a resumed or LoRA policy differs.

        Raises:
            ValueError | ImportError: the engine cannot run in this setting (e.g. an option
                that is single-device only, or a missing optional dependency).
        """
        ...

    def generate(self, model: nn.Module, request: GenerationRequest) -> Trajectory:
        """Sample ``request.group_size`` completions for each prompt of ``request``.

        The contract:

        * **Layout.** The result has ``N = B * G`` rows, row ``b * G + g`` being sample ``g``
          of prompt ``b``. ``tokens [N, P + T]`` is the prompt row (as given) followed by the
          response, ``prompt_mask [N, P]`` the given mask repeated, ``response_mask [N, T]``
          True on the generated tokens from position 0 up to and including the stop token,
          ``tokens`` holding ``pad_id`` after that, ``stopped [N]`` True exactly where the
          completion ended on one of ``stop_tokens``, and ``T <= max_generated_tokens``. Every
          tensor is on ``prompt_tokens.device``.
        * **Support.** Only allowed ids are ever sampled: those where ``logit_bias`` is finite,
          which are those of ``GenerationContext.allowed_tokens`` (the recipe builds both from
          the same token rules).
        * **Log-probs.** ``logprobs [N, T]`` float32 holds, for each sampled token, its
          log-prob under the *sampling* policy: ``log_softmax(logits / temperature +
          logit_bias)`` over the whole allowed vocabulary (the quantity the training forward
          computes), 0 where ``response_mask`` is False. An engine that cannot deliver exactly
          that for some setting must say so through :meth:`needs_policy_logprobs`.
        * **Determinism.** Sample ``g`` of prompt ``b`` is a function of the weights, the
          prompt, ``prompt_seeds[b]`` and ``g`` only (via ``mix_seeds(prompt_seeds[b], g)``:
          :meth:`GenerationRequest.sample_seeds`), not of the other rows,
          ``forward_batch_size`` or the number of ranks, so a run and its resumption sample the
          same completions (up to the floating-point effects of batching). ``temperature ==
          0`` is greedy.
        * **Lockstep.** An engine whose generation runs collectives (the native engine's
          forwards through an FSDP-sharded policy) must decode until ``all_done(local_done)``
          is True, so that every rank takes the same number of steps; an engine that never
          touches the sharded policy while generating may ignore ``all_done``.

        Args:
            model: the policy (FSDP-sharded or not), in eval mode; engines with weights of
                their own may ignore it.
            request: the prompts and how to sample them (:class:`GenerationRequest`).

        Returns:
            The rollout as a :class:`~torchtune_grpo.algorithm.trajectory.Trajectory` of ``N``
            rows.
        """
        ...

    def needs_policy_logprobs(self, *, top_k: int | None) -> bool:
        """Whether the rollout's log-probs must be recomputed with the policy.

        Called once per step, after :meth:`before_update`. True when the log-probs returned
        by :meth:`generate` are not those of the distribution the training forward computes
        (vLLM with ``top_k`` reports the truncated, renormalised distribution); the recipe
        then runs one more no-grad forward of the policy to get the "old" log-probs.

        Args:
            top_k: the run's ``top_k``.

        Returns:
            bool; this base answers False (the contract of :meth:`generate` holds).
        """
        return False

    def runs_policy(self) -> bool:
        """Whether :meth:`generate` runs the ``model`` it is given (one forward per decode
        step), so that the caller holds an FSDP2 policy's gathered weights for the whole
        rollout. This base answers False (an engine with weights of its own); a wrapper
        answers for the engine it wraps."""
        return False

    def pop_stats(self) -> ToolStats:
        """The engine's counts since the last call (then reset), summed over ranks by the
        recipe into the ``tools/...`` metrics. This base has none: all zero."""
        return ToolStats()

    def before_update(self) -> None:
        """The rollouts of this step are done; the reference forward and the update follow.

        The engine may free memory here (vLLM sleeps on CUDA) until the next
        :meth:`sync_weights`; the recipe does not generate in between (evaluation samples with
        the policy module directly), but a :meth:`generate` call there must still work.
        """
        ...

    def sync_weights(self, model: nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights.

        Called after :meth:`setup` and after every update's optimizer steps, before the next
        rollout. It is called on every rank together, so it may run collectives (gathering
        FSDP shards); an engine that generates with ``model`` itself has nothing to do.

        Args:
            model: the policy (FSDP-sharded or not; LoRA adapters unmerged).
        """
        ...

    def close(self) -> None:
        """Release the engine's resources; called once, when the recipe cleans up."""
        ...
