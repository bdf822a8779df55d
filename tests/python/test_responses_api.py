"""``POST /v1/responses`` (OpenAI's Responses API), in process over ASGI on a tiny Llama with the
tests' byte-level tokenizer (a ChatML template): the same answer as the chat endpoint gives the
same conversation (text, usage, logprobs, function calls and their outputs sent back), OpenAI's
streamed event sequence as the official client reads it, a JSON schema in ``text.format``, what
is refused by name, and a request that fails mid-stream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from safetensors.torch import load_file, save_file
from tiny_models import build

from ferryman import Engine
from ferryman.outputs import Logprob
from ferryman.server.app import build_app
from ferryman.server.async_engine import AsyncEngine
from ferryman.server.updates import Delta, Update

GREEDY = {"temperature": 0, "max_output_tokens": 8}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": CITY}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = build("llama", tmp_path_factory.mktemp("responses"), tokenizer=True, max_position_embeddings=2048)
    eng = Engine(str(path), block_size=4, num_device_blocks=1024, calibrate=False)
    with TestClient(build_app(AsyncEngine(eng), "tiny")) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)


def respond(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def chat(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def events(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/v1/responses", json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    kinds, datas = lines[0::2], lines[1::2]
    out = [json.loads(d.removeprefix("data: ")) for d in datas]
    assert [k.removeprefix("event: ") for k in kinds] == [e["type"] for e in out]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_a_response_answers_as_the_chat_endpoint_does(client: TestClient, sdk: openai.OpenAI) -> None:
    r = respond(
        client, {"instructions": "Be brief.", "input": "Hello there", **GREEDY, "metadata": {"k": "v"}}
    )
    c = chat(
        client,
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"},
            ],
            "temperature": 0,
            "max_tokens": 8,
        },
    )
    Response.model_validate(r)  # every field OpenAI's own model requires, of its types
    [msg] = r["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"][0]["text"] == c["choices"][0]["message"]["content"]
    assert (r["status"], r["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert msg["status"] == "incomplete" and c["choices"][0]["finish_reason"] == "length"
    u = r["usage"]
    assert (u["input_tokens"], u["output_tokens"], u["total_tokens"]) == (
        c["usage"]["prompt_tokens"],
        8,
        c["usage"]["prompt_tokens"] + 8,
    )
    assert r["object"] == "response" and r["model"] == "tiny" and r["metadata"] == {"k": "v"}
    assert r["id"].startswith("resp_") and msg["id"] == "msg_" + r["id"].removeprefix("resp_")
    assert (r["instructions"], r["max_output_tokens"], r["temperature"], r["store"]) == (
        "Be brief.",
        8,
        0.0,
        False,
    )
    # the official client reads it; a message list with typed parts is the same conversation
    got = sdk.responses.create(
        model="tiny",
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
        temperature=0,
        max_output_tokens=8,
    )
    assert got.output_text == msg["content"][0]["text"] and got.usage is not None
    assert got.usage.input_tokens == u["input_tokens"]


def test_a_streamed_response_is_openais_event_sequence(client: TestClient, sdk: openai.OpenAI) -> None:
    whole = respond(client, {"input": "hi", **GREEDY})["output"][0]["content"][0]["text"]
    evs = events(client, {"input": "hi", **GREEDY})
    for e in evs:
        TypeAdapter(ResponseStreamEvent).validate_python(e)
    kinds = [e["type"] for e in evs]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta") == whole
    assert evs[-4]["text"] == whole and evs[-1]["response"]["output"][0]["content"][0]["text"] == whole
    assert (
        evs[0]["response"]["status"] == "in_progress" and evs[-1]["response"]["usage"]["output_tokens"] == 8
    )
    # a stop string ends it "completed": the client's stream helper then has its final response
    stop = whole[2:4]
    with sdk.responses.stream(
        model="tiny", input="hi", temperature=0, max_output_tokens=8, extra_body={"stop": [stop]}
    ) as s:
        types = [e.type for e in s]
        final = s.get_final_response()
    assert types[-1] == "response.completed" and final.status == "completed"
    assert final.output_text == whole[: whole.index(stop)]


def test_logprobs_come_when_include_asks(client: TestClient) -> None:
    body = {"input": "hi", **GREEDY}
    assert respond(client, body)["output"][0]["content"][0]["logprobs"] is None
    r = respond(client, body | {"include": ["message.output_text.logprobs"], "top_logprobs": 2})
    c = chat(
        client,
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 8}
        | {"logprobs": True, "top_logprobs": 2},
    )
    assert r["output"][0]["content"][0]["logprobs"] == c["choices"][0]["logprobs"]["content"]
    evs = events(client, body | {"include": ["message.output_text.logprobs"], "top_logprobs": 2})
    streamed = [lp for e in evs if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert streamed == c["choices"][0]["logprobs"]["content"]


def test_function_calls_and_their_outputs_round_trip(client: TestClient, sdk: openai.OpenAI) -> None:
    # one call (a list of several runs on with a random model's arguments)
    ask = {
        "input": "Weather in Oslo?",
        "tools": [TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    r = respond(client, ask | {"temperature": 0, "max_output_tokens": 200})
    [call] = r["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and r["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), CITY)
    assert r["tool_choice"] == "required" and r["tools"][0]["name"] == "get_weather"
    assert r["parallel_tool_calls"] is False
    evs = events(client, ask | {"temperature": 0, "max_output_tokens": 200})
    assert [e["type"] for e in evs[2:]] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert evs[3]["delta"] == evs[4]["arguments"] == call["arguments"]
    # the call and its output sent back: the chat endpoint's tool turn, the same prompt and answer
    back = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    again = sdk.responses.create(model="tiny", input=back, tools=[TOOL], temperature=0, max_output_tokens=6)  # type: ignore[arg-type,list-item]
    fn = {"name": "get_weather", "arguments": call["arguments"]}
    c = chat(
        client,
        {
            "messages": [
                back[0],
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": fn}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}],
            "temperature": 0,
            "max_tokens": 6,
        },
    )
    assert again.usage is not None and again.usage.input_tokens == c["usage"]["prompt_tokens"]
    assert again.output_text == (c["choices"][0]["message"]["content"] or "")


def script(monkeypatch: pytest.MonkeyPatch, pieces: list[tuple[str, list[int]]]) -> None:
    """The model's answer, as text pieces and their token ids (each token's logprob -0.5), in
    place of the engine's: what a tiny random model would never write (a call after text)."""

    async def add_all(self: AsyncEngine, prompts: list[Any], params: Any, *_: Any, **__: Any) -> list[Any]:
        async def one() -> Any:
            for i, (text, ids) in enumerate(pieces):
                lps = [{t: Logprob(-0.5)} for t in ids] if params.logprobs is not None else None
                last = i == len(pieces) - 1
                yield Update([Delta(0, text, ids, lps, "stop" if last else None)], last, 5)

        return [one() for _ in prompts]

    monkeypatch.setattr(AsyncEngine, "add_all", add_all)


