"""Gemma's chat format: the assistant's role is ``model`` and a system message opens the first
user turn (Gemma has no system turn). The template
(``tests/unit/data/gemma_style_chat_template.jinja``) is written for these tests in that
format; our prompt ids must equal ``transformers``' ``apply_chat_template`` with the same
template text, and a conversation that does not alternate is refused by the template's own
``raise_exception``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import processors

from tests.unit.models.test_hf_tokenizer import _train, _write
from torchtune_grpo.datasets._prompt import PromptTemplate, tokenize_prompt
from torchtune_grpo.models.tokenizer import hf_tokenizer

TEMPLATE = Path(__file__).parent / "data" / "gemma_style_chat_template.jinja"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    tok = _train(SPECIALS, lambda t: processors.ByteLevel(trim_offsets=False))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
              "unk_token": None, "add_bos_token": False}
    return _write(tmp_path_factory.mktemp("gemma_tok"), tok, config,
                  {"chat_template.jinja": TEMPLATE.read_text()})


@pytest.fixture(scope="module")
def reference(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _ids(out) -> list[int]:
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(i) for i in out]


@pytest.mark.parametrize("system", [None, "Answer with a number."])
def test_prompt_ids_match_transformers(folder, reference, system):
    tok = hf_tokenizer(str(folder))
    template = PromptTemplate(user="{question}", system=system)
    ids = tokenize_prompt(tok, template, "What is 12 + 30?")
    dicts = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "What is 12 + 30?"}]
    want = _ids(reference.apply_chat_template(dicts, tokenize=True, add_generation_prompt=True))
    assert ids == want
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<bos><start_of_turn>user\n")
    assert text.endswith("<end_of_turn>\n<start_of_turn>model\n")
    assert ("Answer with a number.\n\nWhat is 12 + 30?" in text) == (system is not None)
    assert "<start_of_turn>system" not in text


def test_a_conversation_renders_the_model_role(folder, reference):
    """Earlier assistant turns are ``model`` turns, ids equal transformers'."""
    tok = hf_tokenizer(str(folder))
    dicts = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What is 6 + 7?"},
             {"role": "assistant", "content": "13"},
             {"role": "user", "content": "And 40 + 2?"}]
    want = _ids(reference.apply_chat_template(dicts, tokenize=True, add_generation_prompt=True))
    from torchtune.data import Message

    messages = [Message(role=d["role"], content=d["content"], masked=d["role"] != "assistant")
                for d in dicts] + [Message(role="assistant", content="", masked=False, eot=False)]
    ids, _ = tok.tokenize_messages(messages, add_end_tokens=False)
    assert ids == want
    assert "<start_of_turn>model\n13<end_of_turn>" in tok.decode(ids, skip_special_tokens=False)


def test_a_turn_order_the_template_refuses_is_one_line(folder):
    """Two user turns in a row: the template's ``raise_exception`` is one ``ValueError`` line."""
    from torchtune.data import Message

    tok = hf_tokenizer(str(folder))
    with pytest.raises(ValueError, match="alternate") as info:
        tok.tokenize_messages([Message(role="user", content="a", masked=True),
                               Message(role="user", content="b", masked=True)],
                              add_end_tokens=False)
    assert "\n" not in str(info.value)
