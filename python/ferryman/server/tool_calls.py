"""Tool calls read back out of a chat answer (the formats and choices of ``tools.py``): whole
(``parse``), or as a stream (``Streamer``: content as it comes until a call may begin, the calls
at the end). Streamed and whole answers give the same content and calls."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ferryman.server.tools import NamedToolChoice, Parser, ToolChoice

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_OPEN = "<tool_call>"


@dataclass(slots=True)
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _arguments(value: Any) -> str | None:
    """Arguments as JSON text of an object, or None when they are not one: JSON has no NaN or
    Infinity, and a lone surrogate (an escape such as \\udc80) has no UTF-8 to send."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    try:  # ensure_ascii off: as vLLM writes them
        return _utf8(json.dumps(value, ensure_ascii=False, allow_nan=False))
    except ValueError:  # UnicodeEncodeError included
        return None


def _utf8(text: str) -> str:
    text.encode()  # raises on a lone surrogate
    return text


def _call(obj: Any, key: str) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    try:
        _utf8(obj["name"])
    except ValueError:
        return None
    args = _arguments(obj.get(key, obj.get("arguments", obj.get("parameters", {}))))
    return None if args is None else Call(obj["name"], args)


def parse(text: str, choice: ToolChoice, parser: Parser) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole answer; an answer that does not hold well-formed calls is all
    content, one nested too deeply for json to read or write too (what the model wrote is never
    the request's fault)."""
    try:
        return _parse(text, choice, parser)
    except RecursionError:
        return text, []


def _parse(text: str, choice: ToolChoice, parser: Parser) -> tuple[str | None, list[Call]]:
    if isinstance(choice, NamedToolChoice):
        args = _arguments(text)
        return (text, []) if args is None else (None, [Call(choice.function.name, args)])
    if choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        each = [_call(i, "parameters") for i in items] if isinstance(items, list) else []
        if not each or None in each:  # all or none, as auto's
            return text, []
        return None, [c for c in each if c is not None]
    if choice == "none":
        return text, []
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        found: list[Call] = []
        decoder, at = json.JSONDecoder(), 0
        while at < len(body):  # objects one after another, ";" between them (not inside strings)
            try:
                obj, at = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            c = _call(obj, "parameters")
            if c is None:
                return text, []
            found.append(c)
            while at < len(body) and (body[at].isspace() or body[at] == ";"):
                at += 1
        return None, found
    start = text.find(_OPEN)
    if start < 0:
        return text, []
    calls = []
    for m in _HERMES.finditer(text, start):
        try:
            c = _call(json.loads(m.group(1)), "arguments")
        except ValueError:
            c = None
        if c is None:
            return text, []
        calls.append(c)
    content = text[:start]  # as streamed: the text before the first call, untouched
    return (content or None), calls  # vLLM's: whitespace before a call is content too


class Streamer:
    """Splits a streamed answer into content deltas and calls. With ``auto``, content streams as
    it comes until a call may begin (``<tool_call>``; for llama3_json an answer that starts with
    ``{`` or ``<|python_tag|>``); from there the text is held and parsed when the sequence
    finishes. The constrained choices hold everything (their answer is the calls). ``one_call``:
    at most the first call (``parallel_tool_calls: false``)."""

    def __init__(self, choice: ToolChoice, parser: Parser, one_call: bool = False) -> None:
        self.choice, self.parser, self.one_call = choice, parser, one_call
        self.text, self.sent = "", 0  # all text so far; characters of it released as content
        self.mode = "content" if choice == "none" else "hold" if choice != "auto" else "open"
        if self.mode == "open" and parser == "llama3_json":
            self.mode = "decide"  # not known until the answer's first characters

    def feed(self, delta: str) -> str:
        """The content to send now for ``delta``."""
        self.text += delta
        if self.mode == "decide":
            head = self.text.lstrip()
            if head.startswith(("{", "<|python_tag|>")):
                self.mode = "hold"
            elif head and not "<|python_tag|>".startswith(head):
                self.mode = "content"
        if self.mode not in ("content", "open"):
            return ""
        end = len(self.text)
        if self.mode == "open":  # hermes: up to a call's tag, or up to what may begin one
            at = self.text.find(_OPEN, self.sent)
            if at >= 0:
                self.mode, end = "hold", at
            else:
                end -= next((k for k in range(len(_OPEN) - 1, 0, -1) if self.text.endswith(_OPEN[:k])), 0)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def step(self, delta: str, finished: bool) -> tuple[str, list[Call]]:
        """The content to send now for ``delta`` and, once ``finished``, the calls (``finish``)."""
        content = self.feed(delta)
        if not finished:
            return content, []
        rest, calls = self.finish()
        return content + rest, calls

    def finish(self) -> tuple[str, list[Call]]:
        """At the end: the content still to send, and the calls."""
        _, calls = parse(self.text, self.choice, self.parser)
        calls = calls[:1] if self.one_call else calls
        if not calls:
            rest, self.sent = self.text[self.sent :], len(self.text)
            return rest, []
        end = self.text.find(_OPEN) if self.choice == "auto" and self.parser == "hermes" else 0
        return (self.text[self.sent : end] if end > self.sent else ""), calls