def test_a_messages_logprobs_are_its_texts_tokens(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Text, then a call: the call's tokens used to be in the message's logprobs (58 where its
    text has 3), and only the 3 streamed. A last token without text (an EOS) adds its logprob in a
    delta of its own: the deltas' logprobs add up to the part's."""
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
    pieces = [(t, [ord(c) for c in t]) for t in ["Hi ", "<tool_call>\n", call, "\n</tool_call>"]]
    script(monkeypatch, pieces)
    ask = {"input": "x", "tools": [TOOL], "include": ["message.output_text.logprobs"]}
    r = respond(client, ask)
    msg, fn = r["output"]
    assert msg["content"][0]["text"] == "Hi " and len(msg["content"][0]["logprobs"]) == 3
    assert fn["type"] == "function_call" and json.loads(fn["arguments"]) == {"city": "Oslo", "unit": "c"}
    evs = events(client, ask)
    deltas = [lp for e in evs if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    [done] = [e for e in evs if e["type"] == "response.output_text.done"]
    assert len(deltas) == len(done["logprobs"]) == 3
    script(monkeypatch, [("ab", [97, 98]), ("", [2])])
    evs = events(client, {"input": "x", "include": ["message.output_text.logprobs"]})
    deltas = [lp for e in evs if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    [done] = [e for e in evs if e["type"] == "response.output_text.done"]
    assert len(deltas) == len(done["logprobs"]) == 3 and done["text"] == "ab"


def test_a_call_nested_too_deeply_to_parse_is_text(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JSON nested past Python's recursion limit in what the model wrote is the answer's text
    (it was a 400 blaming the request, and a stream cut off with no event)."""
    text = "Sure. <tool_call>\n" + "[" * 3000
    script(monkeypatch, [(text, [1])])
    r = respond(client, {"input": "x", "tools": [TOOL]})
    assert r["output"][0]["content"][0]["text"] == text and r["status"] == "completed"
    assert events(client, {"input": "x", "tools": [TOOL]})[-1]["type"] == "response.completed"


def test_a_json_schema_format_constrains_the_text(client: TestClient) -> None:
    fmt = {"type": "json_schema", "name": "place", "schema": CITY, "strict": True}
    r = respond(client, {"input": "hi", "temperature": 0, "max_output_tokens": 200, "text": {"format": fmt}})
    assert r["status"] == "completed" and r["text"]["format"]["name"] == "place"
    jsonschema.validate(json.loads(r["output"][0]["content"][0]["text"]), CITY)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id is not supported"),
        ({"input": "hi", "background": True}, "background: Input should be False"),
        ({"input": "hi", "truncation": "auto"}, "truncation: Input should be 'disabled'"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type: Input should be 'function'"),
        (
            {"input": [{"type": "reasoning", "summary": []}]},
            "an input item must be a message, a function_call",
        ),
        ({"input": []}, "input.items: List should have at least 1 item"),
        ({"input": 5}, "input must be a string or a list of input items"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include.0: Input should be"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(
    client: TestClient, body: dict[str, Any], said: str
) -> None:
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert said in err["message"] and err["type"] == "invalid_request_error"


def test_a_request_that_fails_mid_stream_ends_with_error_and_response_failed(
    tmp_path: Path,
) -> None:
    """A prompt over a NaN embedding row fails its request (non-finite logits): 500 whole, and
    streamed an ``error`` event then ``response.failed``; the next request is served."""
    path = build("llama", tmp_path, tokenizer=True)
    eng = Engine(str(path), block_size=4, num_device_blocks=64, calibrate=False)
    [poison] = eng.tokenizer.encode("~", add_special_tokens=False)
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][poison] = float("nan")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    eng = Engine(str(path), block_size=4, num_device_blocks=64, calibrate=False)
    with TestClient(build_app(AsyncEngine(eng), "tiny")) as c:
        r = c.post("/v1/responses", json={"input": "a~b", **GREEDY})
        assert r.status_code == 500 and "not finite" in r.json()["error"]["message"]
        evs = events(c, {"input": "a~b", **GREEDY})
        assert [e["type"] for e in evs] == [
            "response.created",
            "response.in_progress",
            "error",
            "response.failed",
        ]
        assert "not finite" in evs[2]["message"] and evs[3]["response"]["status"] == "failed"
        assert "not finite" in evs[3]["response"]["error"]["message"]
        assert respond(c, {"input": "ab", **GREEDY})["usage"]["output_tokens"] == 8
