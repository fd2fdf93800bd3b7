"""Completions made of model and tool tokens: :class:`ToolRow` (one completion being built),
:func:`rows_to_trajectory` (finished rows -> a padded trajectory with ``tool_mask``),
:class:`ToolStats` (tool-use counts), and readers of such trajectories as text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtune_grpo.algorithm.trajectory import Trajectory

__all__ = [
    "ToolRow",
    "ToolStats",
    "decode_with_tools",
    "rows_to_trajectory",
    "tool_segments",
]


@dataclass
class ToolStats:
    """Tool-use counts summed over rollouts (this rank), for the ``tools/...`` metrics.

    Attributes:
        completions (int): completions generated.
        calls (int): tool calls made (results appended).
        errors (int): results that report an error (``error: ...``).
        result_tokens (int): tool-result tokens appended.
    """

    completions: int = 0
    calls: int = 0
    errors: int = 0
    result_tokens: int = 0

    def __add__(self, other: "ToolStats") -> "ToolStats":
        """The counts of two sets of rollouts together."""
        return ToolStats(self.completions + other.completions, self.calls + other.calls,
                         self.errors + other.errors, self.result_tokens + other.result_tokens)

    def as_tensor(self) -> torch.Tensor:
        """``[4]`` float64 (completions, calls, errors, result_tokens): all-reduce with SUM."""
        return torch.tensor([self.completions, self.calls, self.errors, self.result_tokens],
                            dtype=torch.float64)

    @staticmethod
    def metrics(sums: torch.Tensor | "ToolStats") -> dict[str, float]:
        """``tools/calls_per_completion``, ``tools/errors`` and ``tools/result_tokens`` (each per
        completion) from a :class:`ToolStats` or its :meth:`as_tensor` summed over ranks.
        """
        if isinstance(sums, ToolStats):
            sums = sums.as_tensor()
        completions, calls, errors, tokens = (float(x) for x in sums.tolist())
        per = 1.0 / completions if completions > 0 else 0.0
        return {
            "tools/calls_per_completion": calls * per,
            "tools/errors": errors * per,
            "tools/result_tokens": tokens * per,
        }


@dataclass
class ToolRow:
    """One completion being built by a multi-turn rollout (host-side lists).

    Attributes:
        prompt (list[int]): the prompt's ids (without padding).
        seed (int | None): the row's sampling seed (None: unseeded).
        remaining (int): response tokens left in the budget.
        resp (list[int]): the response so far, model and tool ids in order.
        policy (list[bool]): per ``resp`` id, True where the policy sampled it (False: tool).
        logprobs (list[float]): per ``resp`` id, its sampling log-prob (0 for tool ids).
        calls (int): tool calls answered.
        errors (int): answers that report an error.
        stopped (bool): whether the row ended on a stop token.
        pending (bool): whether the row continues in the next turn.
    """

    prompt: list[int]
    seed: int | None
    remaining: int
    resp: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    calls: int = 0
    errors: int = 0
    stopped: bool = False
    pending: bool = True


def rows_to_trajectory(rows: Sequence[ToolRow], prompt_tokens: torch.Tensor,
                       prompt_mask: torch.Tensor, group_size: int, pad_id: int) -> Trajectory:
    """The padded :class:`~torchtune_grpo.algorithm.trajectory.Trajectory` of finished rows.

    Args:
        rows: the ``N = B * group_size`` rows, prompt-major.
        prompt_tokens: ``[B, P]`` the (left-padded) prompts.
        prompt_mask: ``[B, P]`` bool, True on prompt ids.
        group_size: ``G``, rows per prompt.
        pad_id: the padding id.

    Returns:
        A trajectory on the prompts' device, responses ``[N, T]`` (``T`` the longest row, at
        least 1): ``response_mask`` True on policy ids, ``tool_mask`` on tool ids, ``logprobs``
        0 on tool ids and padding.
    """
    device = prompt_tokens.device
    n = len(rows)
    width = max([len(r.resp) for r in rows] + [1])
    resp = torch.full((n, width), pad_id, dtype=torch.long)
    policy = torch.zeros(n, width, dtype=torch.bool)
    tool = torch.zeros(n, width, dtype=torch.bool)
    logprobs = torch.zeros(n, width, dtype=torch.float32)
    for i, r in enumerate(rows):
        k = len(r.resp)
        resp[i, :k] = torch.tensor(r.resp, dtype=torch.long)
        policy[i, :k] = torch.tensor(r.policy, dtype=torch.bool)
        tool[i, :k] = ~policy[i, :k]
        logprobs[i, :k] = torch.tensor(r.logprobs, dtype=torch.float32)
    return Trajectory(
        tokens=torch.cat([prompt_tokens.repeat_interleave(group_size, 0), resp.to(device)],
                         dim=1),
        prompt_mask=prompt_mask.repeat_interleave(group_size, 0).clone(),
        response_mask=policy.to(device),
        logprobs=logprobs.to(device),
        stopped=torch.tensor([r.stopped for r in rows], dtype=torch.bool, device=device),
        pad_id=pad_id,
        tool_mask=tool.to(device),
    )


def tool_segments(tokenizer: Any, traj: Trajectory,
                  stop_tokens: Sequence[int] = ()) -> list[list[dict[str, str]]]:
    """Each completion as alternating model / tool text, for transcripts (eval samples).

    Args:
        tokenizer: the run's tokenizer.
        traj: a rollout of ``N`` rows (``response_mask`` and ``tool_mask`` ``[N, T]``).
        stop_tokens: ids left out of the text (the stop token at the end).

    Returns:
        ``N`` lists of ``{"source": "model" | "tool", "text": ...}``, in order.
    """
    from torchtune_grpo.token_rules import safe_decode

    stops = {int(t) for t in stop_tokens}
    out = []
    for ids, policy, tool in zip(traj.response_tokens.tolist(), traj.response_mask.tolist(),
                                 traj.tool_mask.tolist()):
        segments: list[dict[str, str]] = []
        run: list[int] = []
        source = None
        for t, p, k in zip(ids, policy, tool):
            kind = "model" if p else "tool" if k else None
            if kind is None or (kind == "model" and t in stops):
                continue
            if kind != source and run:
                segments.append({"source": source, "text": safe_decode(tokenizer, run)})
                run = []
            source = kind
            run.append(t)
        if run:
            segments.append({"source": source, "text": safe_decode(tokenizer, run)})
        out.append(segments)
    return out


def decode_with_tools(tokenizer: Any, traj: Trajectory,
                      stop_tokens: Sequence[int] = ()) -> list[str]:
    """Each completion's whole text, model and tool tokens in order (stop tokens left out): the
    text a reward reads in a tool run.

    Args:
        tokenizer: the run's tokenizer.
        traj: a rollout of ``N`` rows.
        stop_tokens: ids left out of the text.

    Returns:
        ``N`` strings.
    """
    return ["".join(s["text"] for s in row) for row in tool_segments(tokenizer, traj, stop_tokens)]
