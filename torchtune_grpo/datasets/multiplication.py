"""The tool quickstart's task: multiply a two-digit by a three-digit number.

``"What is 37*412?"`` -> ``15244``. Problems are generated, not downloaded: every pair of a
two-digit (10-99) and a three-digit (100-999) operand, 81,000 problems whose products have
four or five digits. The tiny quickstart model cannot compute such products in its head (it
would have to learn long multiplication), but it can learn to **call the calculator tool**
(:class:`~torchtune_grpo.rollout.tools.calculator.Calculator`) and copy the result into its answer::

    What is 37*412?<calculator>37*412</calculator><result>15244</result>Answer: 15244

(prompt, the model's call, the tool's result, the model's final answer). The final answer is
the number after the model's last ``Answer:`` (:data:`MULTIPLICATION_ANSWER_PHRASE`), scored by
:class:`~torchtune_grpo.rewards.components.NumericCorrectness` with ``answer_tag: null`` and
``answer_phrase: "Answer:"``: the tool's own ``<result>`` is never read as the answer, so a
completion that calls the tool and stops earns nothing (the reward is on the final answer
only, never on calling the tool).

The problems are shuffled once with a fixed seed (:data:`SPLIT_SEED`, independent of a run's
seed) and cut into three disjoint splits: ``test`` (held out for evaluation), ``warmup`` (only
for the supervised warm-up of ``tune-grpo prepare-quickstart --tools``, see
:mod:`torchtune_grpo.quickstart.prepare`) and ``train`` (GRPO prompts). The prompt is the plain text
``"What is 37*412?"`` after the BOS token, no chat template.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from torchtune_grpo.datasets._prompt import PromptDataset, PromptTemplate
from torchtune_grpo.errors import DataError

#: Range of the first (two-digit) operand, inclusive.
FIRST_OPERAND = (10, 99)
#: Range of the second (three-digit) operand, inclusive.
SECOND_OPERAND = (100, 999)
#: Sizes of the held-out and warm-up splits; ``train`` takes the rest (75,700 problems).
MULTIPLICATION_SPLIT_SIZES = {"test": 300, "warmup": 5000}
#: Seed that fixes which problems fall in which split (independent of a run's seed).
SPLIT_SEED = 4321
#: The phrase that introduces the final answer (the reward's ``answer_phrase``).
MULTIPLICATION_ANSWER_PHRASE = "Answer:"
#: Plain-text prompt: the question as is, no chat headers.
MULTIPLICATION_TEMPLATE = PromptTemplate(user="{question}", chat=False,
                                         answer_phrase=MULTIPLICATION_ANSWER_PHRASE)


def multiplication_operands(split: str) -> list[tuple[int, int]]:
    """Operand pairs ``(a, b)`` of one split, in the split's fixed order.

    Args:
        split: ``"train"``, ``"test"`` or ``"warmup"`` (see the module docstring).

    Raises:
        ValueError: on an unknown split.
    """
    pairs = [(a, b) for a in range(FIRST_OPERAND[0], FIRST_OPERAND[1] + 1)
             for b in range(SECOND_OPERAND[0], SECOND_OPERAND[1] + 1)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    n_test, n_warm = MULTIPLICATION_SPLIT_SIZES["test"], MULTIPLICATION_SPLIT_SIZES["warmup"]
    ranges = {
        "test": pairs[:n_test],
        "warmup": pairs[n_test : n_test + n_warm],
        "train": pairs[n_test + n_warm :],
    }
    if split not in ranges:
        raise DataError(f"split must be one of {sorted(ranges)}, got {split!r}")
    return ranges[split]


def multiplication_question(a: int, b: int) -> str:
    """The prompt text of ``a * b``: ``"What is 37*412?"``."""
    return f"What is {a}*{b}?"


def multiplication_problems(split: str) -> list[tuple[str, str]]:
    """Problems of one split as ``(question, answer)`` pairs, e.g.
    ``("What is 37*412?", "15244")``.

    Args:
        split: ``"train"``, ``"test"`` or ``"warmup"`` (see the module docstring).

    Raises:
        ValueError: on an unknown split.
    """
    return [(multiplication_question(a, b), str(a * b)) for a, b in multiplication_operands(split)]


def multiplication_dataset(
    tokenizer: Any,
    *,
    split: str = "train",
    limit: int | None = None,
    difficulty_file: str | None = None,
    difficulty_band: Sequence[float] = (0.0, 1.0),
) -> PromptDataset:
    """The tool quickstart's task as a :class:`PromptDataset` (``grpo/quickstart_cpu_tools``).

    Args:
        tokenizer: a torchtune tokenizer.
        split: ``"train"``, ``"test"`` or ``"warmup"``.
        limit: keep only the first ``limit`` problems of the split.
        difficulty_file: per-row pass rates from ``tune-grpo difficulty``: keep only the rows
            whose pass rate lies strictly inside ``difficulty_band``
            (:mod:`torchtune_grpo.evaluation.difficulty`). ``None``: every row.
        difficulty_band: ``[low, high]``, default ``[0, 1]``: the rows solved sometimes.
    """
    problems = multiplication_problems(split)[:limit]
    samples = [(q, a, i) for i, (q, a) in enumerate(problems)]
    return PromptDataset(samples, tokenizer, MULTIPLICATION_TEMPLATE,
                         name=f"multiplication[{split}]", difficulty_file=difficulty_file,
                         difficulty_band=difficulty_band)
