"""Rewards that cannot be gamed: ``requires_success``, and every shipped config pays a wrong
answer nothing for its form (docs/rewards.md, "A wrong answer earns nothing")."""

from __future__ import annotations

import pytest

from torchtune_grpo.config.loading import list_shipped_configs, load_config
from torchtune_grpo.datasets import (
    ADDITION_TEMPLATE,
    ARITHMETIC_TEMPLATE,
    GSM8K_TEMPLATE,
    MATH_TEMPLATE,
    MULTIPLICATION_TEMPLATE,
    WORD_PROBLEM_TEMPLATE,
    format_boxed_completion,
    format_reference_completion,
    resolve_template,
)
from torchtune_grpo.rewards.build import build_reward_set

#: Each dataset builder's default template (a config's ``dataset.template`` wins).
DEFAULT_TEMPLATES = {
    "gsm8k_dataset": GSM8K_TEMPLATE,
    "math_dataset": MATH_TEMPLATE,
    "deepscaler_dataset": MATH_TEMPLATE,
    "arithmetic_dataset": ARITHMETIC_TEMPLATE,
    "addition_dataset": ADDITION_TEMPLATE,
    "multiplication_dataset": MULTIPLICATION_TEMPLATE,
    "word_problem_dataset": WORD_PROBLEM_TEMPLATE,
}
REASONING = ("Natalia sold 48 clips in April. In May she sold half as many, 48 / 2 = 24 clips. "
             "Altogether she sold 48 + 24 = 72 clips, and she gave away 56 of them, so she kept "
             "72 - 56 = 16.")
GOLD, WRONG = "18", "16"


def _completion(builder: str, template, reasoning: str, answer: str) -> str:
    if builder in ("math_dataset", "deepscaler_dataset"):
        return format_boxed_completion(reasoning, answer)
    return format_reference_completion(template, reasoning, answer)


def _configs_with_rewards():
    names = []
    for name in list_shipped_configs():
        cfg = load_config(name, [])
        if cfg.get("rewards") and cfg.get("dataset") is not None:
            names.append(name)
    return names


def _with_local_models(cfg, root):
    """Learned-reward entries (reward model, judge) whose folder is absent here get tiny local
    folders (tests/unit/rewards/_learned_models.py), so the property is checked on every config."""
    learned = ("RewardModelScore", "GenerativeJudge")
    if not any(str(e.get("_component_", "")).endswith(learned) for e in cfg.rewards):
        return cfg
    pytest.importorskip("transformers")
    from tests.unit.rewards._learned_models import with_local_reward_models

    return with_local_reward_models(cfg, root)


@pytest.mark.parametrize("name", _configs_with_rewards())
def test_no_shipped_config_pays_a_wrong_answer_for_its_form(name, tmp_path):
    cfg = _with_local_models(load_config(name, []), tmp_path)
    builder = str(cfg.dataset._component_).rsplit(".", 1)[-1]
    template = resolve_template(cfg.dataset.get("template"), default=DEFAULT_TEMPLATES[builder])
    rewards = build_reward_set(cfg.rewards)
    texts = {
        "terse wrong": _completion(builder, template, "", WRONG),
        "reasoned wrong": _completion(builder, template, REASONING, WRONG),
        "reasoned wrong, no format": REASONING,
        "terse right": _completion(builder, template, "", GOLD),
        "reasoned right": _completion(builder, template, REASONING.replace("= 16", "= 18"),
                                      GOLD),
    }
    n = len(texts)
    out = rewards(list(texts.values()), [GOLD] * n, questions=["q"] * n, stopped=[True] * n,
                  response_lengths=[len(t) // 4 for t in texts.values()],
                  max_generated_tokens=int(cfg.get("max_generated_tokens", 256)))
    total = dict(zip(texts, out.total.tolist()))
    success = dict(zip(texts, out.success.tolist()))
    assert success["terse right"] and success["reasoned right"], (name, texts, total)
    assert not success["terse wrong"] and not success["reasoned wrong"], (name, total)
    # the documented failure: "The answer is N." alone must never beat a reasoned wrong answer
    assert total["terse wrong"] <= total["reasoned wrong"], (name, total)
    assert total["terse wrong"] <= total["reasoned wrong, no format"], (name, total)
    # a wrong answer earns nothing, and less than any right one
    wrong = [v for k, v in total.items() if "wrong" in k]
    assert max(wrong) <= 0 < min(total["terse right"], total["reasoned right"]), (name, total)


def test_requires_success_pays_bonuses_only_to_successes_and_keeps_penalties():
    rewards = build_reward_set([
        {"_component_": "torchtune_grpo.rewards.components.NumericCorrectness", "answer_tag": None,
         "answer_phrase": "The answer is", "fallback": "last_number", "success": True},
        {"_component_": "torchtune_grpo.rewards.components.AnswerPhraseFormat", "weight": 0.2,
         "requires_success": True},
        {"_component_": "tests.unit.rewards.test_reward_gating.signed", "weight": 1.0,
         "requires_success": True},
    ])
    completions = ["The answer is 18.", "The answer is 16.", "It is 18", "It is 16"]
    out = rewards(completions, ["18"] * 4, stopped=[True] * 4)
    assert out.success.tolist() == [True, False, True, False]
    # components are reported as computed; the total gates the format bonus on success
    assert out.components["format"].tolist() == [1.0, 1.0, 0.0, 0.0]
    # signed(): +0.5 on completions with "The answer", -0.5 on the others
    assert out.total.tolist() == pytest.approx([1.0 + 0.2 + 0.5, 0.0, 1.0 - 0.5, -0.5])


def signed(completions, answers, **kwargs):
    """+0.5 for completions with an answer sentence, -0.5 for the others (a test component)."""
    return [0.5 if "The answer" in c else -0.5 for c in completions]


@pytest.mark.parametrize("entry, message", [
    ({"requires_success": "yes"}, "requires_success` must be true or false"),
    ({"requires_success": True, "success": True}, "cannot be set on the success entry"),
])
def test_requires_success_is_checked(entry, message):
    with pytest.raises(ValueError, match=message):
        build_reward_set([{"_component_": "torchtune_grpo.rewards.components.NumericCorrectness",
                           **entry}])
