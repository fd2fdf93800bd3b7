"""Multi-turn rollouts with tools: a row pauses on a tool call, gets the result, continues.

:class:`ToolUseGenerator` wraps an inner generator and calls its ``generate`` once per turn.
A turn also stops on every allowed id that may finish a call's close tag; a row whose
decoded text then ends a close tag gets the tool's result appended as tool tokens
(``tool_mask``) and continues in the next turn, re-prefilled with its whole sequence.
Budgets: at most ``max_generated_tokens`` response tokens (model and tool tokens together)
and ``max_tool_calls`` results per completion. Ranks stay in lockstep through ``all_done``
(:func:`global_max`); turn ``k`` of a row draws from ``mix_seeds(row_seed, k)``. The
guarantees are spelled out in ``docs/howto_tools.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.rollout.protocol import (
    GenerationContext,
    GenerationRequest,
    Generator,
    global_max,
)
from torchtune_grpo.rollout.seeding import mix_seeds
from torchtune_grpo.rollout.tool_trajectory import ToolRow, ToolStats, rows_to_trajectory
from torchtune_grpo.rollout.tools.base import Tool, is_error
from torchtune_grpo.rollout.tools.build import build_tools, make_tool_syntax
from torchtune_grpo.rollout.tools.chat_template import ChatTemplateToolSyntax, tool_schema
from torchtune_grpo.rollout.tools.dispatch import answer_call, close_tag_token_ids
from torchtune_grpo.rollout.tools.syntax import ToolCallSyntax

__all__ = [
    "ToolUseGenerator",
    "global_max",
]


#: A result longer than this many characters per token of room left is cut before encoding.
_CHARS_PER_TOKEN_CAP = 64


def _local(local_done: bool) -> bool:
    return local_done


class ToolUseGenerator(Generator):
    """A rollout engine whose completions may call tools (see the module docstring).

    Args:
        tools (Sequence): :class:`~torchtune_grpo.rollout.tools.base.Tool` objects, or the
            config's list of ``{_component_: ...}`` entries.
        tokenizer: the run's tokenizer (``encode(text, add_bos=False, add_eos=False)`` and
            ``decode(ids)``); may be given later with :meth:`set_tokenizer`.
        inner (Generator | Mapping | None): the engine that samples each turn, or its config
            node (default: :class:`~torchtune_grpo.rollout.native.NativeGenerator`).
        syntax (ToolCallSyntax | ChatTemplateToolSyntax | Mapping | None): the call and
            result tags (default ``<name>...</name>`` and ``<result>...</result>``), or the
            config's ``tool_syntax`` mapping (``{format: chat_template}``: the chat template's
            own format).
        max_tool_calls (int): most tool results per completion (0: tools never run).

    Raises:
        ValueError: a negative ``max_tool_calls``, a bad or duplicate tool entry, an inner engine
            that is not a :class:`~torchtune_grpo.rollout.protocol.Generator`, a bad ``syntax``,
            or (chat-template format) a chat template that cannot render tool calls and tool
            messages.
    """

    def __init__(self, tools: Sequence[Any] = (), tokenizer: Any = None,
                 inner: Generator | None = None,
                 syntax: ToolCallSyntax | ChatTemplateToolSyntax | Mapping[str, str] | None = None,
                 max_tool_calls: int = 4) -> None:
        if not isinstance(max_tool_calls, int) or isinstance(max_tool_calls, bool) \
                or max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be an int >= 0, got {max_tool_calls!r}")
        tools = list(tools or ())
        if tools and not all(isinstance(t, Tool) for t in tools):
            tools = build_tools(tools)
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be distinct, got {names}")
        if inner is None:
            from torchtune_grpo.rollout.native import NativeGenerator

            inner = NativeGenerator()
        elif isinstance(inner, Mapping) or hasattr(inner, "_component_"):
            from omegaconf import DictConfig, OmegaConf
            from torchtune import config as tt_config  # a config node: {_component_: ...}

            node = inner if isinstance(inner, DictConfig) else OmegaConf.create(dict(inner))
            inner = tt_config.instantiate(node)
        if not isinstance(inner, Generator):
            raise ValueError(f"inner must be a Generator, got {type(inner).__name__}")
        self.tools: dict[str, Tool] = {t.name: t for t in tools}
        self.syntax = make_tool_syntax(syntax)
        #: the tools' JSON schemas (chat-template format: given to the chat template)
        self.tool_schemas: list[dict[str, Any]] = [tool_schema(t) for t in tools]
        self.tokenizer = None
        self.inner = inner
        self.max_tool_calls = max_tool_calls
        self.stats = ToolStats()
        self._allowed: torch.Tensor | None = None
        self._candidates: dict[int, torch.Tensor] = {}
        if tokenizer is not None:
            self.set_tokenizer(tokenizer)

    @property
    def chat_format(self) -> bool:
        """Whether calls and results use the chat template's format."""
        return isinstance(self.syntax, ChatTemplateToolSyntax)

    # -- protocol: delegated
    def setup(self, context: GenerationContext) -> None:
        """Set up the inner engine; keep the allowed ids (for the close-tag stop ids)."""
        self._allowed = context.allowed_tokens.detach().cpu().bool()
        self.inner.setup(context)

    def needs_policy_logprobs(self, *, top_k: int | None) -> bool:
        """The inner engine's answer."""
        return self.inner.needs_policy_logprobs(top_k=top_k)

    def runs_policy(self) -> bool:
        """The inner engine's answer."""
        return self.inner.runs_policy()

    def before_update(self) -> None:
        """Forwarded to the inner engine."""
        self.inner.before_update()

    def sync_weights(self, model: nn.Module) -> None:
        """Forwarded to the inner engine."""
        self.inner.sync_weights(model)

    def close(self) -> None:
        """Forwarded to the inner engine."""
        self.inner.close()

    # -- tool use
    def set_tokenizer(self, tokenizer: Any) -> None:
        """Give the tokenizer (the recipe builds it after the generator).

        In the chat-template format the template is checked and, when the tokenizer has
        ``set_tools``, given the tools' JSON schemas for the prompts tokenized after this call.

        Raises:
            ValueError: (chat-template format) the check failed; it names ``tool_syntax.format``.
        """
        if self.chat_format and self.tools:
            self.syntax.check_tokenizer(tokenizer, self.tool_schemas)
            if callable(getattr(tokenizer, "set_tools", None)):
                tokenizer.set_tools(self.tool_schemas)
        self.tokenizer = tokenizer
        self._candidates.clear()

    def pop_stats(self) -> ToolStats:
        """The tool-use counts since the last call (then reset), plus the inner engine's."""
        stats, self.stats = self.stats, ToolStats()
        return stats + self.inner.pop_stats()

    def close_tag_stop_ids(self, vocab_size: int,
                           allowed: torch.Tensor | None = None) -> torch.Tensor:
        """``[c]`` long: the allowed ids whose text holds the last character of a close tag (cached
        per vocabulary size).

        Args:
            vocab_size: ``V``.
            allowed: ``[V]`` bool, the ids sampling may emit (None: every id the tokenizer
                decodes).
        """
        cached = self._candidates.get(vocab_size)
        if cached is not None:
            return cached
        out = close_tag_token_ids(self.syntax, list(self.tools), self.tokenizer, vocab_size,
                                  allowed)
        self._candidates[vocab_size] = out
        return out

    def _decode(self, ids: Sequence[int]) -> str:
        from torchtune_grpo.token_rules import safe_decode

        return safe_decode(self.tokenizer, ids)

    def _after_turn(self, row: ToolRow, new_ids: list[int], new_logprobs: list[float],
                    stops: set[int], candidates: set[int]) -> None:
        """Append one turn's sampled tokens to ``row``, then run a tool call they completed."""
        new_ids = new_ids[: row.remaining]
        new_logprobs = new_logprobs[: row.remaining]
        if not new_ids:  # nothing sampled (an engine that stopped early): end the row
            row.pending = False
            return
        before = len(row.resp)
        row.resp += new_ids
        row.policy += [True] * len(new_ids)
        row.logprobs += new_logprobs
        row.remaining -= len(new_ids)
        last = new_ids[-1]
        if last in stops:
            row.stopped, row.pending = True, False
            return
        if last in candidates and row.calls < self.max_tool_calls and row.remaining > 0:
            names = list(self.tools)
            text_before = self._decode(row.resp[: before + len(new_ids) - 1])
            text_after = self._decode(row.resp)
            if (self.syntax.count_closes(text_after, names)
                    > self.syntax.count_closes(text_before, names)):
                # chat-template format: the text is the template's own tokens (end of turn,
                # tool message, assistant header); the end-of-turn id is usually a stop id:
                # kept, it is context here
                result, text = answer_call(self.syntax, self.tools, self.tokenizer, text_after,
                                           self.tool_schemas)
                row.calls += 1
                row.errors += int(is_error(result))
                # a huge result is cut before it is encoded (it is cut to the room left anyway)
                text = text[: _CHARS_PER_TOKEN_CAP * row.remaining]
                ids = list(self.tokenizer.encode(text, add_bos=False, add_eos=False))
                if not self.chat_format:
                    # a stop token inside a result (a tokenizer that parses special-token
                    # text) would end the conversation on the tool's say: left out
                    ids = [t for t in ids if t not in stops]
                ids = ids[: row.remaining]
                row.resp += ids
                row.policy += [False] * len(ids)
                row.logprobs += [0.0] * len(ids)
                row.remaining -= len(ids)
                self.stats.result_tokens += len(ids)
        if row.remaining <= 0:
            row.pending = False

    def generate(self, model: nn.Module, request: GenerationRequest) -> Trajectory:
        """Sample ``group_size`` completions per prompt, running tools between turns.

        As :meth:`torchtune_grpo.rollout.protocol.Generator.generate` (``[B, P]`` prompts ->
        ``N = B * G`` rows, ``T <= max_generated_tokens``), plus ``tool_mask [N, T]``: True on
        tool-result tokens, which ``response_mask`` excludes and whose ``logprobs`` are 0.

        Raises:
            ValueError: no tokenizer was given, or no vocabulary size is known (no
                ``logit_bias``, no :meth:`setup` and no ``tokenizer.vocab_size``).
        """
        if self.tokenizer is None:
            raise ValueError("ToolUseGenerator needs the tokenizer: pass tokenizer= or call "
                             "set_tokenizer(tokenizer) before generate")
        prompt_tokens, prompt_mask = request.prompt_tokens, request.prompt_mask
        group_size, pad_id = int(request.group_size), request.pad_id
        stop_tokens, logit_bias, all_done = (request.stop_tokens, request.logit_bias,
                                             request.all_done)
        device = prompt_tokens.device
        n = request.num_rows
        sync = all_done or _local
        stops = {int(t) for t in stop_tokens.tolist()}
        allowed = self._allowed
        if allowed is None and logit_bias is not None:
            allowed = torch.isfinite(logit_bias.detach().cpu())
        vocab = (logit_bias.numel() if logit_bias is not None
                 else allowed.numel() if allowed is not None
                 else int(getattr(self.tokenizer, "vocab_size", 0)))
        candidates = torch.zeros(0, dtype=torch.long)
        if self.tools and self.max_tool_calls > 0:
            if vocab <= 0:
                raise ValueError("ToolUseGenerator cannot tell the vocabulary size: pass "
                                 "logit_bias, call setup(context) or use a tokenizer with "
                                 "vocab_size")
            candidates = self.close_tag_stop_ids(vocab, allowed)
        candidate_set = {int(t) for t in candidates.tolist()} - stops
        turn_stops = torch.cat([stop_tokens.cpu().long(), candidates]).unique().to(
            stop_tokens.device)

        seeds = request.sample_seeds()
        real_prompts = [row[mask].tolist() for row, mask in
                        zip(prompt_tokens.cpu(), prompt_mask.cpu())]
        rows = [ToolRow(prompt=real_prompts[i // group_size],
                        seed=None if seeds is None else int(seeds[i]),
                        remaining=int(request.max_generated_tokens)) for i in range(n)]

        # turn 0: the single-turn rollout, also stopping where a close tag may end
        out = self.inner.generate(model, dataclasses.replace(
            request, stop_tokens=turn_stops if candidate_set else stop_tokens))
        self._collect(out, list(range(n)), rows, stops, candidate_set)

        max_len = _model_max_len(model)
        turn = 0
        while True:
            turn += 1
            pending = [i for i, r in enumerate(rows) if r.pending]
            if sync(not pending):  # every rank's rows are finished
                break
            budget = global_max(max((rows[i].remaining for i in pending), default=0), all_done)
            count = global_max(len(pending), all_done)
            idle = not pending
            if idle:  # a finished row's prompt, made to stop at once (see the module doc)
                seqs = [rows[0].prompt] * count
            else:
                batch = pending + [pending[0]] * (count - len(pending))
                seqs = [rows[i].prompt + rows[i].resp for i in batch]
            if max_len is not None:  # no row may decode past the model's last position
                longest = global_max(max(len(q) for q in seqs), all_done)
                budget = max(1, min(budget, max_len - longest + 1))
            tokens, mask = _left_padded(seqs, pad_id, device)
            turn_seeds = None
            if seeds is not None:
                turn_seeds = mix_seeds(torch.tensor(
                    [rows[i].seed for i in ([0] * count if idle else batch)]), turn)
            bias = logit_bias
            if idle and logit_bias is not None:
                bias = torch.full_like(logit_bias, float("-inf"))
                bias[stop_tokens.to(bias.device)] = 0.0
            exhausted = all(rows[i].calls >= self.max_tool_calls for i in pending)
            out = self.inner.generate(model, dataclasses.replace(
                request, prompt_tokens=tokens, prompt_mask=mask, group_size=1,
                max_generated_tokens=max(budget, 1),
                stop_tokens=stop_tokens if exhausted or not candidate_set else turn_stops,
                logit_bias=bias, prompt_seeds=turn_seeds))
            self._collect(out, pending, rows, stops, candidate_set)

        self.stats.completions += len(rows)
        self.stats.calls += sum(r.calls for r in rows)
        self.stats.errors += sum(r.errors for r in rows)
        return rows_to_trajectory(rows, prompt_tokens, prompt_mask, group_size, pad_id)

    def _collect(self, out: Trajectory, indices: list[int], rows: list[ToolRow],
                 stops: set[int], candidates: set[int]) -> None:
        """Hand row ``j`` of a turn's output to ``rows[indices[j]]`` (padding rows ignored)."""
        tokens = out.response_tokens.cpu()
        mask = out.response_mask.cpu()
        logprobs = out.logprobs.float().cpu()
        for j, i in enumerate(indices):
            m = mask[j]
            self._after_turn(rows[i], tokens[j][m].tolist(), logprobs[j][m].tolist(), stops,
                             candidates)


def _model_max_len(model: Any) -> int | None:
    """The most positions ``model`` embeds (a torchtune decoder's ``max_seq_len``), or None."""
    value = getattr(model, "max_seq_len", None)
    return int(value) if isinstance(value, int) else None


def _left_padded(seqs: list[list[int]], pad_id: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``([m, L] ids, [m, L] mask)``: ``seqs`` left-padded to their longest."""
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            tokens[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = True
    return tokens.to(device), mask.to(device)
