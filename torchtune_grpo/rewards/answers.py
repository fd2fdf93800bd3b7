"""Reading final answers out of completions: numbers, answer tags, phrases and boxes.

Training rewards and evaluation graders both read answers with these functions. Each runs in
time linear in its input and never raises on a string; only the standard library is imported
(the grading worker imports it without torch).
"""

from __future__ import annotations

import functools
import math
import re

__all__ = [
    "after_thinking",
    "extract_after_phrase",
    "extract_boxed",
    "extract_tagged",
    "last_number",
    "numbers_match",
    "parse_number",
]

# --------------------------------------------------------------------------------------------
# The last number
# --------------------------------------------------------------------------------------------

# LaTeX that only changes how a number looks is rewritten before scanning: ``1{,}000`` and
# ``1\,000`` (thousands separators) become ``1,000``; ``\!`` (negative space, as in ``-\!5``)
# disappears; the other spacing commands become a space; ``\$`` becomes ``$``.
_LATEX_THOUSANDS_RE = re.compile(r"\{,\}|(?<=[0-9])\\,(?=[0-9])")
_LATEX_SPACE_RE = re.compile(r"\\[,;: ]")

# Every match of _SCAN_RE is one number token. The pattern starts with a character class, so
# the regex engine skips to candidate characters in C; each branch then continues according to
# the character just consumed. No quantified group can match in more than one way, so matching
# is linear in the text length. A token is one of:
#   - ``[sign]\frac{a}{b}`` (also ``\dfrac``, ``\tfrac``; ``a`` and ``b`` may be signed, and a
#     one-digit argument needs no braces: ``\frac12``);
#   - ``[sign][$]digits[,digits...][.digits][/digits[.digits]]``;
#   - ``[sign][$].digits`` (a leading-dot decimal, not directly after a digit).
# A sign counts only directly in front of the number and not after a word character or a
# closing bracket, so "10-3" holds the numbers 10 and 3 (a range or a subtraction) while
# "= -3", "(-3)" and "$-3$" hold minus three.
_INT = r"[0-9](?:[0-9,]*[0-9])?"
_REAL = r"[0-9]+(?:\.[0-9]+)?"
_FRAC_ARG = r"(?:\{-?" + _REAL + r"\}|[0-9])"
_FRAC = r"[dt]?frac" + _FRAC_ARG + _FRAC_ARG  # what follows the backslash
_UNSIGNED = _INT + r"(?:\.[0-9]+)?(?:/" + _REAL + r")?|\.[0-9]+"
_SCAN_RE = re.compile(
    r"[\\\-\u2212$.0-9]"
    r"(?:(?<=\\)" + _FRAC
    + r"|(?<=[-\u2212])(?<![0-9A-Za-z_)\]}][-\u2212])(?:\$?(?:" + _UNSIGNED + r")|\\" + _FRAC + r")"
    r"|(?<=\$)(?:" + _UNSIGNED + r")"
    r"|(?<=[0-9])(?:[0-9,]*[0-9])?(?:\.[0-9]+)?(?:/" + _REAL + r")?"
    r"|(?<=\.)(?<![0-9]\.)[0-9]+)"
)
# The parts of one token found by _SCAN_RE (used with fullmatch on the token, sign and "$"
# removed).
_FRAC_PARTS_RE = re.compile(
    r"\\[dt]?frac(?:\{(-?" + _REAL + r")\}|([0-9]))(?:\{(-?" + _REAL + r")\}|([0-9]))"
)
_PLAIN_PARTS_RE = re.compile(r"(" + _INT + r")(\.[0-9]+)?(?:/(" + _REAL + r"))?|(\.[0-9]+)")
# Where scanning may start: a position p such that no token holds both text[p - 1] and
# text[p], so a scan from p finds exactly the tokens a full scan finds from p on. These
# regexes run on the reversed text (seeing text[p], then text[p - 1]) and each starts with a
# literal or a character class, so the engine searches for them in C. Sync points: a
# backslash not after a sign, a sign not after "{", a "$" not after a sign (the match is at
# p), or a character that no token contains (the match is at p - 1).
_SYNC_AT_P = (
    re.compile(r"\\(?![-\u2212])"),
    re.compile(r"[-\u2212](?!\{)"),
    re.compile(r"\$(?![-\u2212])"),
)
_SYNC_BEFORE_P = re.compile(r"[^0-9,./$\-\u2212\\{}dtfrac]")
_DIGIT_RE = re.compile(r"[0-9]")
# Scan only about this many trailing characters first (the last number is usually near the
# end); the window grows geometrically, so the total work stays linear.
_SCAN_WINDOW = 1024


