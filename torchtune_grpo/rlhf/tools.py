"""Tools a policy may call inside a rollout, the call syntax, and a safe calculator.

A **tool** is any object with a ``name`` (str) and ``__call__(arguments: str) -> str``: it
receives the text the model wrote between the call tags and returns the text appended to the
sequence as the tool's result. Tools are built from the config's ``tools:`` list with
torchtune's ``config.instantiate`` (:func:`build_tools`), so a user's own tool plugs in by its
``_component_`` path with no code change::

    tools:
      - _component_: torchtune_grpo.rlhf.tools.Calculator
        max_digits: 30
      - _component_: my_package.tools.WordCount

**Failures are text, never exceptions.** Whatever the model writes, a tool returns a string;
the rollout loop (:mod:`torchtune_grpo.rlhf.multiturn`) also catches anything a user tool
raises and turns it into ``error: ...``. A result that starts with ``error:`` is counted as a
tool error (the ``tools/errors`` metric).

**The call syntax** (:class:`ToolCallSyntax`): by default ``<calculator>12*7</calculator>``,
answered by ``<result>84</result>``; the tags are templates in which ``{name}`` is the tool's
name, so each tool has its own tags.
"""

from __future__ import annotations

import ast
import math
import operator
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Calculator",
    "Tool",
    "ToolCall",
    "ToolCallSyntax",
    "build_tools",
    "is_error",
    "run_tool",
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

    Raises:
        ValueError: for a non-positive limit.
    """

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
                             "tool's class, e.g. torchtune_grpo.rlhf.tools.Calculator")
        try:
            tool = tt_config.instantiate(node)
        except Exception as exc:  # noqa: BLE001 - re-raised with the entry named
            raise ValueError(f"{where}._component_={component!r} could not be built: "
                             f"{type(exc).__name__}: {exc}") from exc
        name = getattr(tool, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}._component_={component!r} built an object without a "
                             "string 'name' attribute (see torchtune_grpo.rlhf.tools.Tool)")
        if not callable(tool):
            raise ValueError(f"{where}._component_={component!r} built an object that is not "
                             "callable: a tool maps argument text to result text")
        if name in seen:
            raise ValueError(f"{where}.name={name!r} is already the name of tools[{seen[name]}]"
                             ": give each tool a distinct name")
        seen[name] = i
        tools.append(tool)
    return tools
