"""The tokenizer of a GGUF model as Hugging Face tokenizer files (used by ``gguf_to_hf``).

Byte-level BPE (``tokenizer.ggml.model`` ``gpt2``, e.g. SmolLM2) is rebuilt from the tokens,
merges and ``tokenizer.ggml.pre``; Gemma 3's SentencePiece BPE (``llama``, no merges listed)
by :func:`_sentencepiece_bpe`, with merges derived from the vocabulary order and byte fallback.
Control tokens become special added tokens, user-defined ones added tokens matched whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchtune_grpo.models.gguf.reader import GgufFile

__all__ = ["tokenizer_from_gguf"]

# GGUF token types (gguf.TokenType): CONTROL tokens are special (<|im_start|>), USER_DEFINED ones
# are added tokens matched whole but not special (<think>).
_CONTROL, _USER_DEFINED = 3, 4
_PRE_TOKENIZERS = ("gpt2", "smollm")


def tokenizer_from_gguf(src: GgufFile) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The Hugging Face tokenizer files of a GGUF model, from its metadata.

    Args:
        src: the GGUF file (``src.get(key, default)`` reads a metadata key).

    Returns:
        ``(tokenizer, tokenizer_config, special_tokens_map)``: a ``tokenizers.Tokenizer`` and the
        contents of ``tokenizer_config.json`` (with the chat template, when the GGUF has one) and
        ``special_tokens_map.json``.

    Raises:
        ValueError: a tokenizer other than byte-level BPE (``gpt2``) or Gemma 3's SentencePiece
            BPE (``llama``), an unsupported ``tokenizer.ggml.pre``, or a malformed merge.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = src.get("tokenizer.ggml.model", None)
    if kind == "llama" and src.get("general.architecture") == "gemma3":
        return _with_configs(src, _sentencepiece_bpe(src))
    if kind != "gpt2":
        raise ValueError(f"{src.path}: tokenizer.ggml.model is {kind!r}; supported: byte-level "
                         "BPE ('gpt2'), and SentencePiece ('llama') for architecture 'gemma3'")
    pre = src.get("tokenizer.ggml.pre", None)
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"{src.path}: tokenizer.ggml.pre is {pre!r}; supported pre-tokenizers: "
                         f"{list(_PRE_TOKENIZERS)}")
    tokens: list[str] = src.get("tokenizer.ggml.tokens")
    types: list[int] = src.get("tokenizer.ggml.token_type", None) or [1] * len(tokens)
    merges = []
    for merge in src.get("tokenizer.ggml.merges"):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ValueError(f"{src.path}: merge {merge!r} is not two space-separated tokens")
        merges.append((pair[0], pair[1]))

    # A byte-level vocabulary spells every byte with one of 256 printable characters; respell a
    # plain token written in raw text (some converters do) so that the merges can reach it.
    byte_char = _bytes_to_unicode()
    alphabet = set(byte_char)
    vocab: dict[str, int] = {}
    for index, (token, kind_) in enumerate(zip(tokens, types)):
        if kind_ not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(byte_char[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp: "\p{N}" then the GPT-2 regex
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types) if k == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, k in zip(tokens, types) if k == _USER_DEFINED])
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer, config, special_map = _with_configs(src, tokenizer)
    config["add_prefix_space"] = False
    return tokenizer, config, special_map


def _with_configs(src: GgufFile, tokenizer: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """``tokenizer`` with BOS/EOS added as the GGUF says (a template post-processor, else the
    one it has), and ``(tokenizer_config, special_tokens_map)``."""
    from tokenizers import processors

    tokens: list[str] = src.get("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        index = src.get(f"tokenizer.ggml.{key}_token_id", None)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    add_bos = bool(src.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(src.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"]
                          + ([f"{eos}:0"] if add_eos else []))
        pair = single + " " + single.replace("$A:0", "$B:1").replace(":0", ":1")
        specials = [(t, tokens.index(t)) for t in {bos, eos} if t is not None]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials)

    special_map = {name: value for name, value in (
        ("bos_token", bos), ("eos_token", eos), ("pad_token", token("padding")),
        ("unk_token", token("unknown"))) if value is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(src.get(f"{src.get('general.architecture')}.context_length",
                                        2048)),
    }
    template = src.get("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return tokenizer, config, special_map


def _sentencepiece_bpe(src: GgufFile) -> Any:
    """Gemma 3's SentencePiece BPE vocabulary as a ``tokenizers.Tokenizer`` (no post-processor).

    Spaces are ``▁`` (no prefix space); every split of a piece into two pieces is a merge, ranked
    by the piece's position in the file, the longer left part first; ``<0xNN>`` pieces decode to
    bytes.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    if src.get("tokenizer.ggml.add_space_prefix", False):
        raise ValueError(f"{src.path}: tokenizer.ggml.add_space_prefix=true is not supported for "
                         "a SentencePiece vocabulary; supported: false (Gemma)")
    if src.get("tokenizer.ggml.merges", None) is not None:
        raise ValueError(f"{src.path}: a SentencePiece vocabulary with tokenizer.ggml.merges is "
                         "not supported; supported: Gemma 3's, whose merges are derived")
    tokens: list[str] = src.get("tokenizer.ggml.tokens")
    types: list[int] = src.get("tokenizer.ggml.token_type")
    if len(types) != len(tokens):
        raise ValueError(f"{src.path}: {len(types)} token types for {len(tokens)} tokens")
    unk = src.get("tokenizer.ggml.unknown_token_id", None)
    if unk is None or not 0 <= unk < len(tokens):
        raise ValueError(f"{src.path}: tokenizer.ggml.unknown_token_id is {unk!r}; a "
                         "SentencePiece vocabulary needs its unknown token")
    # SentencePiece writes a space as "▁"; llama.cpp stored the pieces made only of spaces
    # ("  ", user-defined) with real spaces: spell them as the normalized text will look.
    pieces = ["▁" * len(t) if t and not t.strip(" ") and k != _CONTROL else t
              for t, k in zip(tokens, types)]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise ValueError(f"{src.path}: the SentencePiece vocabulary spells some pieces twice")
    merges = []
    for piece in pieces:  # in rank order: the file's
        for cut in range(len(piece) - 1, 0, -1):  # the longer left part first
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk],
                                     fuse_unk=True, byte_fallback=True))
    # No pre-tokenizer: SentencePiece merges across the whole text, spaces included.
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types) if k == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, p, k in zip(tokens, pieces, types)
                          if k == _USER_DEFINED and t == p])
    return tokenizer


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable spelling of the bytes 0..255, in byte order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return [spelling[b] for b in range(256)]