def _scan_last(text: str, pos: int, endpos: int) -> str | None:
    """The last :data:`_SCAN_RE` token of ``text[pos:endpos]`` (lookbehinds see before pos)."""
    last = None
    for last in _SCAN_RE.finditer(text, pos, endpos):
        pass
    return None if last is None else last.group()


def _last_token(text: str) -> str | None:
    """The last :data:`_SCAN_RE` token of ``text`` (what a full left-to-right scan ends with)."""
    n = len(text)
    if n <= _SCAN_WINDOW:
        return _scan_last(text, 0, n)
    reversed_text = text[::-1]  # reversed_text[r] == text[n - 1 - r]
    digit = _DIGIT_RE.search(reversed_text)
    if digit is None:
        return None
    # Tokens end with a digit or with the "}" of a \frac right after one.
    end = min(n, n + 1 - digit.start())
    window = _SCAN_WINDOW
    while True:
        start = (n - end) + window  # reversed index of the first allowed sync point
        found = [m.start() for m in (rx.search(reversed_text, start) for rx in _SYNC_AT_P) if m]
        safe = _SYNC_BEFORE_P.search(reversed_text, start + 1)
        if safe is not None:
            found.append(safe.start() - 1)
        pos = 0 if not found else n - 1 - min(found)
        token = _scan_last(text, pos, end)
        if token is not None or pos == 0:
            return token
        window *= 4


def _integer_part(raw: str) -> str:
    """Digits of a matched integer part that may contain commas.

    ``1,234,567`` (valid thousands grouping) becomes ``1234567``; anything else with commas
    (``1,2,3``, ``12,34``) is a list of numbers, and the last group is the last number.
    """
    if "," not in raw:
        return raw
    groups = raw.split(",")
    if 1 <= len(groups[0]) <= 3 and all(len(g) == 3 for g in groups[1:]):
        return "".join(groups)
    return groups[-1]


def _to_float(text: str) -> float | None:
    """``float(text)`` or ``None`` when it is not finite (huge digit strings become inf)."""
    try:
        value = float(text)
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def _token_number(token: str) -> tuple[str, float] | None:
    """``(normalised text, value)`` of one :data:`_SCAN_RE` token, ``None`` if not finite."""
    negative = token[0] in "-\u2212"
    body = token[1:] if negative else token
    body = body[1:] if body.startswith("$") else body
    if body.startswith("\\"):
        frac = _FRAC_PARTS_RE.fullmatch(body)
        if frac is None:  # cannot happen for tokens of _SCAN_RE; be safe anyway
            return None
        num_text, den_text = frac.group(1) or frac.group(2), frac.group(3) or frac.group(4)
        for part in (num_text, den_text):
            negative ^= part.startswith("-")
        num_text, den_text = num_text.lstrip("-"), den_text.lstrip("-")
    else:
        plain = _PLAIN_PARTS_RE.fullmatch(body)
        if plain is None:  # cannot happen for tokens of _SCAN_RE; be safe anyway
            return None
        if plain.group(4) is not None:
            num_text = "0" + plain.group(4)
        else:
            num_text = _integer_part(plain.group(1)) + (plain.group(2) or "")
        den_text = plain.group(3)
    value = _to_float(num_text)
    if value is None:
        return None
    if den_text is not None:
        den = _to_float(den_text)
        if den is None:
            return None
        if den == 0:  # "a/0" is not a fraction; the last number written is the denominator.
            return "0", 0.0
        value /= den
        num_text = f"{num_text}/{den_text}"
        if not math.isfinite(value):
            return None
    return ("-" + num_text, -value) if negative else (num_text, value)


