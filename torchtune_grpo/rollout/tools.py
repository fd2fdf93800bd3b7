"""Tools a policy may call inside a rollout, the call syntax, and a safe calculator.

A **tool** is any object with a ``name`` (str) and ``__call__(arguments: str) -> str``: it
receives the text the model wrote between the call tags and returns the text appended to the
sequence as the tool's result. Tools are built from the config's ``tools:`` list with
torchtune's ``config.instantiate`` (:func:`build_tools`), so a user's own tool plugs in by its
``_component_`` path with no code change::

    tools:
      - _component_: torchtune_grpo.rollout.tools.Calculator
        max_digits: 30
      - _component_: my_package.tools.WordCount

**Failures are text, never exceptions.** Whatever the model writes, a tool returns a string;
the rollout loop (:mod:`torchtune_grpo.rollout.multiturn`) also catches anything a user tool
raises and turns it into ``error: ...``. A result that starts with ``error:`` is counted as a
tool error (the ``tools/errors`` metric).

**The call syntax** (:class:`ToolCallSyntax`): by default ``<calculator>12*7</calculator>``,
answered by ``<result>84</result>``; the tags are templates in which ``{name}`` is the tool's
name, so each tool has its own tags.

**The chat-template format** (:class:`ChatTemplateToolSyntax`, ``tool_syntax: {format:
chat_template}``): the model calls a tool the way tool-calling chat models do (Hermes / Qwen 2.5
style), ``<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>``,
and the result is appended as the tokenizer's own chat template renders a ``{"role": "tool"}``
message (end of the assistant turn, the tool message, a new assistant header). A tool takes
its text from one JSON argument, its ``argument`` attribute (``"input"`` when it has none; the
calculator's is ``"expression"``); :func:`tool_schema` is the JSON schema the prompt's template
is given.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "CHAT_TEMPLATE_FORMAT",
    "TAGS_FORMAT",
    "Calculator",
    "ChatTemplateToolSyntax",
    "JsonToolCall",
    "Tool",
    "ToolCall",
    "ToolCallSyntax",
    "build_tools",
    "call_tool_json",
    "is_error",
    "make_tool_syntax",
    "run_tool",
    "tool_argument",
    "tool_schema",
]

#: Prefix of a result that reports a failure (counted by the ``tools/errors`` metric).
ERROR_PREFIX = "error:"


@runtime_checkable
class Tool(Protocol):
    """What a tool must have: a ``name`` and a call from argument text to result text.

    Attributes:
        name (str): the tool's name; the default call syntax is ``<name>...</name>``.

    A tool should never raise: it returns ``"error: ..."`` for input it cannot handle (the
    rollout loop catches exceptions anyway, see :func:`run_tool`), and it should bound its own
    running time, since the whole rollout waits for it.
    """

    name: str

    def __call__(self, arguments: str) -> str:
        """Run the tool on the text the model wrote between the call tags.

        Args:
            arguments: the call's text (e.g. ``"12*7"``).

        Returns:
            The result text (e.g. ``"84"``), or ``"error: <why>"``.
        """
        ...


def is_error(result: str) -> bool:
    """Whether a tool result reports a failure (it starts with ``error:``)."""
    return result.lstrip().lower().startswith(ERROR_PREFIX)


def run_tool(tool: Tool, arguments: str) -> str:
    """Call ``tool`` on ``arguments``; never raises.

    Args:
        tool: the tool.
        arguments: the call's text.

    Returns:
        The tool's result as a string, ``"error: <exception type>: <message>"`` when it raised,
        or ``"error: tool returned <type>"`` when it returned something other than a string.
    """
    try:
        result = tool(arguments)
    except Exception as exc:  # noqa: BLE001 - a tool's failure is text for the model
        return f"{ERROR_PREFIX} {type(exc).__name__}: {str(exc)[:200]}"
    if not isinstance(result, str):
        return f"{ERROR_PREFIX} tool returned {type(result).__name__}, not text"
    return result


# ---------------------------------------------------------------------------- calculator
class _CalcError(Exception):
    """A calculator error whose message is shown to the model."""


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator:
    """Arithmetic on numbers, safely: an ``ast`` allow-list, bounded sizes, a time limit.

    Accepted: int and float literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses.
    Everything else (names, calls, attributes, subscripts, comparisons, strings, ...) is an
    error; nothing is ever passed to ``eval``. Limits, checked *before* each operation runs so
    that no single operation can be slow:

    * the input has at most ``max_input_chars`` characters (which also bounds the nesting);
    * every literal and every intermediate result has at most ``max_digits`` digits (ints) or
      magnitude below ``10 ** max_digits`` (floats, which must be finite);
    * an exponent has absolute value at most ``max_exponent``, and ``a ** b`` is refused when
      its result would exceed ``max_digits`` digits (``9**9**9`` is an error, not a hang);
    * the evaluation stops with an error once ``time_limit_s`` has passed (checked at every
      node; each operation is bounded by the size limits, so the overshoot is microseconds).

    Results are ints as written (``84``) and floats with 12 significant digits (``0.3``,
    ``2.5``; ``168/2`` gives ``84``).

    Args:
        max_input_chars (int): longest accepted argument text.
        max_digits (int): most digits of any number, literal or intermediate.
        max_exponent (int): largest ``|b|`` in ``a ** b``.
        time_limit_s (float): per-call time limit in seconds.
        name (str): the tool's name (``calculator``: called as ``<calculator>...</calculator>``).

    In the chat-template format (:class:`ChatTemplateToolSyntax`) the expression is the JSON
    argument ``expression``: ``{"name": "calculator", "arguments": {"expression": "12*7"}}``.

    Raises:
        ValueError: for a non-positive limit.
    """

    #: The JSON argument that holds the expression (chat-template tool format).
    argument = "expression"
    #: What the tool's JSON schema says it does (chat-template tool format).
    description = ("Evaluate an arithmetic expression: numbers, + - * / // % ** and "
                   "parentheses. Returns the value.")
    #: What the schema says of the ``expression`` argument.
    argument_description = "the expression, e.g. 12*7"

    def __init__(self, max_input_chars: int = 200, max_digits: int = 60,
                 max_exponent: int = 100, time_limit_s: float = 0.05,
                 name: str = "calculator") -> None:
        for key, value in (("max_input_chars", max_input_chars), ("max_digits", max_digits),
                           ("max_exponent", max_exponent), ("time_limit_s", time_limit_s)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Calculator {key} must be a positive number, got {value!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"Calculator name must be a non-empty string, got {name!r}")
        self.max_input_chars = int(max_input_chars)
        self.max_digits = int(max_digits)
        self.max_exponent = int(max_exponent)
        self.time_limit_s = float(time_limit_s)
        self.name = name
        self._limit = 10 ** self.max_digits  # ints and floats must stay below it in magnitude

    def __call__(self, arguments: str) -> str:
        """Evaluate ``arguments``; never raises.

        Args:
            arguments: an arithmetic expression such as ``"12*7"``.

        Returns:
            The value as text, or ``"error: <why>"``.
        """
        try:
            if not isinstance(arguments, str):
                raise _CalcError("expected text")
            text = arguments.strip()
            if not text:
                raise _CalcError("empty expression")
            if len(text) > self.max_input_chars:
                raise _CalcError(f"expression longer than {self.max_input_chars} characters")
            if not text.isascii():
                raise _CalcError("only ASCII digits and + - * / // % ** ( ) are allowed")
            try:
                with warnings.catch_warnings():  # e.g. SyntaxWarning: invalid decimal literal
                    warnings.simplefilter("ignore")
                    tree = ast.parse(text, mode="eval")
            except (SyntaxError, ValueError) as exc:  # ValueError: e.g. null bytes
                raise _CalcError("not an arithmetic expression") from exc
            deadline = time.perf_counter() + self.time_limit_s
            return self._format(self._eval(tree.body, deadline))
        except _CalcError as exc:
            return f"{ERROR_PREFIX} {exc}"
        except ZeroDivisionError:
            return f"{ERROR_PREFIX} division by zero"
        except (OverflowError, ArithmeticError):
            return f"{ERROR_PREFIX} number too large"
        except (RecursionError, MemoryError):
            return f"{ERROR_PREFIX} expression too deeply nested"
        except Exception as exc:  # noqa: BLE001 - never raise into the rollout loop
            return f"{ERROR_PREFIX} {type(exc).__name__}"

    # -- evaluation
    def _check(self, value: Any) -> int | float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _CalcError("result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise _CalcError("number too large")
        if abs(value) >= self._limit:
            raise _CalcError(f"number with more than {self.max_digits} digits")
        return value

    def _eval(self, node: ast.AST, deadline: float) -> int | float:
        if time.perf_counter() > deadline:
            raise _CalcError(f"time limit of {self.time_limit_s:g} s exceeded")
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise _CalcError("only numbers are allowed")
            return self._check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._check(_UNARY[type(node.op)](self._eval(node.operand, deadline)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left = self._eval(node.left, deadline)
            right = self._eval(node.right, deadline)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            result = _BINARY[type(node.op)](left, right)
            if isinstance(result, complex):
                raise _CalcError("result is not a real number")
            return self._check(result)
        if isinstance(node, (ast.Name, ast.Call, ast.Attribute, ast.Subscript)):
            raise _CalcError("only numbers and + - * / // % ** ( ) are allowed")
        raise _CalcError(f"unsupported syntax ({type(node).__name__})")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        """Refuse ``base ** exponent`` when ``|exponent|`` or the result's size is too large."""
        if abs(exponent) > self.max_exponent:
            raise _CalcError(f"exponent larger than {self.max_exponent}")
        if abs(base) > 1 and exponent > 0:
            digits = exponent * math.log10(abs(base))
            if digits >= self.max_digits:
                raise _CalcError(f"number with more than {self.max_digits} digits")

    @staticmethod
    def _format(value: int | float) -> str:
        if isinstance(value, int):
            return str(value)
        if value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")


