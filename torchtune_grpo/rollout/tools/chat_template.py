"""The chat template's own tool-call format (``tool_syntax: {format: chat_template}``,
:class:`ChatTemplateToolSyntax`) and the tools' JSON schemas (:func:`tool_schema`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchtune_grpo.rollout.tools.base import ERROR_PREFIX, Tool, run_tool

__all__ = [
    "CHAT_TEMPLATE_FORMAT",
    "ChatTemplateToolSyntax",
    "JsonToolCall",
    "call_tool_json",
    "tool_argument",
    "tool_schema",
]

#: ``tool_syntax.format`` value of the chat template's format.
CHAT_TEMPLATE_FORMAT = "chat_template"

#: The tool-message content the template check renders (it must appear in the rendering).
_PROBE_RESULT = "tool-result-probe-7321"


def tool_argument(tool: Tool) -> str:
    """The JSON argument a tool reads: its ``argument`` attribute, else ``"input"``."""
    value = getattr(tool, "argument", None)
    return value if isinstance(value, str) and value else "input"


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of a tool, as chat templates take it in ``tools=[...]``.

    ``{"type": "function", "function": {"name", "description", "parameters"}}`` with one
    required string parameter, :func:`tool_argument`; the description is the tool's
    ``description`` attribute, or the first line of its class docstring.
    """
    description = getattr(tool, "description", None)
    if not isinstance(description, str) or not description:
        doc = (type(tool).__doc__ or "").strip()
        description = doc.splitlines()[0] if doc else f"The {tool.name} tool."
    argument = tool_argument(tool)
    argument_description = getattr(tool, "argument_description", None)
    if not isinstance(argument_description, str) or not argument_description:
        argument_description = f"the text the {tool.name} tool reads"
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {argument: {"type": "string",
                                          "description": argument_description}},
                "required": [argument],
            },
        },
    }


def call_tool_json(tool: Tool, arguments: Any) -> str:
    """Run ``tool`` on a JSON call's ``arguments`` object (its :func:`tool_argument` value, a
    number written out); never raises.

    Returns:
        The tool's result, or ``"error: <why>"`` for arguments that are not an object, miss the
        argument, have others, or whose value is not a string or number.
    """
    argument = tool_argument(tool)
    usage = f'call {tool.name} with {{"{argument}": "..."}}'
    if not isinstance(arguments, Mapping):
        return f"{ERROR_PREFIX} the arguments must be a JSON object ({usage})"
    if argument not in arguments:
        return f"{ERROR_PREFIX} missing argument {argument!r} ({usage})"
    extra = sorted(str(k) for k in arguments if k != argument)
    if extra:
        return f"{ERROR_PREFIX} unexpected argument(s) {extra[:5]} ({usage})"
    value = arguments[argument]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return f"{ERROR_PREFIX} argument {argument!r} must be a string ({usage})"
    return run_tool(tool, value if isinstance(value, str) else json.dumps(value))


@dataclass(frozen=True)
class JsonToolCall:
    """A completed call in the chat-template format.

    Attributes:
        name (str | None): the ``"name"`` the model wrote (None: none could be read).
        arguments (Any): the ``"arguments"`` object (a JSON string holding one is decoded).
        error (str | None): why the call cannot run (``error: ...``), or None.
        end (int): index in the searched text just past the close tag.
    """

    name: str | None
    arguments: Any
    error: str | None
    end: int


