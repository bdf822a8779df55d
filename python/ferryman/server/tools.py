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

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from ferryman.chat_template import object_arguments
from ferryman.sampling_params import StructuredOutputsParams
from ferryman.server.schema_types import Body

Parser = Literal["hermes", "llama3_json"]


class Function(Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """OpenAI's rule: the arguments are an object (a call's other output could never parse)."""
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(
                f"a function's parameters must be a JSON Schema of type object, got {v['type']!r}"
            )
        return v


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
        defs: dict[str, Any] = {}
        one = [
            {
                "type": "object",
                "properties": {
                    "name": {"enum": [t.function.name]},
                    "parameters": _hoist(params(t.function), t.function.name, defs),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one}}
        if defs:
            calls["$defs"] = defs
        return StructuredOutputsParams(json=calls | ({} if parallel else {"maxItems": 1}))
    return None


def _hoist(schema: dict[str, Any], tool: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` nested under the list of calls, where its local references (``#...``) would
    point into the calls' schema instead: a schema that has any moves to the root's ``$defs`` as
    ``{tool}``, its ``$defs`` / ``definitions`` as ``{tool}__{name}``, and every local reference
    follows (``#`` itself, ``#/$defs/x/...``, ``#/properties/...``); it is then a reference."""
    text = json.dumps(schema)
    if '"$ref": "#' not in text:
        return schema
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}

    def ref(r: str) -> str:
        parts = r.removeprefix("#").split("/")  # "", kind, name, rest...
        if len(parts) >= 3 and parts[1] in ("$defs", "definitions") and parts[2] in local:
            return "/".join([f"#/$defs/{tool}__{parts[2]}", *parts[3:]])
        return f"#/$defs/{tool}" + r.removeprefix("#").rstrip("/") if r.startswith("#") else r

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: ref(x) if k == "$ref" and isinstance(x, str) else walk(x) for k, x in v.items()}
        return [walk(x) for x in v] if isinstance(v, list) else v

    for k, d in local.items():
        defs[f"{tool}__{k}"] = walk(d)
    defs[tool] = walk({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})  # its $ref too
    return {"$ref": f"#/$defs/{tool}"}


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
    msgs = object_arguments(messages)
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