# ---------------------------------------------------------------------------- call syntax
@dataclass(frozen=True)
class ToolCall:
    """A completed call found in generated text.

    Attributes:
        name (str): the tool's name.
        arguments (str): the text between the open and close tags (None when the close tag
            had no open tag before it).
        end (int): index in the searched text just past the close tag.
    """

    name: str
    arguments: str | None
    end: int


@dataclass(frozen=True)
class ToolCallSyntax:
    """How a call and its result are written: tag templates in which ``{name}`` is the tool's.

    With the defaults, the model calls the calculator as ``<calculator>12*7</calculator>``
    and the rollout appends ``<result>84</result>``.

    Args:
        call_open (str): opening tag template (default ``"<{name}>"``).
        call_close (str): closing tag template (default ``"</{name}>"``). A turn ends when the
            decoded text completes it, so it should end in a character the model rarely
            writes otherwise (each false alarm costs one more generation call).
        result_open (str): text before a result (default ``"<result>"``).
        result_close (str): text after a result (default ``"</result>"``).

    Raises:
        ValueError: an empty close tag, or a template other than ``{name}`` placeholders.
    """

    call_open: str = "<{name}>"
    call_close: str = "</{name}>"
    result_open: str = "<result>"
    result_close: str = "</result>"

    def __post_init__(self) -> None:
        for key in ("call_open", "call_close", "result_open", "result_close"):
            value = getattr(self, key)
            if not isinstance(value, str):
                raise ValueError(f"ToolCallSyntax.{key} must be a string, got {value!r}")
            try:
                value.format(name="x")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"ToolCallSyntax.{key}={value!r}: only the placeholder {{name}} is allowed"
                ) from exc
        if not self.call_close.format(name="x"):
            raise ValueError("ToolCallSyntax.call_close must not be empty")

    def open_tag(self, name: str) -> str:
        """The opening tag of tool ``name``."""
        return self.call_open.format(name=name)

    def close_tag(self, name: str) -> str:
        """The closing tag of tool ``name``."""
        return self.call_close.format(name=name)

    def format_call(self, name: str, arguments: str) -> str:
        """The text of a call, e.g. ``<calculator>12*7</calculator>``."""
        return f"{self.open_tag(name)}{arguments}{self.close_tag(name)}"

    def format_result(self, result: str) -> str:
        """The text appended after a call, e.g. ``<result>84</result>``."""
        return f"{self.result_open}{result}{self.result_close}"

    def count_closes(self, text: str, names: Sequence[str]) -> int:
        """How many close tags of tools ``names`` occur in ``text``."""
        return sum(text.count(self.close_tag(n)) for n in names)

    def last_call(self, text: str, names: Sequence[str]) -> ToolCall | None:
        """The call whose close tag ends last in ``text`` (None: no close tag at all).

        The rollout checks the text of a completion each time a token that may finish a
        close tag was sampled; the call is the one that token completed. Its arguments are the
        text between that close tag and the nearest preceding open tag of the same tool (after
        that tool's previous close tag; none there: ``arguments`` is None).

        Args:
            text: decoded completion text (model and tool tokens).
            names: the tools' names.

        Returns:
            :class:`ToolCall` or None.
        """
        best: ToolCall | None = None
        for name in names:
            close = self.close_tag(name)
            start = text.rfind(close)
            if start < 0:
                continue
            end = start + len(close)
            if best is not None and end <= best.end:
                continue
            open_tag = self.open_tag(name)
            previous = text.rfind(close, 0, start)  # the same tool's previous call, if any
            floor = 0 if previous < 0 else previous + len(close)
            at = text.rfind(open_tag, floor, start)
            arguments = None if at < 0 else text[at + len(open_tag) : start]
            best = ToolCall(name=name, arguments=arguments, end=end)
        return best

    def final_characters(self, names: Sequence[str]) -> set[str]:
        """The last character of each close tag: a turn can only end on a token holding one."""
        return {self.close_tag(n)[-1] for n in names}


