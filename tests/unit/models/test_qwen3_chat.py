"""Qwen3's thinking mode: the chat template's ``enable_thinking`` switch (a tokenizer config
key) and rewards that read the answer after the ``</think>`` block.

The template (``tests/unit/data/qwen3_style_chat_template.jinja``) is written for these tests in
the manner of Qwen3's: ``enable_thinking=false`` appends an empty reasoning block to the
generation prompt, and earlier assistant turns keep only what follows their reasoning. Our ids
must equal ``transformers``' ``apply_chat_template`` with the same template and switch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import processors
from torchtune.data import Message

from tests.unit.models.test_hf_tokenizer import CHATML_SPECIALS, _train, _write
from torchtune_grpo.datasets._prompt import PromptTemplate, tokenize_prompt
from torchtune_grpo.models.tokenizer import HFTokenizer, hf_tokenizer
from torchtune_grpo.rewards.answers import after_thinking
from torchtune_grpo.rewards.components import NumericCorrectness

TEMPLATE = Path(__file__).parent / "data" / "qwen3_style_chat_template.jinja"
SWITCH = {"default": None, "on": True, "off": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    tok = _train(CHATML_SPECIALS, lambda t: processors.ByteLevel(trim_offsets=False),
                 non_special=("<think>", "</think>"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None}
    return _write(tmp_path_factory.mktemp("qwen3_tok"), tok, config,
                  {"chat_template.jinja": TEMPLATE.read_text()})


@pytest.fixture(scope="module")
def reference(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _ids(out) -> list[int]:
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(i) for i in out]


def _reference_ids(reference, dicts, switch, **kwargs) -> list[int]:
    extra = {} if switch is None else {"enable_thinking": switch}
    return _ids(reference.apply_chat_template(dicts, tokenize=True, **kwargs, **extra))


HISTORY = [
    Message(role="system", content="Answer with a number.", masked=True),
    Message(role="user", content="What is 6 × 7?", masked=True),
    Message(role="assistant", content="<think>\n6 times 7 is 42.\n</think>\n\nIt is 42.",
            masked=False),
    Message(role="user", content="And 40 + 2?", masked=True),
]


@pytest.mark.parametrize("switch", sorted(SWITCH))
def test_prompt_ids_match_transformers(folder, reference, switch):
    value = SWITCH[switch]
    tok = hf_tokenizer(str(folder), enable_thinking=value)
    template = PromptTemplate(user="{question}", system="Answer with a number.")
    ids = tokenize_prompt(tok, template, "What is 12 + 30?")
    dicts = [{"role": "system", "content": "Answer with a number."},
             {"role": "user", "content": "What is 12 + 30?"}]
    assert ids == _reference_ids(reference, dicts, value, add_generation_prompt=True)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("</think>\n\n") == (value is False)


@pytest.mark.parametrize("switch", sorted(SWITCH))
def test_history_with_reasoning_matches_transformers(folder, reference, switch):
    """A multi-turn prompt: the earlier turn's reasoning is dropped, the switch applies."""
    value = SWITCH[switch]
    tok = HFTokenizer(folder, enable_thinking=value)
    msgs = [*HISTORY, Message(role="assistant", content="", eot=False)]
    tokens, mask = tok.tokenize_messages(msgs)
    dicts = [{"role": m.role, "content": m.text_content} for m in HISTORY]
    assert tokens == _reference_ids(reference, dicts, value, add_generation_prompt=True)
    text = tok.decode(tokens, skip_special_tokens=False)
    assert "6 times 7" not in text and "It is 42." in text
    assert len(mask) == len(tokens)


def test_switch_changes_the_prompt_and_kwargs_override(folder):
    on, off = HFTokenizer(folder, enable_thinking=True), HFTokenizer(folder, enable_thinking=False)
    dicts = [{"role": "user", "content": "Hi"}]
    assert on.apply_chat_template(dicts, add_generation_prompt=True) != off.apply_chat_template(
        dicts, add_generation_prompt=True)
    assert off.apply_chat_template(dicts, add_generation_prompt=True, enable_thinking=True) == \
        on.apply_chat_template(dicts, add_generation_prompt=True)
    assert HFTokenizer(folder).template_variables == {}


# ---------------------------------------------------------------- answers after </think>
@pytest.mark.parametrize("text, expected", [
    ("<think>\nmaybe 7? no, 12\n</think>\n\nThe answer is 42.", "\n\nThe answer is 42."),
    ("<think>a</think>b<think>c</think> 5", " 5"),  # the last block closes the reasoning
    ("<THINK>x</Think>y", "y"),
    ("<think>\n12 + 30 = 42, so the answer is 42", None),  # truncated inside the reasoning
    ("The answer is 42.", "The answer is 42."),  # no reasoning block: unchanged
    ("", ""),
])
def test_after_thinking(text, expected):
    assert after_thinking(text) == expected


def test_numeric_correctness_reads_after_the_reasoning():
    reward = NumericCorrectness(answer_tag=None, answer_phrase="The answer is",
                                fallback="last_number", think_tag="think")
    completions = [
        "<think>\nThe answer is 40? Check: 12 + 30 = 42.\n</think>\n\nThe answer is 42.",
        "<think>\nThe answer is 42.\n</think>\n\nThe answer is 41.",  # right only in a draft
        "<think>\nso the answer is 42",  # never finished thinking: no answer
        "<think>\n12 + 30\n</think>\n\n42",  # no phrase after it: last number after the block
    ]
    assert reward(completions, ["42"] * 4) == [1.0, 0.0, 0.0, 1.0]
    plain = NumericCorrectness(answer_tag=None, answer_phrase="The answer is",
                               fallback="last_number")  # default: the whole completion
    assert plain(completions, ["42"] * 4) == [1.0, 0.0, 1.0, 1.0]


def test_math_equivalence_reads_after_the_reasoning():
    pytest.importorskip("math_verify")
    from torchtune_grpo.rewards.math_grading import MathEquivalence

    grader = MathEquivalence(isolation="inline", think_tag="think")
    completions = ["<think>maybe \\boxed{3}</think> so \\boxed{\\frac{1}{2}}",
                   "<think>\\boxed{\\frac{1}{2}}</think> \\boxed{3}",
                   "<think>\\boxed{\\frac{1}{2}}"]
    assert grader(completions, ["\\frac{1}{2}"] * 3) == [1.0, 0.0, 0.0]


def test_enable_thinking_on_a_template_without_it_is_a_config_error(tmp_path):
    """A Qwen3 config carried over to a family with no thinking mode: one line naming the key
    (it would otherwise be ignored without a word, and think_tag would read no answer)."""
    from torchtune_grpo.errors import UserError

    tok = _train(CHATML_SPECIALS, lambda t: processors.ByteLevel(trim_offsets=False))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None}
    plain = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    folder = _write(tmp_path / "plain", tok, config, {"chat_template.jinja": plain})
    HFTokenizer(folder)  # without the key: fine
    for value in (True, False):
        with pytest.raises(UserError, match=r"^tokenizer.enable_thinking: the chat template of "
                                            r".* does not read enable_thinking") as info:
            HFTokenizer(folder, enable_thinking=value)
        assert "\n" not in str(info.value)
