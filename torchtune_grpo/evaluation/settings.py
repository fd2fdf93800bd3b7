"""How an evaluation samples: the ``eval:`` block of a training config and the top-level keys of
a ``grpo_eval`` config, with their defaults and checks in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EvalSettings", "sampling_problems"]


def sampling_problems(num_samples: int, temperature: float, k: list[int]) -> dict[str, str]:
    """What is wrong with evaluation sampling settings, by key (empty when they are fine).

    Shared by :class:`EvalSettings` (the training recipe's ``eval:`` block) and the
    ``grpo_eval`` config check in :func:`torchtune_grpo.config.validation.validate_config`.
    """
    problems = {}
    if num_samples < 1:
        problems["num_samples"] = f"num_samples must be >= 1, got {num_samples}"
    elif num_samples > 1 and temperature <= 0:
        problems["num_samples"] = (
            "num_samples > 1 needs 'temperature' > 0 (greedy decoding repeats itself)"
        )
    bad = [v for v in k if not 1 <= int(v) <= num_samples]
    if bad:
        problems["k"] = f"k values {bad} must lie in 1..num_samples={num_samples}"
    return problems


@dataclass
class EvalSettings:
    """How to sample during evaluation (the ``eval:`` block of a training config; the
    top-level keys of a ``grpo_eval`` config take their defaults from here).

    Attributes:
        num_samples: completions per problem (1 with ``temperature: 0`` is greedy pass@1).
        temperature: 0 for greedy decoding.
        top_k: top-k sampling (None: off).
        k: budgets reported as ``pass@k`` and ``maj@k`` (each ``<= num_samples``).
        max_generated_tokens: generation budget per completion. In a training config's
            ``eval:`` block, unset or null means the training ``max_generated_tokens``.
        forward_batch_size: sequences per generation micro-batch. In a training config's
            ``eval:`` block, unset or null means the training ``forward_batch_size``.
        seed: base seed of the per-sample random numbers: the run's ``seed``, set by the
            recipe (its ``set_by_recipe`` metadata keeps it out of the ``eval:`` block's keys).
    """

    num_samples: int = 1
    temperature: float = 0.0
    top_k: int | None = None
    k: list[int] = field(default_factory=lambda: [1])
    max_generated_tokens: int = 256
    forward_batch_size: int = 64
    seed: int = field(default=0, metadata={"set_by_recipe": True})

    def __post_init__(self) -> None:
        problems = sampling_problems(self.num_samples, self.temperature, self.k)
        if problems:
            raise ValueError("eval " + "; ".join(problems.values()))
