"""Chat templates of Hugging Face model folders: finding, compiling and rendering them in the
sandboxed jinja environment ``transformers`` uses, and which message each token belongs to.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import meta, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from torchtune_grpo.errors import DataError

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "compile_chat_template",
    "find_chat_template",
    "mask_by_message",
    "message_boundaries",
    "missing_template_error",
    "render_chat_template",
    "template_uses_tools",
]

#: The file of a model folder that holds its chat template (preferred over the tokenizer config).
CHAT_TEMPLATE_FILE = "chat_template.jinja"


# ---------------------------------------------------------------------------- jinja environment
def _raise_exception(message: str) -> None:
    """Template global ``raise_exception(msg)``: templates reject invalid conversations."""
    raise ValueError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    """Template global ``strftime_now(fmt)``: the current local time formatted with ``fmt``."""
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Template filter ``tojson``: JSON that keeps non-ASCII characters (no HTML escaping)."""
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        """Parse the block and return its body as is."""
        next(parser.stream)  # the `generation` name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed jinja environment chat templates are written for."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# ---------------------------------------------------------------------------- finding a template
def _template_from_config(value: Any, where: Path) -> tuple[str | None, list[str]]:
    """The default chat template of ``tokenizer_config.json["chat_template"]``.

    Returns:
        ``(template or None, names of the named templates)``.
    """
    if value is None:
        return None, []
    if isinstance(value, str):
        return value, []
    if isinstance(value, list):
        named = {
            item["name"]: item["template"]
            for item in value
            if isinstance(item, Mapping)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("template"), str)
        }
        return named.get("default"), sorted(named)
    raise ValueError(
        f"{where}: `chat_template` must be a string or a list of {{name, template}} objects, "
        f"got {type(value).__name__}"
    )


def _template_argument(value: str) -> tuple[str, str]:
    """``(template, source)`` of the ``chat_template`` argument (text or file path)."""
    if not isinstance(value, str):
        raise ValueError(f"chat_template must be a string, got {type(value).__name__}")
    if "{{" not in value and "{%" not in value:
        candidate = Path(value).expanduser()
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8"), str(candidate)
    return value, "chat_template argument"


def find_chat_template(
    folder: Path,
    config_template: Any,
    config_path: Path,
    chat_template: str | None = None,
) -> tuple[str | None, str | None, list[str]]:
    """The chat template of a model folder, and where it came from.

    In order of preference: ``chat_template`` (jinja text or a file path), the folder's
    :data:`CHAT_TEMPLATE_FILE`, the tokenizer config's ``chat_template`` (a string, or a list of
    ``{name, template}`` objects whose ``"default"`` is taken).

    Args:
        folder: the model folder.
        config_template: the tokenizer config's ``chat_template`` value, or ``None``.
        config_path: the tokenizer config's path (for the source and error messages).
        chat_template: an explicit template that replaces the folder's, or ``None``.

    Returns:
        ``(template, source, named)``: the template source or ``None``, where it came from (a
        file path or ``"chat_template argument"``; ``None`` without a template) and the names of
        the tokenizer config's named templates.

    Raises:
        ValueError: when ``chat_template`` is not a string, or the config's ``chat_template``
            is neither a string nor a list.
    """
    source: str | None = None
    named: list[str] = []
    if chat_template is not None:
        template, source = _template_argument(chat_template)
    elif (folder / CHAT_TEMPLATE_FILE).is_file():
        template = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        source = str(folder / CHAT_TEMPLATE_FILE)
    else:
        template, named = _template_from_config(config_template, config_path)
        source = str(config_path) if template is not None else None
    return template, source, named


def missing_template_error(folder: Path, config_name: str, named: Sequence[str]) -> DataError:
    """The user error for a folder without chat template, saying how to supply one.

    Args:
        folder: the model folder.
        config_name: the file name of its tokenizer config.
        named: the names of the tokenizer config's named templates (none is ``"default"``).

    Returns:
        The :class:`~torchtune_grpo.errors.DataError` to raise.
    """
    hint = (
        f" Its tokenizer_config.json has only named templates {named} and no 'default'."
        if named
        else ""
    )
    return DataError(
        f"{folder} has no chat template (no {CHAT_TEMPLATE_FILE}, no `chat_template` "
        f"in {config_name}), so prompts cannot use the chat format (a base model has none).{hint}"
        " Use a plain-text prompt template: `chat: false` in the dataset's `template`, e.g. "
        "'dataset.template={user: \"Question: {question} Answer:\", chat: false}' (and "
        "eval_dataset.template) on the command line; or pass a chat template: "
        "`tokenizer.chat_template=...` in YAML, `hf_tokenizer(path, chat_template=...)` in "
        "Python (the jinja text or a .jinja file path)."
    )


