"""A torchtune-style tokenizer read from a Hugging Face model folder, with its own chat template.

:class:`HFTokenizer` encodes with ``tokenizers`` and renders the folder's jinja chat template
as ``transformers``' ``apply_chat_template(..., tokenize=True)`` does, so prompts get the ids
the model was fine-tuned on, whatever its chat format.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer
from torchtune.data import Message

from torchtune_grpo.errors import CheckpointError, UserError
from torchtune_grpo.models.chat_template import (
    compile_chat_template,
    find_chat_template,
    mask_by_message,
    message_boundaries,
    missing_template_error,
    render_chat_template,
    template_uses_tools,
)

__all__ = ["HFTokenizer", "hf_tokenizer"]

#: Files read from a model folder besides ``tokenizer.json`` (all optional).
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"

#: What to do about a damaged tokenizer file.
RESTORE_HINT = "copy it from an intact copy of the model, or download the model again"

#: The special-token names read from the tokenizer config and passed to chat templates.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


# ---------------------------------------------------------------------------- folder reading
def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file's content, ``None`` if the file does not exist."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}): the file is truncated or "
                              f"damaged; {RESTORE_HINT}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}; "
                              f"{RESTORE_HINT}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as written in a tokenizer config: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _resolve_paths(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``(tokenizer.json path, folder)`` for a folder or a ``tokenizer.json`` path."""
    given = Path(path).expanduser()
    if given.is_file():
        return given, given.parent
    candidate = given / "tokenizer.json"
    if given.is_dir() and candidate.is_file():
        return candidate, given
    if given.is_dir():
        hint = ""
        if (given / "tokenizer.model").is_file():
            hint = (
                " It has a tokenizer.model (SentencePiece/tiktoken) only; write the fast-tokenizer "
                "file with transformers: AutoTokenizer.from_pretrained(folder)"
                ".save_pretrained(folder)."
            )
        raise FileNotFoundError(
            f"no tokenizer.json in {given}: `path` must be a Hugging Face model folder that "
            "holds tokenizer.json (the `tokenizers` fast-tokenizer file), or the path of that "
            f"file.{hint}")
    raise FileNotFoundError(
        f"{given} does not exist: `path` must be a Hugging Face model folder that holds "
        "tokenizer.json, or the path of a tokenizer.json file")


# ---------------------------------------------------------------------------- the tokenizer

class ConfigKeyError(UserError, ValueError):
    """A tokenizer setting the model folder cannot honour (one line naming the key)."""

