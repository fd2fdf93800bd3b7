"""The tag call syntax (:class:`ToolCallSyntax`): ``<calculator>12*7</calculator>`` answered by
``<result>84</result>``, tags templated on the tool's ``{name}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TAGS_FORMAT", "ToolCall", "ToolCallSyntax"]

#: ``tool_syntax.format`` value of the tag syntax (the default).
TAGS_FORMAT = "tags"


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

    Args:
        call_open (str): opening tag template (default ``"<{name}>"``).
        call_close (str): closing tag template (default ``"</{name}>"``); best ending in a
            character the model rarely writes otherwise (each false alarm costs a turn).
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

        Its arguments are the text between that close tag and the nearest preceding open tag of the
        same tool after that tool's previous close tag (none there: ``arguments`` is None).

        Args:
            text: decoded completion text (model and tool tokens).
            names: the tools' names.
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