def compile_chat_template(template: str | None, source: str | None) -> jinja2.Template | None:
    """Compile a chat template in the sandboxed environment templates are written for.

    Args:
        template: the jinja source, or ``None``.
        source: where it came from, for the error message.

    Returns:
        The compiled template, ``None`` for ``template=None``.

    Raises:
        ValueError: when the template does not compile (naming ``source`` and the line).
    """
    if template is None:
        return None
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(
            f"the chat template from {source} does not compile: {exc.message} "
            f"(template line {exc.lineno})"
        ) from exc


def template_uses_tools(template: str | None) -> bool:
    """Whether a chat template (jinja source, or ``None``: False) reads the ``tools`` variable."""
    if template is None:
        return False
    env = _environment()
    return "tools" in meta.find_undeclared_variables(env.parse(template))


# ---------------------------------------------------------------------------- rendering
def render_chat_template(
    template: jinja2.Template,
    messages: Sequence[Mapping[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
) -> str:
    """Render a compiled chat template for a conversation.

    Args:
        template: the compiled template (:func:`compile_chat_template`).
        messages: ``{"role": ..., "content": ...}`` dicts (copied before rendering).
        tools: tool definitions (JSON-schema dicts), or ``None``.
        add_generation_prompt: end with the header of a new assistant turn.
        variables: further template variables (special-token strings, ``enable_thinking``...).

    Returns:
        The rendered text.

    Raises:
        ValueError: when the template rejects the conversation (``raise_exception``).
    """
    return template.render(
        messages=[dict(m) for m in messages],
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )


def message_boundaries(
    dicts: list[dict[str, Any]], text: str, render_prefix: Callable[[list[dict[str, Any]]], str]
) -> list[int]:
    """Character offsets ``b_0 = 0 <= b_1 <= ... <= b_n = len(text)`` of a rendered conversation.

    Message ``i`` owns ``text[b_i:b_{i+1}]``. ``b_k`` is the length of the first ``k`` messages
    rendered, when that is a prefix of ``text``; otherwise the end of message ``k - 1``'s content,
    found by searching (closing tokens then go to the next message).

    Args:
        dicts: the ``n`` messages as ``{"role": ..., "content": ...}`` dicts.
        text: the text rendered for the whole conversation.
        render_prefix: renders the first ``k`` messages without generation prompt (an exception
            selects the search).

    Returns:
        The ``n + 1`` offsets.
    """
    n = len(dicts)
    bounds = [0]
    try:
        for k in range(1, n):
            prefix = render_prefix(dicts[:k])
            if not text.startswith(prefix) or len(prefix) < bounds[-1]:
                raise ValueError("not a prefix")
            bounds.append(len(prefix))
        return [*bounds, len(text)]
    except Exception:  # any template failure on a partial conversation: approximate
        pass
    bounds, cursor = [0], 0
    for content in (str(d.get("content") or "") for d in dicts[:-1]):
        found = text.find(content, cursor) if content else -1
        if found >= 0:
            cursor = found + len(content)
        bounds.append(cursor)
    return [*bounds, len(text)]


def mask_by_message(
    offsets: Iterable[tuple[int, int]], bounds: Sequence[int], masked: Sequence[bool]
) -> list[bool]:
    """The mask value of each token: that of the message holding the token's last character.

    Args:
        offsets: ``(start, end)`` character offsets of the tokens in the rendered text, in order.
        bounds: the messages' boundaries (:func:`message_boundaries`).
        masked: whether each message is masked.

    Returns:
        One bool per token.
    """
    mask, owner = [], 0
    for _, end in offsets:
        last_char = max(end - 1, 0)  # ByteLevel may trim a token's offsets to (e, e)
        while owner < len(masked) - 1 and last_char >= bounds[owner + 1]:
            owner += 1
        mask.append(masked[owner])
    return mask