class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` plus the folder's chat template, as a torchtune tokenizer.

    ``add_bos=True`` in :meth:`encode` adds ``bos_id`` only when the model adds a BOS to plain text
    (``add_bos_token``, else the post-processor's behaviour); chat formatting is entirely the
    template's; ``pad_id`` is ``eos_id`` when the folder has no ``pad_token``.

    Args:
        path: a model folder holding ``tokenizer.json`` (and optionally
            ``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja``,
            ``generation_config.json``), or the path of a ``tokenizer.json`` file.
        max_seq_len: truncate :meth:`tokenize_messages` output to this many tokens (``None``:
            never).
        chat_template: a jinja chat template that replaces the folder's, or the path of a file
            holding one.
        enable_thinking: passed to the chat template as ``enable_thinking`` (Qwen3's and
            SmolLM3's switch); ``None``: not passed. Set for a template that does not read it
            (a family without a thinking mode), it is a config error.
        stop_strings: texts that also end a completion: every token whose text contains one of
            them is a stop token.

    Raises:
        FileNotFoundError: when there is no ``tokenizer.json`` at ``path``.
        CheckpointError: (a ``ValueError``) a tokenizer file that does not parse (truncated or
            damaged), naming it.
        ValueError: a template that does not compile, or a folder without an EOS token.

    Attributes:
        path: the folder the files were read from.
        max_seq_len: the truncation length of :meth:`tokenize_messages`, or ``None``.
        chat_template: the jinja template source, or ``None``.
        chat_template_source: a file path or ``"chat_template argument"``; ``None`` without one.
        bos_token, eos_token, pad_token, unk_token: the token strings (``None`` when absent;
            ``eos_token`` always set).
        bos_id: the BOS token id, or ``None``.
        eos_id: the EOS token id.
        pad_id: the padding token id (``eos_id`` without a padding token).
        add_bos_token: whether :meth:`encode` with ``add_bos=True`` adds ``bos_id``.
        special_tokens: ``{token: id}`` of every added token marked special.
        stop_tokens: sorted unique ids that end a completion: ``eos_id``,
            ``generation_config.json["eos_token_id"]`` and the ids of ``stop_strings``.
        vocab_size: number of token ids, added tokens included.
        tools: tool definitions passed to the chat template as ``tools`` (set with
            :meth:`set_tools`), or ``None``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_seq_len: int | None = None,
        chat_template: str | None = None,
        enable_thinking: bool | None = None,
        stop_strings: Sequence[str] | None = None,
    ) -> None:
        if max_seq_len is not None and (
            isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0
        ):
            raise ValueError(f"max_seq_len must be a positive integer or None, got {max_seq_len!r}")
        tokenizer_file, folder = _resolve_paths(path)
        self.path: Path = folder
        self.max_seq_len: int | None = max_seq_len
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises its own Exception type
            raise CheckpointError(
                f"{tokenizer_file} could not be read by `tokenizers` ({exc}): it must be a "
                f"whole Hugging Face fast-tokenizer file; {RESTORE_HINT}"
            ) from None
        # a tokenizer.json may carry truncation/padding settings; never apply them silently
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()

        config = _read_json(folder / TOKENIZER_CONFIG) or {}
        special_map = _read_json(folder / SPECIAL_TOKENS_MAP) or {}
        generation = _read_json(folder / GENERATION_CONFIG) or {}

        tokens: dict[str, str | None] = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = config[name] if name in config else special_map.get(name)
            tokens[name] = _token_content(value)
        self.bos_token: str | None = tokens["bos_token"]
        self.eos_token: str | None = tokens["eos_token"]
        self.pad_token: str | None = tokens["pad_token"]
        self.unk_token: str | None = tokens["unk_token"]

        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self._valid_ids = frozenset(vocab.values())
        added = self._tokenizer.get_added_tokens_decoder()
        self.special_tokens: dict[str, int] = {
            tok.content: int(i) for i, tok in sorted(added.items()) if tok.special
        }
        special_ids = set(self.special_tokens.values())
        self._ordinary_ids = sorted(i for i in self._valid_ids if i not in special_ids)

        self.bos_id: int | None = self._id_of(self.bos_token)
        gen_eos = generation.get("eos_token_id")
        gen_eos_ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        eos_id = self._id_of(self.eos_token)
        if eos_id is None and self.eos_token is not None:
            raise ValueError(
                f"{folder / TOKENIZER_CONFIG}: eos_token {self.eos_token!r} is not in the "
                "vocabulary of tokenizer.json; fix `eos_token`"
            )
        if eos_id is None and gen_eos_ids:
            eos_id = int(gen_eos_ids[0])
        if eos_id is None:
            raise ValueError(
                f"{folder} names no EOS token: set `eos_token` in {TOKENIZER_CONFIG} (or "
                f"`eos_token_id` in {GENERATION_CONFIG})"
            )
        self.eos_id: int = eos_id
        pad_id = self._id_of(self.pad_token)
        self.pad_id: int = self.eos_id if pad_id is None else pad_id
        self.stop_tokens: list[int] = sorted({self.eos_id, *(int(i) for i in gen_eos_ids),
                                              *self._stop_ids(stop_strings or ())})

        flag = config.get("add_bos_token")
        if isinstance(flag, bool):
            self.add_bos_token: bool = flag and self.bos_id is not None
        else:
            self.add_bos_token = self._post_processor_adds_bos()

        template, source, named = find_chat_template(
            folder, config.get("chat_template"), folder / TOKENIZER_CONFIG, chat_template
        )
        self.tools: list[dict[str, Any]] | None = None
        self.chat_template: str | None = template
        self.chat_template_source: str | None = source
        self._named_templates = named
        self._compiled: jinja2.Template | None = compile_chat_template(template, source)
        if enable_thinking is not None and "enable_thinking" not in (template or ""):
            raise ConfigKeyError(
                f"tokenizer.enable_thinking: the chat template of {folder} "
                f"({source or 'none'}) does not read enable_thinking (this family has no "
                "thinking mode): remove the key, and think_tag from the rewards (a config "
                "written for Qwen3 or SmolLM3?)")
        #: variables every rendering gets (``enable_thinking``); ``apply_chat_template``'s
        #: keyword arguments override them
        self.template_variables: dict[str, Any] = (
            {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)})

    # ------------------------------------------------------------------ helpers
    def _id_of(self, token: str | None) -> int | None:
        """Id of a token string, ``None`` for ``None`` or a token not in the vocabulary."""
        if token is None:
            return None
        token_id = self._tokenizer.token_to_id(token)
        return None if token_id is None else int(token_id)

    def _stop_ids(self, texts: Sequence[str]) -> list[int]:
        """Every token id whose text contains one of ``texts`` (``ValueError``: none does)."""
        if not texts:
            return []
        ids = sorted(self._valid_ids)
        decoded = self._tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
        out = []
        for text in map(str, texts):
            found = [i for i, d in zip(ids, decoded) if text and text in d]
            if not found:
                raise ValueError(f"tokenizer.stop_strings: no token of {self.path} contains "
                                 f"{text!r}; a stop string must fit in one token")
            out.extend(found)
        return out

    def _post_processor_adds_bos(self) -> bool:
        """Whether ``tokenizer.json``'s post-processor puts ``bos_id`` in front of a text."""
        if self.bos_id is None:
            return False
        with_special = self._tokenizer.encode("a", add_special_tokens=True).ids
        plain = self._tokenizer.encode("a", add_special_tokens=False).ids
        return (len(with_special) > len(plain) and with_special[0] == self.bos_id
                and plain[:1] != [self.bos_id])

    def _require_template(self) -> jinja2.Template:
        """The compiled chat template, or a ``ValueError`` saying how to supply one."""
        if self._compiled is None:
            raise missing_template_error(self.path, TOKENIZER_CONFIG, self._named_templates)
        return self._compiled

    # ------------------------------------------------------------------ plain text
    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Token ids of a plain text (special-token strings in it become those tokens).

        Args:
            text: the text.
            add_bos: prepend ``bos_id`` if the model adds a BOS token to texts.
            add_eos: append ``eos_id``.
        """
        ids = list(self._tokenizer.encode(text, add_special_tokens=False).ids)
        if add_bos and self.add_bos_token and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids; ids the tokenizer does not define are dropped, never raised on.

        Args:
            token_ids: the ids (ints, or anything ``int()`` accepts).
            skip_special_tokens: leave special added tokens out of the text.

        Returns:
            The text.
        """
        valid = self._valid_ids
        ids = [int(i) for i in token_ids]
        return self._tokenizer.decode([i for i in ids if i in valid],
                                      skip_special_tokens=skip_special_tokens)

    def ordinary_token_ids(self) -> list[int]:
        """Every id that is not a special added token, sorted (non-special added ones included)."""
        return list(self._ordinary_ids)

    # ------------------------------------------------------------------ chat
    def set_tools(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        """Tool definitions to render every conversation of :meth:`tokenize_messages` with.

        Args:
            tools: JSON-schema dicts (``{"type": "function", "function": {...}}``), or
                ``None``/empty for none.
        """
        self.tools = [dict(t) for t in tools] if tools else None

    @property
    def template_uses_tools(self) -> bool:
        """Whether the chat template reads the ``tools`` variable (False without a template)."""
        return template_uses_tools(self.chat_template)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the chat template.

        The template also sees the special-token strings and ``template_variables``; ``kwargs``
        override them.

        Args:
            messages: ``{"role": ..., "content": ...}`` dicts.
            add_generation_prompt: end with the header of a new assistant turn.
            tools: tool definitions (JSON-schema dicts) for templates that support them.
            **kwargs: extra template variables (e.g. ``enable_thinking``).

        Returns:
            The rendered text.

        Raises:
            ValueError: when the folder has no chat template, or the template rejects the
                conversation (``raise_exception``).
        """
        template = self._require_template()
        variables: dict[str, Any] = {name: getattr(self, name) for name in SPECIAL_TOKEN_NAMES
                                     if getattr(self, name) is not None}
        variables.update(self.template_variables, **kwargs)
        return render_chat_template(template, messages, tools, add_generation_prompt, variables)

    def tokenize_messages(
        self, messages: Sequence[Message], add_end_tokens: bool = True
    ) -> tuple[list[int], list[bool]]:
        """Token ids and loss mask of a conversation, formatted by the chat template.

        A last assistant message with ``eot=False`` (or any last message with
        ``add_end_tokens=False``) leaves the ids inside an open assistant turn, after the generation
        prompt. A token belongs to the message whose text holds its last character; the mask is True
        on the tokens of masked messages. Beyond ``max_seq_len`` the ids are cut and, for a closed
        conversation, the last kept token becomes ``eos_id``.

        Args:
            messages: torchtune messages.
            add_end_tokens: ``False`` leaves the conversation open for generation.

        Returns:
            ``(tokens, mask)``, two lists of the same length.

        Raises:
            ValueError: on no messages, a folder without chat template, or a conversation the
                template rejects.
        """
        if not messages:
            raise ValueError("tokenize_messages: got no messages")
        self._require_template()
        dicts = [{"role": m.role, "content": m.text_content} for m in messages]
        last = messages[-1]
        open_turn = last.role == "assistant" and (not last.eot or not add_end_tokens)
        if open_turn:
            text = self.apply_chat_template(dicts[:-1], add_generation_prompt=True,
                                            tools=self.tools)
            text += last.text_content
        else:
            text = self.apply_chat_template(dicts, add_generation_prompt=not add_end_tokens,
                                            tools=self.tools)
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        tokens = list(encoding.ids)

        masked = [bool(m.masked) for m in messages]
        if all(masked) or not any(masked):
            mask = [masked[0]] * len(tokens)
        else:
            render_prefix = functools.partial(self.apply_chat_template,
                                              add_generation_prompt=False, tools=self.tools)
            bounds = message_boundaries(dicts, text, render_prefix)
            mask = mask_by_message(encoding.offsets, bounds, masked)

        if self.max_seq_len is not None and len(tokens) > self.max_seq_len:
            tokens, mask = tokens[: self.max_seq_len], mask[: self.max_seq_len]
            if add_end_tokens and not open_turn:
                tokens[-1], mask[-1] = self.eos_id, True
        return tokens, mask

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> dict[str, Any]:
        """torchtune transform: tokenize ``sample["messages"]`` into ``tokens`` and ``mask``.

        Args:
            sample: a mapping with a ``"messages"`` list of :class:`~torchtune.data.Message`.
            inference: leave the conversation open for generation (``add_end_tokens=False``).

        Returns:
            A copy of ``sample`` without ``"messages"``, with ``"tokens"`` and ``"mask"``.
        """
        out = dict(sample)
        messages = out.pop("messages")
        out["tokens"], out["mask"] = self.tokenize_messages(
            messages, add_end_tokens=not inference
        )
        return out

    def __repr__(self) -> str:
        """A short description: folder, vocabulary size and special ids."""
        return (
            f"HFTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )


def hf_tokenizer(path: str, max_seq_len: int | None = None, chat_template: str | None = None,
                 enable_thinking: bool | None = None,
                 stop_strings: Sequence[str] | None = None) -> HFTokenizer:
    """Builder for configs: the :class:`HFTokenizer` of a Hugging Face model folder (same keyword
    arguments).
    """
    return HFTokenizer(path, max_seq_len=max_seq_len, chat_template=chat_template,
                       enable_thinking=enable_thinking, stop_strings=stop_strings)
