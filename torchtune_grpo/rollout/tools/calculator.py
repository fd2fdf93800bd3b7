"""The shipped tool: a safe calculator for arithmetic expressions."""

from __future__ import annotations

import ast
import math
import operator
import time
import warnings
from collections.abc import Callable
from typing import Any

from torchtune_grpo.rollout.tools.base import ERROR_PREFIX

__all__ = ["Calculator"]


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

    Accepted: int and float literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses
    (nothing reaches ``eval``); sizes are checked before each operation. Floats are written with
    12 significant digits. Chat-template format: the JSON argument ``expression``.

    Args:
        max_input_chars (int): longest accepted argument text.
        max_digits (int): most digits of any number, literal or intermediate (floats: magnitude
            below ``10 ** max_digits``).
        max_exponent (int): largest ``|b|`` in ``a ** b``.
        time_limit_s (float): per-call time limit in seconds.
        name (str): the tool's name.

    Raises:
        ValueError: a non-positive limit or an empty name.
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
