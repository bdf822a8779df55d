"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncEngine``.

Every error a client can cause is answered with OpenAI's error body ``{"error": {"message",
"type", "param", "code"}}``: 400 for invalid JSON, fields or requests the engine rejects (prompt
longer than ``max_model_len``, a request that can never fit), 404 for an unknown model, 503 when
the bounded waiting queue is full, the server is shutting down or the engine has stopped. Other
requests keep being served. A request the engine fails (its logits were not finite, its step
raised) is answered 500 with that body, or, once streaming, ends with an error event and
``[DONE]``. A client that disconnects has its request aborted and its KV blocks freed within a
step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from ferryman.sampling_params import SamplingParams
from ferryman.server import protocol as api
from ferryman.server import responses
from ferryman.server.async_engine import (
    AsyncEngine,
    Delta,
    DrainingError,
    EngineDeadError,
    RequestFailedError,
    Update,
)

T = TypeVar("T")

# The answers the schema publishes besides 200: errors in OpenAI's body (and no FastAPI 422: a
# body the request models refuse gets 400).
_ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": api.ErrorResponse, "description": "Refused: 400 invalid, 404 unknown model"},
    "5XX": {"model": api.ErrorResponse, "description": "Failed, overloaded, draining or stopped"},
}


def _generation(body: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    ok = {"model": body, "content": {"text/event-stream": {}}, "description": "The body, or its SSE stream"}
    return {200: ok, **_ERRORS}


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


async def _sse_events(
    streams: list[AsyncIterator[Update]],
    choice: Callable[[int, Delta], Any],
    chunk: Callable[[list[Any], api.Usage | None], Any],
    include_usage: bool,
) -> AsyncIterator[str]:
    """A streamed response's events: one chunk per update that has deltas (``choice`` maps the
    prompt index and a delta to a choice), the usage chunk when asked, then ``[DONE]``; an engine
    that dies or fails the request mid-stream ends it with an error event, then ``[DONE]``."""
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    try:
        async for i, u in responses.merge(streams):
            prompt_tokens[i] = u.num_prompt_tokens
            completion_tokens += sum(len(d.token_ids) for d in u.deltas)
            if u.deltas:
                yield responses.sse(chunk([choice(i, d) for d in u.deltas], None))
        if include_usage:
            yield responses.sse(chunk([], responses.usage(sum(prompt_tokens.values()), completion_tokens)))
    except EngineDeadError as e:
        yield responses.sse(ApiError(503, str(e), "server_error").body)
    except RequestFailedError as e:
        yield responses.sse(ApiError(500, str(e), "server_error").body)
    yield "data: [DONE]\n\n"


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

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        """What FastAPI answers itself (a body it cannot decode, an unknown path, a method the
        path does not serve), in OpenAI's error body too."""
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        response = _error_response(ApiError(e.status_code, str(e.detail), type_))
        response.headers.update(e.headers or {})
        return response

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

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def check(model: str | None) -> None:
        check_model(model)
        if engine.error is not None:
            raise ApiError(503, f"engine stopped: {engine.error!r}", "server_error")
        if engine.draining:
            raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
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
        except DrainingError as e:
            await _close(streams)
            raise ApiError(503, str(e), "server_error", code="shutting_down") from None
        except ValueError as e:  # InvalidRequestError and bad sampling values
            await _close(streams)
            raise ApiError(400, str(e), "invalid_request_error") from None
        return rid, streams

    @app.get("/health", responses={503: {"description": "Draining, or the engine stopped"}})
    async def health() -> Response:
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(engine.error)}, status_code=503)
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def need_tokenizer(model: str | None) -> Any:
        check_model(model)
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", "invalid_request_error")
        return tokenizer

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: api.TokenizeRequest) -> api.TokenizeResponse:
        """vLLM's: the ids of a text prompt, or of chat messages through the model's template."""
        tok = need_tokenizer(body.model)
        if isinstance(body, api.TokenizeChatRequest):
            if not getattr(tok, "chat_template", None):
                raise ApiError(400, "this model has no chat template", "invalid_request_error", "messages")
            msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = str(
                tok.apply_chat_template(
                    msgs, add_generation_prompt=body.add_generation_prompt, tokenize=False
                )
            )
            ids = list(tok.encode(text, add_special_tokens=False))
        else:
            ids = list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return api.TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: api.DetokenizeRequest) -> api.DetokenizeResponse:
        tok = need_tokenizer(body.model)
        vocab = engine.engine.model.cfg.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"token id {bad} out of range [0, {vocab})", "invalid_request_error", "tokens"
            )
        return api.DetokenizeResponse(prompt=str(tok.decode(body.tokens)))

    @app.get("/tokenizer_info", responses=_ERRORS)
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's: what a client needs to tokenize as the server does (lm-eval probes it)."""
        tok = need_tokenizer(None)
        info: dict[str, Any] = {"tokenizer_class": type(tok).__name__, "model_max_length": max_model_len}
        for k in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template"):
            v = getattr(tok, k, None)
            if v is not None:
                info[k] = str(v)
        return info

    @app.get("/v1/models", responses=_ERRORS)
    async def models() -> api.ModelList:
        return api.ModelList(data=[api.ModelCard(id=served_model_name, max_model_len=max_model_len)])

    @app.get(
        "/metrics",
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}, **_ERRORS},
    )
    async def metrics() -> Response:
        if engine.metrics is None:
            raise ApiError(404, "metrics are off", "invalid_request_error")
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", response_model=None, responses=_generation(api.CompletionResponse))
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

            def choice(i: int, d: Delta) -> api.CompletionChoice:
                lp = responses.completion_logprobs(d.token_ids, d.logprobs, token_str, 0)
                return api.CompletionChoice(
                    index=i * n + d.index, text=d.text, logprobs=lp, finish_reason=d.finish_reason
                )

            def chunk(choices: list[Any], usage: api.Usage | None) -> api.CompletionResponse:
                return api.CompletionResponse(id=rid, model=served_model_name, choices=choices, usage=usage)

            events = _sse_events(streams, choice, chunk, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")

        async def collect() -> api.CompletionResponse:
            acc = await responses.accumulate(streams, n)
            choices = [
                api.CompletionChoice(
                    index=c,
                    text="".join(acc.text.get(c, [])),
                    logprobs=responses.completion_logprobs(
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

    @app.post("/v1/chat/completions", response_model=None, responses=_generation(api.ChatCompletionResponse))
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

            started: set[int] = set()

            def choice(_: int, d: Delta) -> api.ChatChunkChoice:
                role: Any = None if d.index in started else "assistant"
                started.add(d.index)
                lp = responses.chat_logprobs(d.token_ids, d.logprobs, token_str, top_n) if want_lp else None
                return api.ChatChunkChoice(
                    index=d.index,
                    delta=api.DeltaMessage(role=role, content=d.text),
                    logprobs=lp,
                    finish_reason=d.finish_reason,
                )

            def chunk(choices: list[Any], usage: api.Usage | None) -> api.ChatCompletionChunk:
                return api.ChatCompletionChunk(id=rid, model=served_model_name, choices=choices, usage=usage)

            events = _sse_events(streams, choice, chunk, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")

        async def collect() -> api.ChatCompletionResponse:
            acc = await responses.accumulate(streams, params.n)
            choices = [
                api.ChatChoice(
                    index=k,
                    message=api.AssistantMessage(content="".join(acc.text.get(k, []))),
                    logprobs=responses.chat_logprobs(acc.toks.get(k, []), acc.lps.get(k), token_str, top_n)
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
    except RequestFailedError as e:
        raise ApiError(500, str(e), "server_error") from None
    finally:
        await _close(streams)
