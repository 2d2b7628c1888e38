"""A Java ``.properties`` parser (the syntax of LMI's serving.properties).

Used by ``autoconfig.lmi.properties`` at container start. Implements the rules of
``java.util.Properties.load``: ``#``/``!`` comment lines, ``=``/``:``/whitespace
separators, backslash line continuations (leading whitespace of the next line
dropped), and the escapes ``\\t \\n \\r \\f \\uXXXX`` (any other ``\\c`` is ``c``).
"""
from __future__ import annotations

import re

from lmi_cache.errors import UserError

_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}
_NEWLINE = re.compile(r"\r\n|\r|\n")
_WHITESPACE = " \t\f"


class PropertiesSyntaxError(UserError):
    """A malformed line in a .properties file (names the file and line)."""


def parse_properties(text: str, source: str = "<properties>") -> dict[str, str]:
    """Parse properties text; later keys win, as in Java."""
    return parse_properties_lines(text, source)[0]


def parse_properties_lines(text: str, source: str = "<properties>") -> tuple[dict[str, str], dict[str, int], list[str]]:
    """(key -> value, key -> line number, one warning per key written twice); later keys win, as in Java.

    A repeated key is easy to miss (the first value is the one a reader sees): each gets a line
    naming the file and both line numbers.
    """
    result: dict[str, str] = {}
    lines: dict[str, int] = {}
    repeats: list[str] = []
    for line_no, logical in _logical_lines(text):
        raw_key, raw_value = _split(logical)
        key = _unescape(raw_key, source, line_no)
        if key in lines:
            repeats.append(f"{source}: line {line_no}: {key} is also set on line {lines[key]}; line {line_no}'s "
                           "value is used (the last one wins, as in LMI); remove the other line")
        result[key] = _unescape(raw_value, source, line_no)
        lines[key] = line_no
    return result, lines, repeats


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join continuation lines; drop comments and blank lines. Yields (first line number, raw text)."""
    out: list[tuple[int, str]] = []
    natural = _NEWLINE.split(text.lstrip("\ufeff"))
    i = 0
    while i < len(natural):
        start = i
        line = natural[i].lstrip(_WHITESPACE)
        i += 1
        if not line or line[0] in "#!":
            continue
        parts = []
        while _ends_with_continuation(line):
            parts.append(line[:-1])
            if i >= len(natural):
                line = ""
                break
            line = natural[i].lstrip(_WHITESPACE)
            i += 1
        parts.append(line)
        out.append((start + 1, "".join(parts)))
    return out


def _ends_with_continuation(line: str) -> bool:
    """An odd number of trailing backslashes continues the line (an even number is escaped backslashes)."""
    count = len(line) - len(line.rstrip("\\"))
    return count % 2 == 1


def _split(line: str) -> tuple[str, str]:
    """Key ends at the first unescaped '=', ':' or whitespace; one separator, surrounding blanks skipped."""
    i = 0
    while i < len(line):
        ch = line[i]
        if ch == "\\":
            i += 2
            continue
        if ch in "=:" or ch in _WHITESPACE:
            break
        i += 1
    key = line[:i]
    j = i
    while j < len(line) and line[j] in _WHITESPACE:
        j += 1
    if j < len(line) and line[j] in "=:":
        j += 1
        while j < len(line) and line[j] in _WHITESPACE:
            j += 1
    return key, line[j:]


def _unescape(raw: str, source: str, line_no: int) -> str:
    if "\\" not in raw:
        return raw
    out: list[str] = []
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        if i + 1 >= len(raw):
            i += 1  # a lone trailing backslash (end of file) is dropped, as Java does
            continue
        nxt = raw[i + 1]
        if nxt == "u":
            digits = raw[i + 2:i + 6]
            if len(digits) != 4 or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise PropertiesSyntaxError(
                    f"{source}: line {line_no}: malformed \\uXXXX escape {raw[i:i + 6]!r}; use 4 hex digits"
                )
            out.append(chr(int(digits, 16)))
            i += 6
            continue
        out.append(_ESCAPES.get(nxt, nxt))
        i += 2
    return _join_surrogates("".join(out), source, line_no)


def _join_surrogates(text: str, source: str, line_no: int) -> str:
    """Java writes a character above U+FFFF as two \\u escapes (a UTF-16 pair): join them; refuse half a pair.

    A lone surrogate is no character at all: it could not be printed, passed to vLLM or used as a path.
    """
    if not any("\ud800" <= c <= "\udfff" for c in text):
        return text
    try:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    except UnicodeDecodeError:
        raise PropertiesSyntaxError(f"{source}: line {line_no}: a \\uD800-\\uDFFF escape without its other half "
                                    "(a lone UTF-16 surrogate is no character); write the character itself") from None
