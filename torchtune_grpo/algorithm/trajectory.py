"""The padded trajectory of one GRPO rollout, and the helpers that keep its shapes uniform.

Prompts are left-padded to a common ``P``, responses right-padded to a common ``T``. Response
positions hold a policy token (``response_mask``, the only ones scored), a tool-result token
(``tool_mask``, context only) or padding; the masks never overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F


@dataclass
class Trajectory:
    """One rollout of ``N = B * G`` sequences (groups contiguous: rows ``g*G .. g*G+G-1``).

    Attributes:
        tokens: ``[N, P + T]`` left-padded prompt followed by the right-padded response.
        prompt_mask: ``[N, P]`` True on real (non-pad) prompt tokens.
        response_mask: ``[N, T]`` True on generated tokens, up to and including the stop token.
        logprobs: ``[N, T]`` float32 log-probs of the sampled tokens at generation time
            (tempered, with forbidden ids removed), 0 where ``response_mask`` is False.
        stopped: ``[N]`` True where the completion ended on a stop token.
        pad_id: the id used for padding.
        tool_mask: ``[N, T]`` True on tool-result tokens (disjoint from ``response_mask``);
            None becomes all False.
    """

    tokens: torch.Tensor
    prompt_mask: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    stopped: torch.Tensor
    pad_id: int
    tool_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.tool_mask is None:
            self.tool_mask = torch.zeros_like(self.response_mask, dtype=torch.bool)
        elif self.tool_mask.shape != self.response_mask.shape:
            raise ValueError(
                f"tool_mask must have the shape of response_mask {tuple(self.response_mask.shape)}"
                f", got {tuple(self.tool_mask.shape)}"
            )

    @property
    def prompt_len(self) -> int:
        """``P``: padded prompt length."""
        return self.prompt_mask.shape[1]

    @property
    def response_len(self) -> int:
        """``T``: padded response length."""
        return self.response_mask.shape[1]

    @property
    def num_sequences(self) -> int:
        """``N``."""
        return self.tokens.shape[0]

    @property
    def response_tokens(self) -> torch.Tensor:
        """``[N, T]`` response ids (``pad_id`` after the end)."""
        return self.tokens[:, self.prompt_len :]

    @property
    def response_lengths(self) -> torch.Tensor:
        """``[N]`` number of tokens the policy generated, stop token included (tool-result
        tokens excluded)."""
        return self.response_mask.sum(dim=1)

    @property
    def tool_lengths(self) -> torch.Tensor:
        """``[N]`` number of tool-result tokens in each response."""
        return self.tool_mask.sum(dim=1)

    @property
    def present_mask(self) -> torch.Tensor:
        """``[N, T]`` True on response positions that hold a token: generated or tool result."""
        return self.response_mask | self.tool_mask

    @property
    def padding_mask(self) -> torch.Tensor:
        """``[N, P + T]`` True on real tokens (prompt, generated and tool-result): the mask
        attention and position ids are built from."""
        return torch.cat([self.prompt_mask, self.present_mask], dim=1)

    def to(self, device: torch.device | str) -> "Trajectory":
        """Move every tensor to ``device``."""
        values = {
            f.name: (getattr(self, f.name).to(device) if torch.is_tensor(getattr(self, f.name))
                     else getattr(self, f.name))
            for f in fields(self)
        }
        return Trajectory(**values)

    def select(self, index: torch.Tensor | slice) -> "Trajectory":
        """Rows ``index`` of every per-sequence tensor (shapes ``P`` and ``T`` unchanged)."""
        return replace(
            self,
            tokens=self.tokens[index],
            prompt_mask=self.prompt_mask[index],
            response_mask=self.response_mask[index],
            logprobs=self.logprobs[index],
            stopped=self.stopped[index],
            tool_mask=self.tool_mask[index],
        )


def prompt_mask(tokens: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
    """``[B, P]`` True on the real tokens of left-padded prompts (from the lengths alone).

    Args:
        tokens: ``[B, P]`` left-padded prompt ids.
        prompt_lengths: ``[B]`` real tokens per prompt.
    """
    width = tokens.shape[1]
    positions = torch.arange(width, device=tokens.device)[None, :]
    return positions >= width - prompt_lengths.to(tokens.device)[:, None]


def _pad_right(x: torch.Tensor, length: int, value) -> torch.Tensor:
    return F.pad(x, (0, length - x.shape[1]), value=value) if x.shape[1] < length else x


def _pad_left(x: torch.Tensor, length: int, value) -> torch.Tensor:
    return F.pad(x, (length - x.shape[1], 0), value=value) if x.shape[1] < length else x


def pad_trajectory(traj: Trajectory, prompt_len: int, response_len: int) -> Trajectory:
    """Pad ``traj`` to ``prompt_len`` prompt and ``response_len`` response positions.

    Prompts grow on the left, responses on the right; nothing is ever truncated.
    """
    if prompt_len < traj.prompt_len or response_len < traj.response_len:
        raise ValueError(
            f"cannot shrink a trajectory from P={traj.prompt_len}, T={traj.response_len} "
            f"to P={prompt_len}, T={response_len}"
        )
    prompt = _pad_left(traj.tokens[:, : traj.prompt_len], prompt_len, traj.pad_id)
    response = _pad_right(traj.response_tokens, response_len, traj.pad_id)
    return Trajectory(
        tokens=torch.cat([prompt, response], dim=1),
        prompt_mask=_pad_left(traj.prompt_mask, prompt_len, False),
        response_mask=_pad_right(traj.response_mask, response_len, False),
        logprobs=_pad_right(traj.logprobs, response_len, 0.0),
        stopped=traj.stopped,
        pad_id=traj.pad_id,
        tool_mask=_pad_right(traj.tool_mask, response_len, False),
    )


def concat_trajectories(parts: list[Trajectory]) -> Trajectory:
    """Concatenate trajectories of any ``P`` and ``T`` into one of uniform shape.

    Returns:
        A trajectory with ``N = sum(N_i)``, ``P = max(P_i)`` and ``T = max(T_i)``.
    """
    if not parts:
        raise ValueError("concat_trajectories needs at least one trajectory")
    prompt_len = max(p.prompt_len for p in parts)
    response_len = max(p.response_len for p in parts)
    padded = [pad_trajectory(p, prompt_len, response_len) for p in parts]
    return Trajectory(
        tokens=torch.cat([p.tokens for p in padded]),
        prompt_mask=torch.cat([p.prompt_mask for p in padded]),
        response_mask=torch.cat([p.response_mask for p in padded]),
        logprobs=torch.cat([p.logprobs for p in padded]),
        stopped=torch.cat([p.stopped for p in padded]),
        pad_id=parts[0].pad_id,
        tool_mask=torch.cat([p.tool_mask for p in padded]),
    )