@dataclass(frozen=True)
class ChatTemplateToolSyntax:
    """Tool calls in the chat template's own format (Hermes / Qwen 2.5 style)::

        <tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>

    A call that is not such a JSON object, or names no tool, gets an ``error: ...`` result. The
    result is appended as the chat template renders it after the call (:meth:`result_text`).

    Args:
        format (str): ``"chat_template"`` (what selects this class in a config).
        call_open (str): the text that opens a call (default ``<tool_call>``).
        call_close (str): the text that closes it (default ``</tool_call>``); the chat
            template must write an assistant message's ``tool_calls`` ending with it.

    Raises:
        ValueError: another ``format``, or an empty tag.
    """

    format: str = CHAT_TEMPLATE_FORMAT
    call_open: str = "<tool_call>"
    call_close: str = "</tool_call>"

    def __post_init__(self) -> None:
        if self.format != CHAT_TEMPLATE_FORMAT:
            raise ValueError(f"ChatTemplateToolSyntax.format must be {CHAT_TEMPLATE_FORMAT!r}, "
                             f"got {self.format!r}")
        for key in ("call_open", "call_close"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"ChatTemplateToolSyntax.{key} must be a non-empty string, "
                                 f"got {value!r}")

    # -- the interface ToolUseGenerator shares with ToolCallSyntax
    def open_tag(self, name: str = "") -> str:
        """The text that opens a call (the same for every tool)."""
        return self.call_open

    def close_tag(self, name: str = "") -> str:
        """The text that closes a call (the same for every tool)."""
        return self.call_close

    def count_closes(self, text: str, names: Sequence[str] = ()) -> int:
        """How many close tags occur in ``text``."""
        return text.count(self.call_close)

    def final_characters(self, names: Sequence[str] = ()) -> set[str]:
        """The close tag's last character: a turn can only end on a token holding it."""
        return {self.call_close[-1]}

    def may_complete(self, token_text: str) -> bool:
        """Whether a token with this text can complete the close tag.

        It holds the whole tag or starts with a proper suffix of it (with a non-ASCII tag, also any
        token holding U+FFFD).
        """
        close = self.call_close
        if close in token_text:
            return True
        if not close.isascii() and "\ufffd" in token_text:
            return True
        return any(token_text.startswith(close[-k:]) for k in range(1, len(close)))

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """The text of a call, e.g. ``<tool_call>{"name": "calculator", "arguments":
        {"expression": "12*7"}}</tool_call>``."""
        body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
        return f"{self.call_open}{body}{self.call_close}"

    # -- parsing
    def last_call(self, text: str, names: Sequence[str]) -> JsonToolCall | None:
        """The call whose close tag ends last in ``text`` (None: no close tag).

        The body (after the previous close tag's nearest open tag) must be a JSON object
        ``{"name": <one of names>, "arguments": {...}}`` (``arguments`` may be a JSON string or left
        out); otherwise the call's ``error`` says why.

        Args:
            text: decoded completion text (model and tool tokens).
            names: the tools' names.
        """
        start = text.rfind(self.call_close)
        if start < 0:
            return None
        end = start + len(self.call_close)
        previous = text.rfind(self.call_close, 0, start)
        floor = 0 if previous < 0 else previous + len(self.call_close)
        at = text.rfind(self.call_open, floor, start)
        if at < 0:
            return JsonToolCall(None, None, f"{ERROR_PREFIX} {self.call_close} without "
                                f"{self.call_open}", end)
        body = text[at + len(self.call_open): start].strip()
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
            return JsonToolCall(None, None, f"{ERROR_PREFIX} the tool call is not valid JSON "
                                f"({why}); write {self._shape(names)}", end)
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return JsonToolCall(None, None, f"{ERROR_PREFIX} the tool call must be a JSON "
                                f"object {self._shape(names)}", end)
        name = data["name"]
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                pass
        if name not in names:
            known = ", ".join(names) if names else "none"
            return JsonToolCall(name, arguments, f"{ERROR_PREFIX} unknown tool {name[:80]!r} "
                                f"(tools: {known})", end)
        return JsonToolCall(name, arguments, None, end)

    @staticmethod
    def _shape(names: Sequence[str]) -> str:
        name = names[0] if names else "..."
        return f'{{"name": "{name}", "arguments": {{...}}}}'

    # -- rendering
    @staticmethod
    def _conversation(name: str, arguments: Any) -> list[dict[str, Any]]:
        call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        return [{"role": "user", "content": "?"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]

    def _render(self, tokenizer: Any, name: str, arguments: Any, result: str,
                tools: list[dict[str, Any]] | None) -> str:
        """The rendered text after the call's close tag (may raise; see :meth:`result_text`)."""
        conversation = self._conversation(name, arguments)
        before = tokenizer.apply_chat_template(conversation, add_generation_prompt=False,
                                               tools=tools)
        after = tokenizer.apply_chat_template(
            [*conversation, {"role": "tool", "name": name, "content": result}],
            add_generation_prompt=True, tools=tools)
        if not after.startswith(before):
            raise ValueError("the rendering of a conversation that ends with a tool message "
                             "does not start with the rendering of the same conversation "
                             "without it")
        cut = before.rfind(self.call_close)
        if cut < 0:
            raise ValueError(f"an assistant message's tool_calls are not written as "
                             f"{self.call_open}...{self.call_close}")
        return after[cut + len(self.call_close):]

    def result_text(self, tokenizer: Any, name: str | None, arguments: Any, result: str,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The text appended after a call: what the chat template renders after it.

        The difference between rendering ``[user, assistant(tool_calls=[call])]`` and the same plus
        the tool message with ``add_generation_prompt=True``, from the call's close tag on. An
        unreadable call (``name`` None) or one the template rejects is rendered as a call of the
        first tool with ``{}`` arguments.

        Args:
            tokenizer: a tokenizer with ``apply_chat_template(messages, add_generation_prompt,
                tools)``.
            name: the called tool's name (None: unreadable call).
            arguments: the call's arguments.
            result: the tool's result text.
            tools: the tools' JSON schemas (as the prompt was rendered with).

        Raises:
            ValueError: the fallback rendering fails too.
        """
        fallback = tools[0]["function"]["name"] if tools else "tool"
        if name is not None and isinstance(arguments, Mapping):
            try:
                return self._render(tokenizer, name, dict(arguments), result, tools)
            except Exception:  # noqa: BLE001 - a template that rejects this call: fallback
                pass
        return self._render(tokenizer, name if name is not None else fallback, {}, result, tools)

    def check_tokenizer(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None,
                        key: str = "tool_syntax.format") -> None:
        """Check that ``tokenizer``'s chat template renders an assistant tool call ending with
        :attr:`call_close` and a tool message after it.

        Raises:
            ValueError: naming ``key`` and what is missing.
        """
        where = f"config key {key!r} is {CHAT_TEMPLATE_FORMAT!r}"
        if not callable(getattr(tokenizer, "apply_chat_template", None)) or (
                hasattr(tokenizer, "chat_template") and tokenizer.chat_template is None):
            raise ValueError(
                f"{where}, but the tokenizer ({type(tokenizer).__name__}) has no chat template: "
                "use torchtune_grpo.models.hf_tokenizer on a model folder whose tokenizer has "
                "a chat template (or give one: tokenizer.chat_template=...), or the default "
                "tag format (remove tool_syntax.format)")
        name = tools[0]["function"]["name"] if tools else "tool"
        try:
            text = self._render(tokenizer, name, {"input": "1"}, _PROBE_RESULT, tools)
        except Exception as exc:  # noqa: BLE001 - re-raised with the key named
            raise ValueError(
                f"{where}, but the tokenizer's chat template cannot render a tool call and its "
                f"result: {exc}. The format needs a template that writes an assistant "
                f"message's tool_calls as {self.call_open}{{json}}{self.call_close} and renders "
                '{"role": "tool"} messages') from exc
        if _PROBE_RESULT not in text:
            raise ValueError(
                f"{where}, but the tokenizer's chat template does not render tool messages (the "
                'content of a {"role": "tool"} message is missing from its rendering): use a '
                "template with tool support, or the default tag format")
