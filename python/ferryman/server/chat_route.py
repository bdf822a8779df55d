"""``POST /v1/chat/completions``: messages through the model's chat template (with ``tools``,
``tools.py``), one request of ``n`` sequences, answered whole or streamed. With tools, each
choice's text is split into content and ``tool_calls`` (``finish_reason: "tool_calls"`` when
the model chose to call, ``"stop"`` for a forced named function, as OpenAI answers); streamed,
content goes out as it comes and each call as one delta once the sequence ends."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ferryman.sampling_params import SamplingParams
from ferryman.server import handling, responses, tool_calls, tools
from ferryman.server import protocol as api
from ferryman.server.async_engine import Delta, Update
from ferryman.server.errors import generation

# submit(id prefix, prompts, params, add_special_tokens)
Submit = Callable[
    [str, list[str | list[int]], SamplingParams, bool], Awaitable[tuple[str, list[AsyncIterator[Update]]]]
]


def _calls(calls: list[tool_calls.Call]) -> list[api.ToolCall]:
    return [
        api.ToolCall(id=c.id, function=api.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
    ]


def _reason(reason: str | None, calls: list[tool_calls.Call], choice: tools.ToolChoice) -> str | None:
    forced = isinstance(choice, tools.NamedToolChoice)
    return "tool_calls" if calls and reason == "stop" and not forced else reason


@dataclass
class ChatRoutes:
    """What the routes that render the chat template share (``/v1/chat/completions``,
    ``/v1/responses``): the engine's tokenizer and sampling defaults (generation_config.json), the
    served name, the admission check, ``submit``, how logprobs name a token, and what is built
    once from the tokenizer: the parser of calls in the text and the tokens' bytes."""

    tokenizer: Any
    served_model_name: str
    check: Callable[[str | None], None]
    submit: Submit
    token_str: Callable[[int], str]
    defaults: dict[str, Any]
    parser: tools.Parser = field(init=False)
    token_bytes: responses.TokenBytesOf = field(init=False)

    def __post_init__(self) -> None:
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        self.parser = tools.pick_parser(template if isinstance(template, str) else None)
        self.token_bytes = responses.TokenBytesOf(self.tokenizer)  # its table parsed on first use


def add_chat_route(app: FastAPI, ctx: ChatRoutes) -> None:
    @app.post("/v1/chat/completions", response_model=None, responses=generation(api.ChatCompletionResponse))
    async def chat(
        body: api.ChatCompletionRequest, request: Request
    ) -> Response | api.ChatCompletionResponse:
        ctx.check(body.model)
        params = handling.params(lambda: body.sampling_params(ctx.defaults))
        choice = body.effective_tool_choice()
        prompt = body.render(ctx.tokenizer)
        rid, streams = await ctx.submit("chatcmpl", [prompt], params, body.add_special_tokens)
        created = int(time.time())  # one creation time for every chunk of a stream
        name = responses.token_namer(ctx.token_str, body.return_tokens_as_token_ids)
        want_lp, top_n = params.logprobs is not None, params.logprobs or 0
        raw = ctx.token_bytes.get() if want_lp else None
        with_tools = bool(body.tools) and choice != "none"
        one_call = body.parallel_tool_calls is False  # at most one call, whatever the model wrote
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
            split = (
                {k: tool_calls.Streamer(choice, ctx.parser, one_call) for k in range(params.n)}
                if with_tools
                else {}
            )

            def chunk_choice(_: int, d: Delta, __: Update) -> api.ChatChunkChoice | None:
                lp = responses.chat_logprobs(d.token_ids, d.logprobs, name, top_n, raw) if want_lp else None
                content: str | None = d.text
                calls: list[tool_calls.Call] = []
                if with_tools:
                    text, calls = split[d.index].step(d.text, d.finish_reason is not None)
                    content = text or None
                delta_calls = [
                    api.DeltaToolCall(
                        index=j, id=c.id, function=api.FunctionCall(name=c.name, arguments=c.arguments)
                    )
                    for j, c in enumerate(calls)
                ]
                reason = _reason(d.finish_reason, calls, choice)
                if content is None and not delta_calls and lp is None and reason is None:
                    return None  # the text is held back (it may start a tool call): no empty chunk
                return api.ChatChunkChoice(
                    index=d.index,
                    delta=api.DeltaMessage(content=content, tool_calls=delta_calls or None),
                    logprobs=lp,
                    finish_reason=reason,
                    stop_reason=d.stop_reason,
                )

            def chunk(choices: list[Any], usage: api.Usage | None) -> api.ChatCompletionChunk:
                return api.ChatCompletionChunk(
                    id=rid, created=created, model=ctx.served_model_name, choices=choices, usage=usage
                )

            # a role-only chunk per choice first, as OpenAI and vLLM send (the openai client
            # counted the logprobs of a first chunk that carried them twice)
            hello = api.DeltaMessage(role="assistant", content="")
            opening = [api.ChatChunkChoice(index=k, delta=hello) for k in range(params.n)]
            events = responses.sse_events(streams, chunk_choice, chunk, include_usage, continuous, opening)
            return StreamingResponse(events, media_type="text/event-stream")

        async def collect() -> api.ChatCompletionResponse:
            acc = await responses.accumulate(streams, params.n)
            choices = []
            for k in range(params.n):
                text: str | None = "".join(acc.text.get(k, []))
                calls: list[tool_calls.Call] = []
                if with_tools:
                    text, calls = tool_calls.parse(text or "", choice, ctx.parser)
                    calls = calls[:1] if one_call else calls
                choices.append(
                    api.ChatChoice(
                        index=k,
                        message=api.AssistantMessage(content=text, tool_calls=_calls(calls) or None),
                        logprobs=responses.chat_logprobs(
                            acc.toks.get(k, []), acc.lps.get(k), name, top_n, raw
                        )
                        if want_lp
                        else None,
                        finish_reason=_reason(acc.reasons.get(k), calls, choice),
                        stop_reason=acc.stop_reasons.get(k),
                    )
                )
            return api.ChatCompletionResponse(
                id=rid, created=created, model=ctx.served_model_name, choices=choices, usage=acc.usage()
            )

        return await handling.run_collect(request, collect(), streams)
