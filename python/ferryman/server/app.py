"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncEngine``.

Every error a client can cause is answered with OpenAI's error body ``{"error": {"message",
"type", "param", "code"}}``: 400 for invalid JSON, fields or requests the engine rejects (prompt
longer than ``max_model_len``, a request that can never fit), 404 for an unknown model, 503 when
the bounded waiting queue is full or the engine has stopped. Other requests keep being served.
A client that disconnects has its request aborted and its KV blocks freed within a step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from ferryman.sampling_params import SamplingParams
from ferryman.server import protocol as api
from ferryman.server.async_engine import AsyncEngine, EngineDeadError, Update

T = TypeVar("T")


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.body = (
            status,
            api.ErrorResponse(error=api.ErrorInfo(message=message, type=type_, param=param, code=code)),
        )


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body.model_dump(), status_code=e.status)


def _sse(obj: BaseModel | dict[str, Any]) -> str:
    data = obj.model_dump_json(exclude_none=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


async def _merge(streams: list[AsyncIterator[Update]]) -> AsyncIterator[tuple[int, Update]]:
    """Interleaves several requests' updates as they come; closing it aborts the unfinished."""
    if len(streams) == 1:
        async for u in streams[0]:
            yield 0, u
        return
    q: asyncio.Queue[tuple[int, Update | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[Update]) -> None:
        try:
            async for u in s:
                q.put_nowait((i, u))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs ``work``; cancels it (aborting its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.2)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise ApiError(499, "client disconnected", "client_closed_request")


def build_app(engine: AsyncEngine, served_model_name: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="ferryman", lifespan=lifespan)
    tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.max_model_len

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = list(e.errors())
        if any(err.get("type") == "json_invalid" for err in errs):
            return _error_response(
                ApiError(400, "the request body is not valid JSON", "invalid_request_error")
            )
        fields = [".".join(str(x) for x in err.get("loc", ()) if x != "body") for err in errs]
        msg = "; ".join(f"{f or 'body'}: {err.get('msg')}" for f, err in zip(fields, errs, strict=True))
        param = fields[0] if fields and fields[0] else None
        return _error_response(ApiError(400, msg or "invalid request", "invalid_request_error", param))

    def token_str(t: int) -> str:
        return str(tokenizer.decode([t])) if tokenizer is not None else str(t)

    def check(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        if engine.error is not None:
            raise ApiError(503, f"engine stopped: {engine.error!r}", "server_error")
        if engine.overloaded():
            raise ApiError(
                503, "server overloaded: the waiting queue is full, retry later", "server_overloaded"
            )

    async def submit(
        prefix: str, prompts: list[str | list[int]], params: SamplingParams
    ) -> tuple[str, list[AsyncIterator[Update]]]:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        arrival = time.monotonic()
        streams: list[AsyncIterator[Update]] = []
        try:
            for i, p in enumerate(prompts):
                streams.append(await engine.add(f"{rid}-{i}", p, params, arrival))
        except EngineDeadError as e:
            await _close(streams)
            raise ApiError(503, str(e), "server_error") from None
        except ValueError as e:  # InvalidRequestError and bad sampling values
            await _close(streams)
            raise ApiError(400, str(e), "invalid_request_error") from None
        return rid, streams

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(engine.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> api.ModelList:
        return api.ModelList(data=[api.ModelCard(id=served_model_name, max_model_len=max_model_len)])

    @app.get("/metrics")
    async def metrics() -> Response:
        if engine.metrics is None:
            raise ApiError(404, "metrics are off", "invalid_request_error")
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: api.CompletionRequest, request: Request) -> Response | api.CompletionResponse:
        check(body.model)
        params = _params(body.sampling_params)
        prompts = body.prompts()
        if not prompts:
            raise ApiError(400, "prompt must not be empty", "invalid_request_error", "prompt")
        rid, streams = await submit("cmpl", prompts, params)
        n = params.n
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage

            async def events() -> AsyncIterator[str]:
                prompt_tokens, completion_tokens = {}, 0
                try:
                    async for i, u in _merge(streams):
                        prompt_tokens[i] = u.num_prompt_tokens
                        choices = []
                        for d in u.deltas:
                            completion_tokens += len(d.token_ids)
                            lp = _completion_logprobs(d.token_ids, d.logprobs, token_str, 0)
                            choices.append(
                                api.CompletionChoice(
                                    index=i * n + d.index,
                                    text=d.text,
                                    logprobs=lp,
                                    finish_reason=d.finish_reason,
                                )
                            )
                        if choices:
                            yield _sse(
                                api.CompletionResponse(id=rid, model=served_model_name, choices=choices)
                            )
                    if include_usage:
                        usage = _usage(sum(prompt_tokens.values()), completion_tokens)
                        yield _sse(
                            api.CompletionResponse(id=rid, model=served_model_name, choices=[], usage=usage)
                        )
                except EngineDeadError as e:
                    yield _sse(ApiError(503, str(e), "server_error").body)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async def collect() -> api.CompletionResponse:
            acc = await _accumulate(streams, n)
            choices = [
                api.CompletionChoice(
                    index=c,
                    text="".join(acc.text.get(c, [])),
                    logprobs=_completion_logprobs(
                        acc.toks.get(c, []),
                        acc.lps.get(c) if params.logprobs is not None else None,
                        token_str,
                        0,
                    ),
                    finish_reason=acc.reasons.get(c),
                )
                for c in range(len(prompts) * n)
            ]
            return api.CompletionResponse(id=rid, model=served_model_name, choices=choices, usage=acc.usage())

        return await _run_collect(request, collect(), streams)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(
        body: api.ChatCompletionRequest, request: Request
    ) -> Response | api.ChatCompletionResponse:
        check(body.model)
        params = _params(body.sampling_params)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template", "invalid_request_error", "messages")
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = str(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
        except Exception as e:  # the template itself rejects the conversation
            raise ApiError(400, f"chat template: {e}", "invalid_request_error", "messages") from None
        rid, streams = await submit("chatcmpl", [prompt], params)
        want_lp, top_n = params.logprobs is not None, params.logprobs or 0
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage

            async def events() -> AsyncIterator[str]:
                started: set[int] = set()
                prompt_tokens, completion_tokens = 0, 0
                try:
                    async for _, u in _merge(streams):
                        prompt_tokens = u.num_prompt_tokens
                        choices = []
                        for d in u.deltas:
                            completion_tokens += len(d.token_ids)
                            role: Any = None if d.index in started else "assistant"
                            started.add(d.index)
                            lp = (
                                _chat_logprobs(d.token_ids, d.logprobs, token_str, top_n) if want_lp else None
                            )
                            choices.append(
                                api.ChatChunkChoice(
                                    index=d.index,
                                    delta=api.DeltaMessage(role=role, content=d.text),
                                    logprobs=lp,
                                    finish_reason=d.finish_reason,
                                )
                            )
                        if choices:
                            yield _sse(
                                api.ChatCompletionChunk(id=rid, model=served_model_name, choices=choices)
                            )
                    if include_usage:
                        usage = _usage(prompt_tokens, completion_tokens)
                        yield _sse(
                            api.ChatCompletionChunk(id=rid, model=served_model_name, choices=[], usage=usage)
                        )
                except EngineDeadError as e:
                    yield _sse(ApiError(503, str(e), "server_error").body)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async def collect() -> api.ChatCompletionResponse:
            acc = await _accumulate(streams, params.n)
            choices = [
                api.ChatChoice(
                    index=k,
                    message=api.AssistantMessage(content="".join(acc.text.get(k, []))),
                    logprobs=_chat_logprobs(acc.toks.get(k, []), acc.lps.get(k), token_str, top_n)
                    if want_lp
                    else None,
                    finish_reason=acc.reasons.get(k),
                )
                for k in range(params.n)
            ]
            return api.ChatCompletionResponse(
                id=rid, model=served_model_name, choices=choices, usage=acc.usage()
            )

        return await _run_collect(request, collect(), streams)

    return app


@dataclass(slots=True)
class _Accumulated:
    """A non-streamed response's choices, by choice index (prompt * n + sequence)."""

    text: dict[int, list[str]] = field(default_factory=dict)
    toks: dict[int, list[int]] = field(default_factory=dict)
    lps: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    reasons: dict[int, str | None] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)

    def usage(self) -> api.Usage:
        return _usage(sum(self.prompt_tokens.values()), sum(len(t) for t in self.toks.values()))


async def _accumulate(streams: list[AsyncIterator[Update]], n: int) -> _Accumulated:
    acc = _Accumulated()
    async for i, u in _merge(streams):
        acc.prompt_tokens[i] = u.num_prompt_tokens
        for d in u.deltas:
            c = i * n + d.index
            acc.text.setdefault(c, []).append(d.text)
            acc.toks.setdefault(c, []).extend(d.token_ids)
            acc.lps.setdefault(c, []).extend(d.logprobs or [])
            acc.reasons[c] = d.finish_reason
    return acc


def _params(make: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return make()
    except ValueError as e:
        raise ApiError(400, str(e), "invalid_request_error") from None


async def _close(streams: list[AsyncIterator[Update]]) -> None:
    for s in streams:
        await s.aclose()  # type: ignore[attr-defined]


async def _run_collect(request: Request, work: Awaitable[T], streams: list[AsyncIterator[Update]]) -> T:
    try:
        return await _until_disconnect(request, work)
    except EngineDeadError as e:
        raise ApiError(503, str(e), "server_error") from None
    finally:
        await _close(streams)


def _usage(prompt: int, completion: int) -> api.Usage:
    return api.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _completion_logprobs(
    toks: list[int], lps: list[dict[int, float]] | None, token_str: Callable[[int], str], offset: int
) -> api.CompletionLogprobs | None:
    if lps is None:
        return None
    out = api.CompletionLogprobs()
    for t, d in zip(toks, lps, strict=False):
        out.tokens.append(token_str(t))
        out.token_logprobs.append(d[t])
        out.top_logprobs.append({token_str(k): v for k, v in d.items()})
        out.text_offset.append(offset)
        offset += len(out.tokens[-1])
    return out


def _chat_logprobs(
    toks: list[int], lps: list[dict[int, float]] | None, token_str: Callable[[int], str], top_n: int
) -> api.ChatLogprobs | None:
    if lps is None:
        return None
    content = []
    for t, d in zip(toks, lps, strict=False):
        s = token_str(t)
        top = sorted(d.items(), key=lambda kv: -kv[1])
        content.append(
            api.ChatTokenLogprob(
                token=s,
                logprob=d[t],
                bytes=list(s.encode()),
                top_logprobs=[
                    api.TopLogprob(token=token_str(k), logprob=v, bytes=list(token_str(k).encode()))
                    for k, v in top[:top_n]
                ],
            )
        )
    return api.ChatLogprobs(content=content)
