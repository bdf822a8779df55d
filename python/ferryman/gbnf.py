"""GBNF grammars (llama.cpp's, and what vLLM's xgrammar backend takes as ``guided_grammar``) in
llguidance's Lark dialect, which the core compiles.

A grammar is GBNF when a rule is defined with ``::=`` (outside quotes); it is then rewritten
token by token: each ``name ::= ...`` becomes a Lark rule (``root`` is ``start``; the others
get an ``r_`` prefix so none clashes with Lark's own names, and keep their lower-case letters and
digits, each other character written as ``_`` and a letter, so names that differ only in case or
in ``-`` against ``_`` stay apart), quoted literals stay literals, a character class ``[...]`` and
``.`` become regular expressions, and grouping, ``|``, ``*``, ``+``, ``?`` and ``{m,n}`` repeats
are kept (llguidance reads the GBNF repeat form). Escapes are llama.cpp's (``\\x``, ``\\u``,
``\\U``, ``\\t \\r \\n \\\\ \\" \\[ \\] \\-``), read into characters and written
out again in Lark's and the regular expressions' own forms: a class's members are plain
characters (``[``, ``&&`` or ``~~`` in one are not the set operations of the regex engine).
``#`` starts a comment. Anything else is a ``ValueError`` naming where it is. A grammar without
``::=`` is returned as it is (Lark)."""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_DEFINES = re.compile(r"\s*::=")
_REPEAT = re.compile(r"\{\s*\d*\s*(,\s*\d*\s*)?\}")


def is_gbnf(grammar: str) -> bool:
    """Whether ``grammar`` defines a rule with ``::=`` outside a quoted literal."""
    unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', '""', grammar)
    return re.search(r"^\s*[A-Za-z0-9_-]+\s*::=", unquoted, re.M) is not None


def to_lark(grammar: str) -> str:
    """``grammar`` in Lark: rewritten if it is GBNF, else unchanged."""
    if not is_gbnf(grammar):
        return grammar
    out: list[str] = []
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c.isspace():  # a rule may span lines; rules are split where each is defined
            if out and out[-1] != " ":
                out.append(" ")
            i += 1
        elif c == "#":
            while i < n and grammar[i] != "\n":
                i += 1
        elif c == '"':
            j = _end_of_literal(grammar, i)
            out.append(_literal(_chars(grammar, i + 1, j - 1)))
            i = j
        elif c == "[":
            j = _end_of_class(grammar, i)
            out.append(_class(grammar, i, j))
            i = j
        elif c == ".":
            out.append(r"/[\s\S]/")
            i += 1
        elif c in "()|*+?":
            out.append(c)
            i += 1
        elif c == "{":
            m = _REPEAT.match(grammar, i)
            if m is None:
                raise ValueError(f"GBNF grammar: a repeat {{m,n}} expected at character {i}")
            out.append(re.sub(r"\s", "", m.group()))
            i = m.end()
        elif (m := _NAME.match(grammar, i)) is not None:
            name = _rule(m.group())
            d = _DEFINES.match(grammar, m.end())
            if d is not None:  # a new rule: each on a line of its own in Lark
                out.append(f"\n{name}:")
                i = d.end()
            else:
                out.append(name)
                i = m.end()
        else:
            raise ValueError(f"GBNF grammar: unexpected {c!r} at character {i}")
    return "\n".join(line.strip() for line in "".join(out).strip().splitlines()) + "\n"


def _rule(name: str) -> str:
    """A GBNF rule's Lark name: one name for one GBNF name, whatever its case."""
    if name == "root":
        return "start"
    code = {"-": "_0", "_": "_1"}
    return "r_" + "".join(c if c.islower() or c.isdigit() else code.get(c, "_" + c.lower()) for c in name)


_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
_HEX = {"x": 2, "u": 4, "U": 8}


def _char(text: str, i: int) -> tuple[str, int]:
    """The character at ``text[i]``, an escape read as llama.cpp reads it, and where the next
    one starts."""
    if text[i] != "\\":
        return text[i], i + 1
    e = text[i + 1 : i + 2]
    if e in _ESCAPES:
        return _ESCAPES[e], i + 2
    digits = text[i + 2 : i + 2 + _HEX.get(e, 0)]
    if e in _HEX and len(digits) == _HEX[e] and all(d in "0123456789abcdefABCDEF" for d in digits):
        code = int(digits, 16)
        if code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF:
            return chr(code), i + 2 + len(digits)
    raise ValueError(f"GBNF grammar: an unknown escape at character {i}")


def _chars(text: str, i: int, end: int) -> str:
    out = []
    while i < end:
        c, i = _char(text, i)
        out.append(c)
    return "".join(out)


def _literal(value: str) -> str:
    """``value`` as a Lark string literal."""

    def one(c: str) -> str:
        if c in '"\\':
            return "\\" + c
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 32 else c)

    return '"' + "".join(one(c) for c in value) + '"'


def _class(text: str, i: int, end: int) -> str:
    """The class ``text[i:end]`` (``[`` to ``]``) as a Lark regular expression whose members are
    written as code points."""
    j, out = i + 1, ["/["]
    if text[j] == "^":
        out.append("^")
        j += 1
    while j < end - 1:
        c, j = _char(text, j)
        out.append(f"\\x{{{ord(c):x}}}")
        if text[j] == "-" and j + 1 < end - 1:
            c, j = _char(text, j + 1)
            out.append(f"-\\x{{{ord(c):x}}}")
    return "".join(out) + "]/"


def _end_of_literal(text: str, i: int) -> int:
    j = i + 1
    while j < len(text) and text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    if j >= len(text):
        raise ValueError(f"GBNF grammar: the literal at character {i} is not closed")
    return j + 1


def _end_of_class(text: str, i: int) -> int:
    j = i + 1
    if j < len(text) and text[j] == "^":
        j += 1
    if j < len(text) and text[j] == "]":  # a leading ] is a member
        j += 1
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    if j >= len(text):
        raise ValueError(f"GBNF grammar: the character class at character {i} is not closed")
    return j + 1
