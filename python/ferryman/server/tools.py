"""Tool calls on ``/v1/chat/completions``: the request's ``tools`` and ``tool_choice``, the prompt
they render into, the constraint ``required`` and a named function put on the output, and the
calls parsed back out of the text (whole, or as a stream).

Formats (``parser``), picked from the chat template: **hermes** (Qwen2.5, Qwen3, SmolLM2 and
other ChatML models: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, text
before them is content) and **llama3_json** (Llama 3.1: the whole answer is ``{"name": ...,
"parameters": {...}}``, several separated by ``;``, maybe after ``<|python_tag|>``). A template
that does not render ``tools`` itself (SmolLM2's) gets them as a Hermes system prompt, the
format its parser reads back; tool results go back as ``<tool_response>`` blocks.

``tool_choice``: ``none`` (no tools in the prompt, nothing parsed), ``auto`` (the model decides;
the answer is parsed), ``required`` (the output is constrained to a JSON list of calls, each a
``{"name", "parameters"}`` object of one of the tools, so it always parses) and a named function
(the output is constrained to that function's ``parameters`` schema: its arguments). The two
constrained forms use the structured-outputs machinery, as vLLM does.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from ferryman.sampling_params import StructuredOutputsParams
from ferryman.server.schema_types import Body

Parser = Literal["hermes", "llama3_json"]
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_OPEN = "<tool_call>"


class Function(Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: Function


class ChoiceName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: ChoiceName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CallFunction(Body):
    name: str
    arguments: str


class ToolCallIn(Body):
    """An earlier assistant turn's call, as the client sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


@dataclass(slots=True)
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def pick_parser(template: str | None) -> Parser:
    """llama3_json for Llama 3.1's template (``<|python_tag|>`` / ``ipython``), else hermes."""
    t = template or ""
    return "llama3_json" if "<|python_tag|>" in t or "ipython" in t else "hermes"


def choose(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolChoice:
    """The effective choice (OpenAI's default: ``auto`` with tools, ``none`` without); a named
    function must be one of the tools, and any choice but ``none`` needs some (else ``ValueError``)."""
    if choice is None:
        return "auto" if tools else "none"
    if not tools and choice != "none":
        name = choice.function.name if isinstance(choice, NamedToolChoice) else choice
        raise ValueError(f"tool_choice {name!r} needs tools")
    if isinstance(choice, NamedToolChoice) and not any(
        t.function.name == choice.function.name for t in tools or []
    ):
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
    return choice


def constraint(
    tools: list[Tool], choice: ToolChoice, parallel: bool = True
) -> StructuredOutputsParams | None:
    """The grammar a choice puts on the output: a named function's arguments, or a list of calls
    (of one call without ``parallel``)."""

    def params(f: Function) -> dict[str, Any]:
        return f.parameters or {"type": "object"}

    if isinstance(choice, NamedToolChoice):
        f = next(t.function for t in tools if t.function.name == choice.function.name)
        return StructuredOutputsParams(json=params(f))
    if choice == "required":
        one = [
            {
                "type": "object",
                "properties": {"name": {"enum": [t.function.name]}, "parameters": params(t.function)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one}}
        return StructuredOutputsParams(json=calls | ({} if parallel else {"maxItems": 1}))
    return None


def hermes_system(tools: list[Tool]) -> str:
    sigs = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
    return (
        "You are a function calling AI model. You are provided with function signatures within "
        "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
        f"Here are the available tools:\n<tools>\n{sigs}\n</tools>\n"
        "For each function call, return a json object with the function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


def render_messages(
    messages: list[dict[str, Any]], tools: list[Tool] | None, choice: ToolChoice, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand the chat template: tools as dicts for a template that renders
    them, else folded into a Hermes system prompt and the turns rewritten in that format. Earlier
    calls' arguments go to the template as objects (as Qwen's and Llama's templates expect)."""
    use = tools if tools and choice != "none" else None
    msgs = [
        {**m, "tool_calls": [_with_object_arguments(c) for c in m["tool_calls"]]}
        if m.get("tool_calls")
        else m
        for m in messages
    ]
    if "tools" in (template or ""):
        return msgs, [t.model_dump(exclude_none=True) for t in use] if use else None
    out: list[dict[str, Any]] = []
    for m in msgs:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        blocks = [
            json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            for c in calls
        ]
        m["content"] = (m.get("content") or "") + "".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
        if m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
            m.pop("tool_call_id", None)
        out.append(m)
    if use:
        system = hermes_system(use)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    f = dict(call["function"])
    with contextlib.suppress(TypeError, ValueError):  # not JSON: passed on as it is
        f["arguments"] = json.loads(f["arguments"])
    return {**call, "function": f}


def _arguments(value: Any) -> str | None:
    """Arguments as JSON text of an object, or None when they are not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value) if isinstance(value, dict) else None


def _call(obj: Any, key: str) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _arguments(obj.get(key, obj.get("arguments", obj.get("parameters", {}))))
    return None if args is None else Call(obj["name"], args)


def parse(text: str, choice: ToolChoice, parser: Parser) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole answer; an answer that does not hold well-formed calls is all
    content."""
    if isinstance(choice, NamedToolChoice):
        args = _arguments(text)
        return (text, []) if args is None else (None, [Call(choice.function.name, args)])
    if choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        calls = [c for c in (_call(i, "parameters") for i in items) if c] if isinstance(items, list) else []
        return (None, calls) if calls else (text, [])
    if choice == "none":
        return text, []
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        found: list[Call] = []
        for part in body.split(";"):
            try:
                c = _call(json.loads(part), "parameters")
            except ValueError:
                return text, []
            if c is None:
                return text, []
            found.append(c)
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
    content = text[:start].strip()
    return content or None, calls


class Streamer:
    """Splits a streamed answer into content deltas and calls. With ``auto``, content streams as
    it comes until a call may begin (``<tool_call>``; for llama3_json an answer that starts with
    ``{`` or ``<|python_tag|>``); from there the text is held and parsed when the sequence
    finishes. The constrained choices hold everything (their answer is the calls)."""

    def __init__(self, choice: ToolChoice, parser: Parser) -> None:
        self.choice, self.parser = choice, parser
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

    def finish(self) -> tuple[str, list[Call]]:
        """At the end: the content still to send, and the calls."""
        _, calls = parse(self.text, self.choice, self.parser)
        if not calls:
            rest, self.sent = self.text[self.sent :], len(self.text)
            return rest, []
        end = self.text.find(_OPEN) if self.choice == "auto" and self.parser == "hermes" else 0
        return (self.text[self.sent : end].rstrip() if end > self.sent else ""), calls