def _find_last_number(text: str) -> tuple[str, float] | None:
    """The scanner behind :func:`last_number` and :func:`parse_number`."""
    if not isinstance(text, str):
        return None
    if "\\" in text or "{,}" in text:
        text = _LATEX_THOUSANDS_RE.sub(",", text)
        text = text.replace("\\!", "").replace("\\$", "$")
        text = _LATEX_SPACE_RE.sub(" ", text)
    token = _last_token(text)
    return None if token is None else _token_number(token)


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (the one :func:`parse_number` reads), as normalised text
    ``[-]digits[.digits][/digits[.digits]]``: ``"$1,234."`` gives ``"1234"``,
    ``"x = -\\frac{1}{2}"`` ``"-1/2"``, ``"10-3"`` ``"3"``; ``None`` exactly when
    :func:`parse_number` returns ``None``.
    """
    found = _find_last_number(text)
    return None if found is None else found[0]


def parse_number(text: str) -> float | None:
    """The last number written in ``text``, as a float.

    Accepts thousands separators (``1,000``, ``1{,}000``), currency, trailing zeros or period,
    units and words around it, percentages (``50%`` is 50), negative signs (a ``-`` right after a
    word character or closing bracket is a subtraction: ``10-3`` ends with 3), simple fractions
    (``3/4``, ``\\frac{3}{4}``; ``a/0`` is 0) and leading-dot decimals; not scientific notation.

    Args:
        text: any text.

    Returns:
        The value, or ``None`` when ``text`` holds no number or the last one is not finite.
    """
    found = _find_last_number(text)
    return None if found is None else found[1]


def numbers_match(a: float, b: float, rel_tol: float = 1e-6) -> bool:
    """Whether two numbers are equal: exactly when both are whole, else within
    ``max(rel_tol * max(|a|, |b|), 1e-9)``; ``False`` when either is NaN or infinite.
    """
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    if float(a).is_integer() and float(b).is_integer():
        return a == b
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)


# --------------------------------------------------------------------------------------------
# The part of a completion that holds the answer
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _literal_regex(literal: str) -> re.Pattern[str]:
    """A case-insensitive regex matching ``literal`` literally (cached per literal)."""
    return re.compile(re.escape(literal), re.IGNORECASE)


def extract_tagged(text: str, tag: str) -> str | None:
    """Content of the last complete ``<tag>...</tag>`` block of ``text``, stripped, or ``None``.

    The last closing tag pairs with the nearest opening tag before it; tags match
    case-insensitively and literally.
    """
    if not isinstance(text, str) or not tag:
        return None
    close = None
    for close in _literal_regex(f"</{tag}>").finditer(text):
        pass
    if close is None:
        return None
    head = text[: close.start()]
    opening = None
    for opening in _literal_regex(f"<{tag}>").finditer(head):
        pass
    if opening is None:
        return None
    return head[opening.end() :].strip()


def extract_after_phrase(text: str, phrase: str) -> str | None:
    """The rest of the line after the last case-insensitive occurrence of ``phrase``, stripped, or
    ``None`` when ``text`` does not contain it.
    """
    if not isinstance(text, str) or not phrase:
        return None
    last = None
    for last in _literal_regex(phrase).finditer(text):
        pass
    if last is None:
        return None
    return text[last.end() :].split("\n", 1)[0].strip()


# Tokens of the brace scan: an escaped backslash (LaTeX line break), an escaped brace
# (``\{``, ``\}``: literal set braces, not grouping), ``\boxed{`` / ``\fbox{`` (opening a box),
# ``\boxed 5`` (a box without braces), or a plain brace. Every alternative starts with a
# literal character and has no nested quantifier, so scanning is linear in the text length.
_BOX_SCAN_RE = re.compile(
    r"\\\\"
    r"|\\[{}]"
    r"|\\(?:boxed|fbox)[ \t]*\{"
    r"|\\boxed[ \t]+(?P<bare>[^\s{}$\\]+)"
    r"|[{}]"
)


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) of
    ``text``, stripped, or ``None``; braces are balanced, escaped braces are literal.
    """
    if not isinstance(text, str) or "box" not in text:
        return None
    stack: list[int | None] = []  # content start of an open box, None for a plain brace
    best: tuple[int, str] | None = None  # (end position, content)
    for match in _BOX_SCAN_RE.finditer(text):
        token = match.group()
        if match.group("bare") is not None:
            best = (match.end(), match.group("bare"))
        elif token == "}":
            if stack:
                start = stack.pop()
                if start is not None:
                    best = (match.end(), text[start : match.start()])
        elif token.endswith("{") and not token.startswith("\\{"):
            stack.append(match.end() if token != "{" else None)
    return None if best is None else best[1].strip()


def after_thinking(text: str, tag: str = "think") -> str | None:
    """The part of a completion after its reasoning block ``<tag>...</tag>``.

    Returns:
        The text after the last ``</tag>``; ``None`` when a ``<tag>`` never closes; otherwise
        ``text`` unchanged. Tags match case-insensitively.
    """
    if not isinstance(text, str):
        return None
    close = None
    for close in _literal_regex(f"</{tag}>").finditer(text):
        pass
    if close is not None:
        return text[close.end() :]
    if _literal_regex(f"<{tag}>").search(text):
        return None
    return text
