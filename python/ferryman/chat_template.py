"""Rendering a chat template with jinja2 alone, the way transformers' ``apply_chat_template``
renders it, so that a tokenizer needs no transformers import to build chat prompts.

The environment matches transformers': jinja2's immutable sandbox with ``trim_blocks`` and
``lstrip_blocks``, the loop-control extension, a ``{% generation %}`` block that renders its body
in its own scope, ``tojson`` as ``json.dumps`` (not HTML-escaped; ``indent``, ``separators``,
``sort_keys`` and ``ensure_ascii`` as keywords), and the globals ``raise_exception`` (a
``TemplateError``), ``strftime_now``, ``dict`` and ``namespace`` (refusing names that start with
``_``). The template sees ``messages`` (each message's ``None``-valued keys dropped; a reasoning
text under ``reasoning_content``, ``thinking`` or ``reasoning`` is given under the first two as
well), ``tools`` and ``documents`` (``None`` when not given), ``add_generation_prompt``, the
tokenizer's named special tokens and any extra keywords, which win over the special tokens.

Invariants: inputs are plain JSON data (dicts, lists, tuples, str, int, float, bool, None), copied
before rendering; anything else is a ``TypeError`` naming its type. A template is compiled once
per text (cached).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the first is what templates read


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with it):
    renders the body as a call block does."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 reads it as a plain attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        block = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
        return block.set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template's namespace cannot hold {name!r}")


class _Namespace(jinja2.utils.Namespace):
    """jinja2's ``namespace()`` without underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature: any keyword may be an attribute
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        super().__setitem__(name, value)


class _DictBuilder:
    """The template's ``dict``: builds dicts, exposes nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise, strftime_now=_strftime_now, dict=_DictBuilder(), namespace=_Namespace
    )
    return env.from_string(template)


def plain(value: Any) -> Any:
    """A copy of JSON-like ``value`` built from the base types only (subclasses of str, int,
    float and Mapping become those types); ``TypeError`` for anything else."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    raise TypeError(f"a chat template takes JSON-like data, not {type(value).__name__}")


def _message(m: Any) -> dict[str, Any]:
    if not isinstance(m, Mapping):
        raise TypeError(f"a chat message is a dict, not {type(m).__name__}")
    msg = {k: v for k, v in plain(m).items() if v is not None}
    reasoning = next((msg[k] for k in REASONING_KEYS if k in msg), None)
    if reasoning is not None:  # under both names templates read, a given "thinking" kept
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


def render(
    template: str,
    messages: list[Any],
    tools: list[Any] | None = None,
    add_generation_prompt: bool = False,
    special_tokens: Mapping[str, str] | None = None,
    documents: list[Any] | None = None,
    **kwargs: Any,
) -> str:
    """The text of ``template`` over one conversation (see the module docstring for what the
    template sees). An empty conversation is a ``ValueError``; a template that rejects the
    conversation raises jinja2's ``TemplateError``."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise TypeError("tools are JSON schemas (dicts)")
    extra = plain({**(special_tokens or {}), **kwargs})
    return compile_template(template).render(
        messages=[_message(m) for m in messages],
        tools=plain(tools),
        documents=plain(documents),
        add_generation_prompt=add_generation_prompt,
        **extra,
    )


def developer_as_system(turns: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """OpenAI's "developer" turns as "system" ones, unless the template names the developer role
    (most templates know only system, and some add their default system prompt beside a role they
    do not know)."""
    if "developer" in template:
        return turns
    return [t | {"role": "system"} if t.get("role") == "developer" else t for t in turns]


def object_arguments(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns with each earlier tool call's ``arguments`` (OpenAI's JSON text) as an object, as
    templates expect (Qwen's and Llama's write them with ``tojson``), and an empty ``tool_calls``
    dropped: vLLM's rule for ``LLM.chat`` and its server. Arguments that are not JSON stay text."""
    out = []
    for t in turns:
        calls = t.get("tool_calls")
        if isinstance(calls, list) and not calls:
            t = {k: v for k, v in t.items() if k != "tool_calls"}
        elif isinstance(calls, list):
            t = t | {"tool_calls": [_object_call(c) for c in calls]}
        out.append(t)
    return out


def _object_call(call: Any) -> Any:
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("arguments"), str):
        return call
    try:
        return call | {"function": f | {"arguments": json.loads(f["arguments"])}}
    except ValueError:  # not JSON: passed on as it is
        return call


# transformers' marker for continue_final_message: written after the last message's text, found
# in the rendered prompt, cut off there
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def tag_final_message(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns with the marker after the last message's text (a copy; ``open_final_message``
    cuts the rendered prompt there)."""
    last = dict(turns[-1])
    last["content"] = str(last.get("content") or "") + _CONTINUE_TAG
    return [*turns[:-1], last]


def open_final_message(prompt: str) -> str:
    """The conversation rendered from ``tag_final_message``'s turns, cut right after the last
    message's text, so the model continues that message instead of closing it (transformers'
    ``continue_final_message``: the text's trailing whitespace stays unless the template trims
    it)."""
    at = prompt.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not render the last message's text")
    return prompt[:at] if prompt.startswith(_CONTINUE_TAG, at) else prompt[:at].rstrip()
