"""The native rollout engine: ``group_size`` completions per prompt with a KV cache, run on the
policy module.

Micro-batches of ``forward_batch_size`` rows are generated separately and padded to one
``P`` and ``T``; only allowed ids are sampled; with FSDP all ranks run the same number of
decode steps; each sampled token's tempered log-prob is returned. Tokens are drawn by
:func:`~torchtune_grpo.rollout.sampling.sample_next_token`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn
from torchtune.modules.common_utils import delete_kv_caches

from torchtune_grpo import distributed as D
from torchtune_grpo.algorithm.trajectory import Trajectory, concat_trajectories
from torchtune_grpo.backends import backend_for
from torchtune_grpo.policy.forward import last_logits
from torchtune_grpo.policy.kv_cache import KVCacheStorage, SpanKVCache, attached
from torchtune_grpo.policy.positions import attention_mask, position_ids
from torchtune_grpo.rollout.protocol import (
    GenerationContext,
    GenerationRequest,
    Generator,
    global_max,
)
from torchtune_grpo.rollout.sampling import sample_next_token
from torchtune_grpo.rollout.seeding import decode_uniforms


def _distinct_rows(prompt_tokens: torch.Tensor, prompt_mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows holding the distinct prompts, and which of them each row repeats.

    Returns:
        ``(first [u], inverse [n])``: ``prompt_tokens[first[inverse]]`` equals
        ``prompt_tokens`` on every real token (padding ids are ignored).
    """
    n = prompt_tokens.shape[0]
    key = torch.where(prompt_mask, prompt_tokens, torch.full_like(prompt_tokens, -1))
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    u = int(inverse.max()) + 1
    first = torch.full((u,), n, dtype=torch.long, device=key.device)
    first.scatter_reduce_(0, inverse, torch.arange(n, device=key.device), "amin")
    order = first.argsort()  # keep the rows' order: unique id = rank of its first row
    rank = torch.empty_like(order)
    rank[order] = torch.arange(u, device=key.device)
    return first[order], rank[inverse]


def _module_forward(model: nn.Module, *args, **kwargs):
    """``model(*args, **kwargs)``: the function :func:`compile_decode_step` compiles."""
    return model(*args, **kwargs)


def compile_decode_step(mode: str | None = None) -> Callable[..., torch.Tensor]:
    """A static-shape, whole-graph ``torch.compile`` of ``step(model, tokens, **kw) =
    model(tokens, **kw)``: one graph for the decode step (a graph break is an error), compiled
    at its first call and again only for a model or shapes its guards have not seen.

    Args:
        mode: ``torch.compile``'s mode; ``"reduce-overhead"`` replays the step as a CUDA graph
            (one launch per token instead of one per kernel). None: the default mode.
    """
    return torch.compile(_module_forward, dynamic=False, fullgraph=True, mode=mode)