# ---------------------------------------------------------------------------- chat-template format
#: ``tool_syntax.format`` values: configurable tags (the default) or the chat template's format.
TAGS_FORMAT = "tags"
CHAT_TEMPLATE_FORMAT = "chat_template"
_FORMATS = (TAGS_FORMAT, CHAT_TEMPLATE_FORMAT)

#: The tool-message content the template check renders (it must appear in the rendering).
_PROBE_RESULT = "tool-result-probe-7321"


def tool_argument(tool: Tool) -> str:
    """The JSON argument whose value a tool receives as its text (chat-template format).

    Its ``argument`` attribute (the calculator's is ``"expression"``), or ``"input"``.
    """
    value = getattr(tool, "argument", None)
    return value if isinstance(value, str) and value else "input"


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of a tool, as chat templates take it in ``tools=[...]``.

    ``{"type": "function", "function": {"name", "description", "parameters"}}`` with one
    required string parameter, :func:`tool_argument` (described by the tool's
    ``argument_description`` attribute when it has one); the description is the tool's
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
    """Run ``tool`` on a JSON call's ``arguments`` object; never raises.

    The tool gets the value of its :func:`tool_argument` as text (a number is written out).

    Returns:
        The tool's result (:func:`run_tool`), or ``"error: <why>"`` for arguments that are not
        an object, miss the argument, have others, or whose value is not a string or number.
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
    """Tool calls in the chat template's own format (``tool_syntax: {format: chat_template}``).

    The model writes a call as tool-calling chat models do (Hermes / Qwen 2.5 style)::

        <tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>

    The close tag ends the turn. The JSON is parsed (:meth:`last_call`); a call that is not a
    JSON object with a string ``name``, or names no tool, gets an ``error: ...`` result (never
    an exception). The result is appended as the text the tokenizer's chat template renders
    after the call (:meth:`result_text`): the end of the assistant turn, a ``{"role": "tool"}``
    message, and the header of a new assistant turn.

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
        """Whether a token with this text can be the one that completes the close tag.

        The tag then ends inside the token: the token holds the whole tag, or starts with one
        of its proper suffixes (``>``, ``l>``, ..., ``/tool_call>``). A token that merely holds
        a ``>`` elsewhere (the open tag ``<tool_call>``) cannot, so, unlike the tag format, the
        open tag costs no extra turn. With a non-ASCII close tag, any token holding U+FFFD (a
        byte of a multi-byte character) may too.
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

        Its body is the text between that close tag and the nearest open tag after the
        previous close tag. The body must be a JSON object ``{"name": <one of names>,
        "arguments": {...}}`` (``arguments`` may also be a JSON string holding an object, and
        may be left out: ``{}``); otherwise the call's ``error`` says why.

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

        The conversation ``[user, assistant(tool_calls=[the call])]`` is rendered, then again
        with ``{"role": "tool", "name": name, "content": result}`` added and
        ``add_generation_prompt=True``; the text is the second rendering from just past the
        call's close tag in the first: the end of the assistant turn, the tool message and the
        new assistant header. A call that could not be read (``name`` None) or a template that
        rejects it is rendered as a call of the first tool with ``{}`` arguments.

        Args:
            tokenizer: a tokenizer with ``apply_chat_template(messages, add_generation_prompt,
                tools)`` (:class:`~torchtune_grpo.models.tokenizer.HFTokenizer`).
            name: the called tool's name (None: unreadable call).
            arguments: the call's arguments.
            result: the tool's result text.
            tools: the tools' JSON schemas (as the prompt was rendered with).

        Raises:
            ValueError: only when even the fallback rendering fails (the check of
                :meth:`check_tokenizer` passed on the same template, so not in practice).
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
        """Fail clearly when ``tokenizer``'s chat template cannot render the tool format.

        Checks that the tokenizer has a chat template, renders an assistant tool call written
        with :attr:`call_close`, and renders a tool message's content after it.

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


