"""The tool interface: what a tool is, and calling one without ever raising.

A **tool** is any object with a ``name`` (str) and ``__call__(arguments: str) -> str``: it
receives the text the model wrote between the call tags and returns the text appended to the
sequence as the tool's result. Tools are built from the config's ``tools:`` list
(:func:`~torchtune_grpo.rollout.tools.build.build_tools`), so a user's own tool plugs in by its
``_component_`` path with no code change.

**Failures are text, never exceptions.** Whatever the model writes, a tool returns a string;
the rollout loop (:mod:`torchtune_grpo.rollout.multiturn`) also catches anything a user tool
raises and turns it into ``error: ...`` (:func:`run_tool`). A result that starts with
``error:`` is counted as a tool error (the ``tools/errors`` metric).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["ERROR_PREFIX", "Tool", "is_error", "run_tool"]

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
