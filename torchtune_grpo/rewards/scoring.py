"""Decoding a rollout and scoring it, shared by training and evaluation (:func:`score_rollout`)."""

from __future__ import annotations

from typing import Any

import torch

from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.rollout.sampling import decode_completions
from torchtune_grpo.token_rules import stop_token_ids

__all__ = ["concat_reward_outputs", "score_rollout"]


def score_rollout(
    rewards: Any,
    tokenizer: Any,
    traj: Trajectory,
    batch: dict[str, Any],
    *,
    group_size: int,
    allowed_tokens: torch.Tensor,
    max_generated_tokens: int,
    with_tools: bool = False,
) -> tuple[list[str], Any]:
    """Decode ``traj``'s completions and score them.

    Args:
        rewards: the reward set (:class:`~torchtune_grpo.rewards.reward_set.RewardSet`).
        tokenizer: decodes the completions.
        traj: ``N = B * group_size`` completions, groups contiguous.
        batch: the collated prompts (``questions`` and ``answers``, ``B`` each).
        group_size: completions per prompt.
        allowed_tokens: ``[V]`` bool, ids the tokenizer can decode.
        max_generated_tokens: the generation budget (for length-aware rewards).
        with_tools: decode model and tool tokens together (``traj.tool_mask``); False: the
            policy's tokens only. ``response_lengths`` count the policy's tokens either way.

    Returns:
        ``(completions, reward_output)``: the ``N`` texts and the reward set's output.
    """
    if with_tools:
        from torchtune_grpo.rollout.tool_trajectory import decode_with_tools

        completions = decode_with_tools(tokenizer, traj, stop_token_ids(tokenizer))
    else:
        completions = decode_completions(tokenizer, traj, allowed_tokens)
    out = rewards(
        completions,
        [a for a in batch["answers"] for _ in range(group_size)],
        questions=[q for q in batch["questions"] for _ in range(group_size)],
        stopped=traj.stopped.tolist(),
        response_lengths=traj.response_lengths.tolist(),
        max_generated_tokens=max_generated_tokens,
    )
    return completions, out


def concat_reward_outputs(outputs: list[Any]) -> Any:
    """One reward output for consecutive chunks of a batch (gradient accumulation).

    Args:
        outputs: the chunks' :class:`~torchtune_grpo.rewards.reward_set.RewardOutput`, in order.

    Returns:
        Their concatenation (``total``, components and ``success`` concatenated, error counts
        summed); the single output itself when there is one.
    """
    if len(outputs) == 1:
        return outputs[0]
    return type(outputs[0])(
        total=torch.cat([o.total for o in outputs]),
        components={k: torch.cat([o.components[k] for o in outputs])
                    for k in outputs[0].components},
        success=torch.cat([o.success for o in outputs]),
        errors={k: sum(o.errors.get(k, 0) for o in outputs) for k in outputs[0].errors},
        counts={k: sum(o.counts.get(k, 0) for o in outputs)
                for k in dict.fromkeys(c for o in outputs for c in o.counts)},
    )