def make_tool_syntax(value: Any = None) -> ToolCallSyntax | ChatTemplateToolSyntax:
    """The call syntax of a config's ``tool_syntax`` value.

    Args:
        value: None (the default tags), a syntax object, or a mapping: ``format: tags`` (or no
            ``format``) takes :class:`ToolCallSyntax`'s fields, ``format: chat_template``
            :class:`ChatTemplateToolSyntax`'s.

    Raises:
        ValueError: an unknown format or key (naming ``tool_syntax.<key>``), or a bad value.
    """
    import dataclasses
    import difflib

    if value is None:
        return ToolCallSyntax()
    if isinstance(value, (ToolCallSyntax, ChatTemplateToolSyntax)):
        return value
    if not hasattr(value, "keys"):
        raise ValueError(f"config key 'tool_syntax' must be a mapping, got {value!r}")
    values = {str(k): value[k] for k in value.keys()}
    fmt = values.pop("format", TAGS_FORMAT)
    if fmt not in _FORMATS:
        raise ValueError(f"config key 'tool_syntax' has format {fmt!r}: 'tool_syntax.format' "
                         f"must be {TAGS_FORMAT!r} (the default) or {CHAT_TEMPLATE_FORMAT!r}")
    cls = ChatTemplateToolSyntax if fmt == CHAT_TEMPLATE_FORMAT else ToolCallSyntax
    known = [f.name for f in dataclasses.fields(cls) if f.name != "format"]
    unknown = [k for k in values if k not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" Did you mean 'tool_syntax.{close[0]}'?" if close else ""
        other = ToolCallSyntax if cls is ChatTemplateToolSyntax else ChatTemplateToolSyntax
        if unknown[0] in {f.name for f in dataclasses.fields(other)}:
            hint = (f" 'tool_syntax.{unknown[0]}' has no meaning with format {fmt!r}"
                    + (": the result is the chat template's tool message"
                       if cls is ChatTemplateToolSyntax else "") + ".")
        raise ValueError(f"config key 'tool_syntax' has unknown key(s) {unknown} for format "
                         f"{fmt!r} (known: {', '.join(['format', *known])}).{hint}")
    return cls(**values)


# ---------------------------------------------------------------------------- config
def build_tools(cfg_list: Sequence[Mapping[str, Any]] | None) -> list[Tool]:
    """Instantiate the config's ``tools:`` list with torchtune's ``config.instantiate``.

    Args:
        cfg_list: None, or a list of mappings (dicts or OmegaConf ``DictConfig``), each with a
            ``_component_`` (dotted path of a class or factory) and its keyword arguments.

    Returns:
        The tools, in config order.

    Raises:
        ValueError: naming the entry (``tools[i]``) and the key at fault: not a list, an
            entry that is not a mapping or lacks ``_component_``, a component that cannot be
            imported or built, an object without a string ``name`` or not callable, or two
            tools with the same name.
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from torchtune import config as tt_config

    if cfg_list is None:
        return []
    if isinstance(cfg_list, (str, bytes, Mapping, DictConfig)) or not isinstance(
            cfg_list, (Sequence, ListConfig)):
        raise ValueError(
            f"config key 'tools' must be a list of {{_component_: ...}} entries, got "
            f"{type(cfg_list).__name__}"
        )
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(cfg_list):
        where = f"config key 'tools[{i}]'"
        if not isinstance(entry, (Mapping, DictConfig)):
            raise ValueError(f"{where} must be a mapping with a '_component_' key, got "
                             f"{type(entry).__name__}: {entry!r}")
        node = entry if isinstance(entry, DictConfig) else OmegaConf.create(dict(entry))
        component = node.get("_component_")
        if not isinstance(component, str) or not component:
            raise ValueError(f"{where}._component_ is missing: give the dotted path of the "
                             "tool's class, e.g. torchtune_grpo.rollout.tools.Calculator")
        try:
            tool = tt_config.instantiate(node)
        except Exception as exc:  # noqa: BLE001 - re-raised with the entry named
            raise ValueError(f"{where}._component_={component!r} could not be built: "
                             f"{type(exc).__name__}: {exc}") from exc
        name = getattr(tool, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}._component_={component!r} built an object without a "
                             "string 'name' attribute (see torchtune_grpo.rollout.tools.Tool)")
        if not callable(tool):
            raise ValueError(f"{where}._component_={component!r} built an object that is not "
                             "callable: a tool maps argument text to result text")
        if name in seen:
            raise ValueError(f"{where}.name={name!r} is already the name of tools[{seen[name]}]"
                             ": give each tool a distinct name")
        seen[name] = i
        tools.append(tool)
    return tools
