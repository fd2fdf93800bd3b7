"""Step 3 of the GRPO step, shared by training and evaluation: decode a rollout and score it.

:func:`score_rollout` turns the ``group_size`` completions of each prompt of a collated batch
into text and applies the reward set, with each completion paired with its prompt's question
and reference answer. The training recipe and
:func:`torchtune_grpo.evaluation.evaluate.evaluate` both call it, so a completion is scored the
same way in both.
"""

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

    With tools (a multi-turn rollout), a completion's text is the model's and the tools'
    tokens in order (:func:`~torchtune_grpo.rollout.tool_trajectory.decode_with_tools`), so a reward
    reads the final answer the model wrote after the last tool result; the
    ``response_lengths`` given to the rewards count the policy's tokens only.

    Args:
        rewards: the reward set (:class:`~torchtune_grpo.rewards.reward_set.RewardSet`).
        tokenizer: decodes the completions.
        traj: ``N = B * group_size`` completions, the group of prompt ``b`` in rows
            ``b * group_size ... (b + 1) * group_size - 1``.
        batch: the collated prompts (``questions`` and ``answers``, ``B`` each).
        group_size: completions per prompt.
        allowed_tokens: ``[V]`` bool, ids the tokenizer can decode.
        max_generated_tokens: the generation budget (for length-aware rewards).
        with_tools: decode model and tool tokens together (``traj.tool_mask``); False: the
            policy's tokens only (:func:`~torchtune_grpo.rollout.sampling.decode_completions`).

    Returns:
        ``(completions, reward_output)``: the ``N`` texts and the reward set's output
        (``total [N]``, per-component ``[N]``, ``success [N]``, error counts).
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
