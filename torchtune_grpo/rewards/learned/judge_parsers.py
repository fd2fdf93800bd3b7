"""Reading a judge model's reply as a score.

A *parser* maps the text a judge generated to a float, or to ``None`` when the reply holds no
score (the :class:`~torchtune_grpo.rewards.learned.GenerativeJudge` then raises or uses its
``on_parse_failure`` score). :func:`make_parser` turns a config's ``parser`` string into one:

- ``"number"``: the **first** number of the reply (``"8/10"`` -> 8, ``"Score: 7.5"`` -> 7.5,
  ``"-2"`` -> -2). Judges are usually asked to answer with the score first, and a reply such as
  ``"7 out of 10"`` ends with the scale, not the score.
- ``"last_number"``: the **last** number (for judges that reason first and end with the score).
- ``"yes_no"``: 1.0 for ``yes``, 0.0 for ``no``: the **first** of these words in the reply
  (whole words, any case: ``"Yes."``, ``"NO, because..."``; ``"Nobody"`` is no match).
- ``"regex:<pattern>"``: the **first** match of the Python regular expression ``<pattern>``
  (``re.search``); its first group when the pattern has groups, else the whole match, read with
  ``float()`` (e.g. ``"regex:Score:\\s*(\\d+)"``). A match that ``float()`` cannot read is no
  score.

Numbers are written with an optional sign, digits and an optional decimal part (``7``,
``-3``, ``0.25``, ``.5``); a digit glued to a letter (``v2``, ``x7``) is not a number, and
thousands separators are not read (``1,000`` is 1 then 0). Every parser is a pure function that
never raises on any string.
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