def default_compile_mode(device: torch.device) -> str | None:
    """``"reduce-overhead"`` (CUDA graphs) on CUDA, None (inductor's default) elsewhere."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else None


# ---------------------------------------------------------------------------- rollout
def _always_local(local_done: bool) -> bool:
    return local_done


#: Shrink the decode batch once this fraction of its rows (or more) has stopped since the
#: last shrink (see :func:`generate_micro_batch`).
SHRINK_FRACTION = 0.25


def _rows_to_keep(stopped: torch.Tensor) -> torch.Tensor | None:
    """Which rows of the decode batch to keep, or None when shrinking does not pay yet.

    Args:
        stopped: ``[m]`` bool, True on the decode batch's rows that have stopped.

    Returns:
        ``[m']`` long, ascending indices into the batch (the rows still running; a single
        stopped row when none is, so that a rank waiting for the others still has a row to
        call the model on), or None unless ``m - m' >= SHRINK_FRACTION * m``.
    """
    m = stopped.shape[0]
    kept = max(m - int(stopped.sum()), 1)
    if m - kept < max(1.0, SHRINK_FRACTION * m):
        return None
    keep = (~stopped).nonzero().squeeze(1)
    return keep if keep.numel() else keep.new_zeros(1)


def _compact_cache_rows(caches: Sequence[SpanKVCache], keep: torch.Tensor) -> None:
    """Move cache rows ``keep`` of every layer to the front (row ``i`` <- row ``keep[i]``),
    copying only the filled span of the rows that move.

    Args:
        caches: the span caches of every attention layer.
        keep: ``[m']`` long, ascending row indices of the current decode batch.
    """
    dest = torch.arange(keep.numel(), device=keep.device)
    moved = keep != dest
    if not bool(moved.any()):
        return
    src, dest = keep[moved], dest[moved]
    for cache in caches:
        for buf in (cache.k_cache, cache.v_cache):
            span = buf[:, :, : cache.length]  # [rows, kv_heads, length, head_dim] view
            span.index_copy_(0, dest, span.index_select(0, src))


@torch.no_grad()
def generate_micro_batch(
    model: nn.Module,
    request: GenerationRequest,
    *,
    seeds: torch.Tensor | None = None,
    kv_storage: KVCacheStorage | None = None,
    compiled_step: Callable[..., torch.Tensor] | None = None,
    shrink_finished: bool = True,
) -> Trajectory:
    """Generate one completion for each row of a micro-batch, with a KV cache.

    The model runs through its own ``forward`` with :class:`SpanKVCache` attention caches;
    distinct prompts are prefilled once. The per-token loop reads nothing back to the host: the
    random numbers of the whole rollout are drawn on the device up front
    (:func:`~torchtune_grpo.rollout.seeding.decode_uniforms`), and whether every row (on every
    rank, through ``request.all_done``) has stopped is asked only every
    ``request.stop_check_interval`` steps, stopped rows decoding padding in between. At a check,
    with ``shrink_finished``, the decode batch drops its stopped rows once ``SHRINK_FRACTION``
    of it has stopped (a rank keeps one row for lockstep); tokens are unchanged, log-probs
    within float32 rounding of the batch size. The trajectory is cut to the longest completion
    over ranks, so it is the same for every interval.

    Args:
        model: a torchtune decoder (FSDP-sharded or not).
        request: the ``n`` rows to generate (``group_size`` 1, no ``prompt_seeds``), their
            sampling settings, token rules, ``stop_check_interval``, ``all_done`` and
            ``cache_dtype`` (default: the model's parameter dtype); the batch sizes are not read.
        seeds: ``[n]`` int64 per-row sampling seeds.
        kv_storage: preallocated cache storage; allocated here when None or too small.
        compiled_step: a :func:`compile_decode_step` function run with static shapes; None:
            eager.
        shrink_finished: drop stopped rows from the decode batch at checks (ignored with
            ``compiled_step``).

    Returns:
        A :class:`Trajectory` whose ``T`` is the longest completion (on any rank).

    Raises:
        ValueError: a request with ``group_size`` other than 1 or with ``prompt_seeds``.
    """
    if request.group_size != 1 or request.prompt_seeds is not None:
        raise ValueError("generate_micro_batch generates the request's rows: group_size must "
                         "be 1 and the rows' seeds come as seeds=, not prompt_seeds")
    prompt_tokens, prompt_mask = request.prompt_tokens, request.prompt_mask
    max_generated_tokens, pad_id = int(request.max_generated_tokens), request.pad_id
    stop_tokens, interval = request.stop_tokens, int(request.stop_check_interval)
    compile_decode = compiled_step is not None
    n, prompt_len = prompt_tokens.shape
    device = prompt_tokens.device
    all_done = request.all_done or _always_local
    total_len = prompt_len + max_generated_tokens
    dtype = request.cache_dtype or next(model.parameters()).dtype
    if kv_storage is None or not kv_storage.fits(n, total_len, dtype, device):
        kv_storage = KVCacheStorage(model, rows=n, max_len=total_len, dtype=dtype, device=device)
    if model.caches_are_setup():  # torchtune's own caches would double the memory
        delete_kv_caches(model)
    uniforms = (decode_uniforms(seeds, max_generated_tokens, device)
                if seeds is not None and request.temperature > 0 else None)  # [n, T]

    # valid[:, j]: position j holds a real token (generated positions count as real: after a
    # row stops, what it attends to no longer matters). Filled in place, never rebuilt.
    valid = torch.ones(n, total_len, dtype=torch.bool, device=device)
    valid[:, :prompt_len] = prompt_mask
    positions = position_ids(valid)
    first, inverse = _distinct_rows(prompt_tokens, prompt_mask)
    shared = first.numel() < n
    write_pos = torch.zeros(1, dtype=torch.long, device=device) if compile_decode else None
    if compile_decode:
        seen = torch.zeros(n, total_len, dtype=torch.bool, device=device)
        seen[:, :prompt_len] = prompt_mask
    step_fn = None if compiled_step is None else partial(compiled_step, model)

    with attached(kv_storage, n, write_pos) as caches:
        for cache in caches:
            cache.start_prefill(inverse if shared else None)
        rows = first if shared else slice(None)
        logits = last_logits(model, prompt_tokens[rows], mask=attention_mask(prompt_mask[rows]),
                             input_pos=positions[rows, :prompt_len])
        if shared:
            logits = logits.index_select(0, inverse)

        out_tokens = torch.full((n, max_generated_tokens), pad_id, dtype=torch.long,
                                device=device)
        out_logprobs = torch.zeros(n, max_generated_tokens, dtype=torch.float32,
                                   device=device)
        out_mask = torch.zeros(n, max_generated_tokens, dtype=torch.bool, device=device)
        stopped = torch.zeros(n, dtype=torch.bool, device=device)
        shrink = shrink_finished and not compile_decode
        # The decode batch: row i is the micro-batch's row live[i] (None: every row, in order).
        # Rows left out of it have stopped, and their outputs keep the defaults above.
        live = None
        batch_uniforms = uniforms  # [m, T] or None
        batch_valid, batch_positions = valid, positions  # [m, total_len]
        steps = 0
        for t in range(max_generated_tokens):
            token, logprob = sample_next_token(
                logits[:, -1],
                temperature=request.temperature,
                top_k=request.top_k,
                logit_bias=request.logit_bias,
                uniform=None if batch_uniforms is None else batch_uniforms[:, t],
                inplace=not compile_decode,  # the eager model's output, used for nothing else
            )  # [m], [m]
            done = stopped if live is None else stopped[live]  # [m]: stopped before this step
            token = token.masked_fill_(done, pad_id)
            logprob = logprob.masked_fill_(done, 0.0)
            if live is None:
                out_tokens[:, t] = token
                out_logprobs[:, t] = logprob
                out_mask[:, t] = ~done
                done = torch.logical_or(done, torch.isin(token, stop_tokens), out=stopped)
            else:
                out_tokens[live, t] = token
                out_logprobs[live, t] = logprob
                out_mask[live, t] = ~done
                done = done | torch.isin(token, stop_tokens)
                stopped[live] = done
            steps = t + 1
            if request.progress is not None:  # attribute writes: no device sync
                request.progress.decode_step(steps, max_generated_tokens)
            if steps == max_generated_tokens:
                break
            if steps % interval == 0:  # the loop's only host reads and collectives
                if all_done(stopped.all()):
                    break
                keep = _rows_to_keep(done) if shrink else None
                if keep is not None:
                    _compact_cache_rows(caches, keep)
                    live = keep if live is None else live[keep]
                    token = token[keep]
                    batch_valid, batch_positions = batch_valid[keep], batch_positions[keep]
                    if batch_uniforms is not None:
                        batch_uniforms = batch_uniforms[keep]
            cur = prompt_len + t
            if compile_decode:
                write_pos.fill_(cur)
                seen[:, cur] = True
                step_mask = seen.unsqueeze(1)
                # a CUDA graph's outputs are overwritten by its next replay: the last step's
                # logits are consumed, so a new iteration may begin
                torch.compiler.cudagraph_mark_step_begin()
            else:
                step_mask = batch_valid[:, None, : cur + 1]
            logits = last_logits(model, token.unsqueeze(1), mask=step_mask,
                                 input_pos=batch_positions[:, cur : cur + 1], forward=step_fn)

    if interval > 1:  # steps past the longest completion decoded padding only: cut them
        longest = int(out_mask[:, :steps].sum(1).max()) if n else 0
        steps = global_max(longest, request.all_done)
    return Trajectory(
        tokens=torch.cat([prompt_tokens, out_tokens[:, :steps]], dim=1),
        prompt_mask=prompt_mask.clone(),
        response_mask=out_mask[:, :steps],
        logprobs=out_logprobs[:, :steps],
        stopped=stopped,
        pad_id=pad_id,
    )


def generate_trajectory(
    model: nn.Module,
    request: GenerationRequest,
    *,
    packed_weights: bool = True,
    compiled_step: Callable[..., torch.Tensor] | None = None,
    shrink_finished: bool | None = None,
    kv_storage: KVCacheStorage | None = None,
) -> Trajectory:
    """Sample ``request.group_size`` completions per prompt, ``rollout_batch_size`` rows at a time
    (:attr:`~torchtune_grpo.rollout.protocol.GenerationRequest.rows_per_decode`).

    One KV cache serves every micro-batch; sample ``g`` of prompt ``b`` is seeded by
    :meth:`~torchtune_grpo.rollout.protocol.GenerationRequest.sample_seeds`.

    Args:
        model: a torchtune decoder.
        request: ``[B, P]`` prompts and their sampling settings; ``rows_per_decode`` divides
            ``B * G``.
        packed_weights: on CPU, decode on oneDNN-reordered weights made once per rollout
            (not with ``compiled_step``).
        compiled_step: see :func:`generate_micro_batch`.
        shrink_finished: see :func:`generate_micro_batch`; None: where it pays, the device's
            backend's ``shrink_finished_rows`` (the CPU).
        kv_storage: preallocated cache storage (allocated here when None).

    Returns:
        A :class:`Trajectory` of ``N = B * G`` rows, row ``b * G + g`` being sample ``g`` of
        prompt ``b``, padded to the longest micro-batch.
    """
    group_size, rows = int(request.group_size), request.rows_per_decode
    tokens = request.prompt_tokens.repeat_interleave(group_size, dim=0)
    mask = request.prompt_mask.repeat_interleave(group_size, dim=0)
    seeds = request.sample_seeds()
    if kv_storage is None:
        dtype = request.cache_dtype or next(model.parameters()).dtype
        kv_storage = KVCacheStorage(
            model, rows=min(rows, tokens.shape[0]),
            max_len=tokens.shape[1] + int(request.max_generated_tokens), dtype=dtype,
            device=tokens.device,
        )
    backend = backend_for(tokens.device)
    if shrink_finished is None:
        shrink_finished = backend.shrink_finished_rows
    parts = []
    with backend.decode_weights(model, packed_weights and compiled_step is None):
        for i in range(0, tokens.shape[0], rows):
            if request.progress is not None:
                request.progress.decode_batch(i // rows + 1, -(-tokens.shape[0] // rows),
                                              int(request.max_generated_tokens))
            parts.append(generate_micro_batch(
                model, dataclasses.replace(request, prompt_tokens=tokens[i : i + rows],
                                           prompt_mask=mask[i : i + rows], group_size=1,
                                           prompt_seeds=None),
                seeds=None if seeds is None else seeds[i : i + rows],
                kv_storage=kv_storage, compiled_step=compiled_step,
                shrink_finished=shrink_finished,
            ))
    return concat_trajectories(parts)


# ---------------------------------------------------------------------------- generator
class NativeGenerator(Generator):
    """The default rollout engine: :func:`generate_trajectory` on the policy itself (no weights to
    synchronise).

    Args:
        compile_decode (bool): run decode steps through :func:`compile_decode_step` (static
            shapes, one graph; on CUDA replayed as a CUDA graph). With several FSDP2 ranks it
            decodes on the weights gathered for the rollout (``rollout_gather_weights: true``),
            through :func:`~torchtune_grpo.distributed.hook_free_view`.
        packed_weights (bool): on CPU, run the rollout's linear layers on weights reordered
            once per rollout for oneDNN (faster, one more copy of those weights); no effect on
            GPU, with several ranks or with ``compile_decode``.
        compile_mode (str | None): ``torch.compile``'s mode for ``compile_decode``; None: by
            device at :meth:`setup` (:func:`default_compile_mode`).
    """

    def __init__(self, compile_decode: bool = False, packed_weights: bool = True,
                 compile_mode: str | None = None) -> None:
        self.compile_decode = bool(compile_decode)
        self.packed_weights = bool(packed_weights)
        self.compile_mode = compile_mode
        #: the compiled decode step (None: eager decoding)
        self.compiled_step = (compile_decode_step(compile_mode) if self.compile_decode
                              else None)
        #: engine log-probs differ from the trainer's (set by :meth:`setup` from the dtype)
        self.recompute_logprobs = False
        self._sharded = False
        self._view: tuple[nn.Module, nn.Module] | None = None  # (policy, its hook-free view)

    def setup(self, context: GenerationContext) -> None:
        """Choose the compile mode by device, and whether the trainer recomputes log-probs (in
        any dtype but float32 the decode's kernels and batch shapes round differently from the
        training forward's)."""
        self._sharded = context.world_size > 1
        self.recompute_logprobs = context.dtype != torch.float32
        if self.compile_decode and self.compile_mode is None:
            self.compiled_step = compile_decode_step(default_compile_mode(context.device))

    def _decode_model(self, model: nn.Module) -> nn.Module:
        """``model``, or with a compiled step on several ranks its hook-free view (built once)."""
        if self.compiled_step is None or not self._sharded:
            return model
        if not D.fully_unsharded(model):
            raise ValueError("generator.compile_decode with several ranks decodes on the "
                             "gathered weights: set rollout_gather_weights: true")
        if self._view is None or self._view[0] is not model:
            self._view = (model, D.hook_free_view(model))
        return self._view[1]

    def generate(self, model: nn.Module, request: GenerationRequest) -> Trajectory:
        """:func:`generate_trajectory` on ``model``: ``[B, P]`` prompts -> ``N = B * G`` rows."""
        return generate_trajectory(self._decode_model(model), request,
                                   packed_weights=self.packed_weights,
                                   compiled_step=self.compiled_step)

    def runs_policy(self) -> bool:
        """True: every decode step is a forward of the policy module."""
        return True

    def needs_policy_logprobs(self, *, top_k: int | None) -> bool:
        """True outside float32: the engine's log-probs are the policy's distribution
        (tempered, full allowed vocabulary), but its one-token decode steps round differently
        from the training forward in bf16, so the trainer computes the old log-probs itself.
        In float32 they agree to ~1e-6 and are reused (no extra forward)."""
        return self.recompute_logprobs

    def before_update(self) -> None:
        """Nothing to free."""

    def sync_weights(self, model: nn.Module) -> None:
        """Nothing to copy: the policy generates."""

    def close(self) -> None:
        """Nothing to release."""
