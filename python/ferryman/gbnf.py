"""GBNF grammars (llama.cpp's, and what vLLM's xgrammar backend takes as ``guided_grammar``) in
llguidance's Lark dialect, which the core compiles.

A grammar is GBNF when a rule is defined with ``::=`` (outside quotes); it is then rewritten
token by token: each ``name ::= ...`` becomes a Lark rule (``root`` is ``start``; other names
are lower-cased, ``-`` becomes ``_``, and each gets an ``r_`` prefix so none clashes with Lark's
own names), quoted literals stay literals (``\\xHH`` escapes become ``\\u00HH``), a character
class ``[...]`` and ``.`` become regular expressions, and grouping, ``|``, ``*``, ``+``, ``?`` and
``{m,n}`` repeats are kept (llguidance reads the GBNF repeat form). ``#`` starts a comment.
Anything else is a ``ValueError`` naming where it is. A grammar without ``::=`` is returned as
it is (Lark)."""

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
            out.append(re.sub(r"\\x([0-9A-Fa-f]{2})", r"\\u00\1", grammar[i:j]))
            i = j
        elif c == "[":
            j = _end_of_class(grammar, i)
            out.append("/" + grammar[i:j].replace("/", "\\/") + "/")
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
    return "start" if name == "root" else "r_" + name.lower().replace("-", "_")


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
