"""Reading a judge model's reply as a score (``None`` when it holds none).

``"number"``: the first number; ``"last_number"``: the last; ``"yes_no"``: 1.0 / 0.0 for the
first whole word ``yes`` or ``no``; ``"regex:<pattern>"``: the first match (its first group if
any) read by ``float()``. A number is an optional sign, digits and decimals, not glued to a
letter, without thousands separators. No parser raises on a string.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

__all__ = ["PARSERS", "make_parser", "reply_first_number", "reply_last_number", "reply_yes_no"]

#: A number in a judge's reply: sign, digits, optional decimals; not glued to a letter or digit.
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])[-+]?(?:\d+(?:\.\d+)?|\.\d+)")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def _finite(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def reply_first_number(reply: str) -> float | None:
    """The first number of ``reply``, or ``None`` (see the module docstring for the format)."""
    match = _NUMBER.search(reply)
    return None if match is None else _finite(match.group(0))


def reply_last_number(reply: str) -> float | None:
    """The last number of ``reply``, or ``None``."""
    found = _NUMBER.findall(reply)
    return _finite(found[-1]) if found else None


def reply_yes_no(reply: str) -> float | None:
    """1.0 when the first whole word ``yes``/``no`` (any case) of ``reply`` is ``yes``, 0.0 when
    it is ``no``, ``None`` when there is neither."""
    match = _YES_NO.search(reply)
    if match is None:
        return None
    return 1.0 if match.group(1).lower() == "yes" else 0.0


def _regex_parser(pattern: str) -> Callable[[str], float | None]:
    """The ``regex:<pattern>`` parser: first match, group 1 if any, read with ``float()``."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"parser 'regex:{pattern}': the pattern does not compile ({exc})") from exc

    def parse(reply: str) -> float | None:
        match = compiled.search(reply)
        if match is None:
            return None
        text = match.group(1) if compiled.groups else match.group(0)
        return None if text is None else _finite(text.strip())

    return parse


#: The named parsers (``regex:<pattern>`` is the other kind).
PARSERS: dict[str, Callable[[str], float | None]] = {
    "number": reply_first_number,
    "last_number": reply_last_number,
    "yes_no": reply_yes_no,
}


def make_parser(spec: str) -> Callable[[str], float | None]:
    """The parser named by a config's ``parser`` value.

    Args:
        spec: ``"number"``, ``"last_number"``, ``"yes_no"`` or ``"regex:<pattern>"``.

    Returns:
        A function ``reply -> float | None``.

    Raises:
        ValueError: an unknown name, an empty pattern or a pattern that does not compile.
    """
    if not isinstance(spec, str):
        raise ValueError(f"parser must be a string, got {spec!r}")
    if spec.startswith("regex:"):
        pattern = spec[len("regex:"):]
        if not pattern:
            raise ValueError("parser 'regex:' needs a pattern after the colon")
        return _regex_parser(pattern)
    if spec not in PARSERS:
        raise ValueError(f"unknown parser {spec!r}; use one of {sorted(PARSERS)} or "
                         "'regex:<pattern>'")
    return PARSERS[spec]
