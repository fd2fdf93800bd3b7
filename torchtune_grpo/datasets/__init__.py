"""Prompt datasets for GRPO: templates, local/Hub loading, GSM8K, MATH, the generated tasks."""

from torchtune_grpo.datasets._loading import LOCAL_FORMATS, load_rows
from torchtune_grpo.datasets._prompt import (
    GSM8K_PHRASE_TEMPLATE,
    GSM8K_TEMPLATE,
    INVALID_ROW_POLICIES,
    PromptDataset,
    PromptTemplate,
    collate_prompts,
    format_reference_completion,
    resolve_template,
    tokenize_prompt,
)
from torchtune_grpo.datasets.addition import (
    ADDITION_TEMPLATE,
    addition_dataset,
    addition_problems,
)
from torchtune_grpo.datasets.arithmetic import (
    ARITHMETIC_TEMPLATE,
    EQUATION_FEW_SHOT_TEMPLATE,
    EQUATION_TEMPLATE,
    arithmetic_dataset,
    arithmetic_problems,
)
from torchtune_grpo.datasets.gsm8k import (
    extract_gsm8k_answer,
    gsm8k_dataset,
    split_gsm8k_solution,
)
from torchtune_grpo.datasets.math import (
    MATH_SUBJECTS,
    MATH_TEMPLATE,
    deepscaler_dataset,
    format_boxed_completion,
    math_dataset,
    math_gold_answer,
)
from torchtune_grpo.datasets.multiplication import (
    MULTIPLICATION_ANSWER_PHRASE,
    MULTIPLICATION_TEMPLATE,
    multiplication_dataset,
    multiplication_problems,
)
from torchtune_grpo.datasets.word_problems import (
    WORD_PROBLEM_TEMPLATE,
    word_problem_dataset,
    word_problems,
)

__all__ = [
    "ARITHMETIC_TEMPLATE",
    "EQUATION_FEW_SHOT_TEMPLATE",
    "EQUATION_TEMPLATE",
    "arithmetic_dataset",
    "arithmetic_problems",
    "ADDITION_TEMPLATE",
    "addition_dataset",
    "addition_problems",
    "GSM8K_PHRASE_TEMPLATE",
    "GSM8K_TEMPLATE",
    "INVALID_ROW_POLICIES",
    "LOCAL_FORMATS",
    "MATH_SUBJECTS",
    "MATH_TEMPLATE",
    "PromptDataset",
    "PromptTemplate",
    "collate_prompts",
    "deepscaler_dataset",
    "extract_gsm8k_answer",
    "format_boxed_completion",
    "format_reference_completion",
    "gsm8k_dataset",
    "load_rows",
    "math_dataset",
    "math_gold_answer",
    "MULTIPLICATION_ANSWER_PHRASE",
    "MULTIPLICATION_TEMPLATE",
    "multiplication_dataset",
    "multiplication_problems",
    "resolve_template",
    "split_gsm8k_solution",
    "tokenize_prompt",
    "WORD_PROBLEM_TEMPLATE",
    "word_problem_dataset",
    "word_problems",
]
