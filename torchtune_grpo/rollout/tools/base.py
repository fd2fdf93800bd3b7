"""The tool interface: any object with a ``name`` and ``__call__(arguments: str) -> str``.

Failures are text, never exceptions: :func:`run_tool` turns anything a tool raises into
``error: ...``, and a result starting with ``error:`` counts in ``tools/errors``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["ERROR_PREFIX", "Tool", "is_error", "run_tool"]

#: Prefix of a result that reports a failure (counted by the ``tools/errors`` metric).
ERROR_PREFIX = "error:"


@runtime_checkable
class Tool(Protocol):
    """What a tool must have: a ``name`` and a call from argument text to result text.

    A tool returns ``"error: ..."`` for input it cannot handle and bounds its own running time.

    Attributes:
        name (str): the tool's name; the default call syntax is ``<name>...</name>``.
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
