"""``POST /v1/responses``: OpenAI's Responses API, one sequence through the chat path
(``responses_api.py`` turns the request into its chat request). The answer is a response object
whose output is an assistant message (its text as one ``output_text`` part, with logprobs when
``include`` asks) and, with tools, the function calls the model made; ``status`` is
``incomplete`` (reason ``max_output_tokens``) when the length ran out.

Streamed, it is OpenAI's typed events (``event:`` and ``data:`` lines, every event numbered by
``sequence_number``): ``response.created``, ``response.in_progress``, the message's
``output_item.added``, ``content_part.added``, ``output_text.delta``\\ s and their ``.done``
events, each function call as ``output_item.added``, one ``function_call_arguments.delta``,
``.done`` and ``output_item.done``, then ``response.completed`` (or ``response.incomplete``)
with the whole response. An engine that dies or fails the request mid-stream ends it with an
``error`` event and ``response.failed``."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ferryman.server import handling, responses, tool_calls
from ferryman.server import protocol as api
from ferryman.server import response_models as rm
from ferryman.server import responses_api as ra
from ferryman.server.async_engine import EngineDeadError, RequestFailedError, Update
from ferryman.server.chat_route import ChatRoutes
from ferryman.server.errors import ApiError, generation

log = logging.getLogger("ferryman.server")


class _Answer:
    """One response's output as it grows: text, calls, logprobs, finish reason, usage."""

    def __init__(
        self,
        key: str,
        lp: Callable[[list[int], list[Any]], list[api.ChatTokenLogprob]] | None,
        split: tool_calls.Streamer | None,
    ):
        """``lp``: a delta's logprobs in the output's shape (None: not asked); ``split``: the
        text's splitter into content and calls (None without tools)."""
        self.msg_id, self.lp, self.split = f"msg_{key}", lp, split
        self.text: list[str] = []
        # of the tokens whose text is the message's; those of tokens held back (a call may begin)
        # wait in `held`: they join once their text is released, or are dropped as a call's
        self.logprobs: list[api.ChatTokenLogprob] = []
        self.held: list[api.ChatTokenLogprob] = []
        self.calls: list[tool_calls.Call] = []
        self.reason: str | None = None
        self.prompt: dict[int, tuple[int, int]] = {}
        self.num_tokens = 0

    def feed(self, u: Update) -> str:
        """Takes in one update; the text it releases (with tools, held while a call may begin)."""
        responses.prompt_counts(self.prompt, 0, u)
        out = ""
        for d in u.deltas:
            self.num_tokens += len(d.token_ids)
            if self.lp is not None:
                self.held += self.lp(d.token_ids, d.logprobs or [])
            done = d.finish_reason is not None
            text, calls = self.split.step(d.text, done) if self.split is not None else (d.text, [])
            if done:
                self.reason, self.calls = d.finish_reason, calls
            if calls:  # what was held spelled the calls
                self.held.clear()
            if text or (done and not calls):
                self.logprobs += self.held
                self.held.clear()
            out += text
        self.text.append(out)
        return out

    def message(self, status: rm.ItemStatus) -> rm.OutputMessage:
        part = rm.OutputText(text="".join(self.text), logprobs=self.logprobs if self.lp else None)
        return rm.OutputMessage(id=self.msg_id, status=status, content=[part])

    def items(self) -> list[rm.OutputMessage | rm.OutputFunctionCall]:
        """The output: the message unless the answer is calls alone, then the calls."""
        out: list[rm.OutputMessage | rm.OutputFunctionCall] = []
        if "".join(self.text) or not self.calls:
            out.append(self.message("incomplete" if self.reason == "length" else "completed"))
        return out + [_call_item(c) for c in self.calls]

    def usage(self) -> rm.ResponseUsage:
        return rm.ResponseUsage.of(responses.usage(self.prompt, self.num_tokens))


def _call_item(c: tool_calls.Call) -> rm.OutputFunctionCall:
    return rm.OutputFunctionCall(
        id=f"fc_{c.id}", call_id=c.id, name=c.name, arguments=c.arguments, status="completed"
    )


def add_responses_route(app: FastAPI, ctx: ChatRoutes) -> None:
    @app.post("/v1/responses", response_model=None, responses=generation(rm.ResponseObject))
    async def create(body: ra.ResponsesRequest, request: Request) -> Response | rm.ResponseObject:
        ctx.check(body.model)
        chat = body.to_chat()
        params = handling.params(lambda: chat.sampling_params(ctx.defaults))
        choice = chat.effective_tool_choice()
        prompt = chat.render(ctx.tokenizer)
        rid, streams = await ctx.submit("resp", [prompt], params, chat.add_special_tokens)
        key = rid.removeprefix("resp-")  # OpenAI's ids: resp_<key>, msg_<key>
        created = int(time.time())
        top_n, raw = params.logprobs or 0, ctx.token_bytes.get() if params.logprobs is not None else None

        def lp(toks: list[int], lps: list[Any]) -> list[api.ChatTokenLogprob]:
            got = responses.chat_logprobs(toks, lps, ctx.token_str, top_n, raw)
            return got.content if got is not None else []

        with_tools = body.tools and choice != "none"
        split = (
            tool_calls.Streamer(choice, ctx.parser, body.parallel_tool_calls is False) if with_tools else None
        )
        answer = _Answer(key, lp if params.logprobs is not None else None, split)

        def response(status: str, error: rm.ResponseError | None = None) -> rm.ResponseObject:
            done = status in ("completed", "incomplete")
            return rm.ResponseObject(
                id=f"resp_{key}",
                created_at=created,
                status=status,  # type: ignore[arg-type]
                model=ctx.served_model_name,
                output=answer.items() if done else [],
                usage=answer.usage() if done else None,
                incomplete_details=rm.IncompleteDetails(reason="max_output_tokens")
                if status == "incomplete"
                else None,
                error=error,
                temperature=params.temperature,
                top_p=params.top_p,
                **body.echo(),
            )

        def final() -> rm.ResponseObject:
            return response("incomplete" if answer.reason == "length" else "completed")

        if body.stream:
            return StreamingResponse(
                _events(streams, answer, response, final), media_type="text/event-stream"
            )

        async def collect() -> rm.ResponseObject:
            async for _, u in responses.merge(streams):
                answer.feed(u)
            return final()

        return await handling.run_collect(request, collect(), streams)


def _plain(v: Any) -> Any:
    """``v`` as JSON types (models and lists of them)."""
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v.model_dump(mode="json") if hasattr(v, "model_dump") else v


async def _events(
    streams: list[AsyncIterator[Update]],
    answer: _Answer,
    response: Callable[..., rm.ResponseObject],
    final: Callable[[], rm.ResponseObject],
) -> AsyncIterator[str]:
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq} | {k: _plain(v) for k, v in fields.items()}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"  # ASCII: no raw line breaks

    part = {"item_id": answer.msg_id, "output_index": 0, "content_index": 0}
    opened = False

    def open_message() -> list[str]:
        nonlocal opened
        opened = True
        item = rm.OutputMessage(id=answer.msg_id, status="in_progress", content=[])
        return [
            event("response.output_item.added", output_index=0, item=item),
            event("response.content_part.added", **part, part=rm.OutputText(text="", logprobs=[])),
        ]

    try:
        yield event("response.created", response=response("in_progress"))
        yield event("response.in_progress", response=response("in_progress"))
        shown = 0  # logprobs sent so far (a token whose text is held back sends its own later)
        async for _, u in responses.merge(streams):
            text = answer.feed(u)
            if text or len(answer.logprobs) > shown:  # a last token may add logprobs, no text
                for e in [] if opened else open_message():
                    yield e
                yield event(
                    "response.output_text.delta", **part, delta=text, logprobs=answer.logprobs[shown:]
                )
                shown = len(answer.logprobs)
        done = final()
        for i, item in enumerate(done.output):
            if isinstance(item, rm.OutputMessage):
                for e in [] if opened else open_message():
                    yield e
                whole = item.content[0]
                yield event(
                    "response.output_text.done", **part, text=whole.text, logprobs=whole.logprobs or []
                )
                yield event("response.content_part.done", **part, part=whole)
            else:
                yield event(
                    "response.output_item.added",
                    output_index=i,
                    item=item.model_copy(update={"arguments": "", "status": "in_progress"}),
                )
                at = {"item_id": item.id, "output_index": i}
                yield event("response.function_call_arguments.delta", **at, delta=item.arguments)
                yield event(
                    "response.function_call_arguments.done", **at, name=item.name, arguments=item.arguments
                )
            yield event("response.output_item.done", output_index=i, item=item)
        yield event(f"response.{done.status}", response=done)
    except Exception as e:  # the stream has started: the failure can only be told in it
        if isinstance(e, EngineDeadError):
            err = ApiError(503, str(e), "server_error")
        elif isinstance(e, RequestFailedError):
            err = ApiError(e.status, str(e), e.type)
        else:
            log.exception("a streamed response failed")
            err = ApiError(500, f"internal error: {type(e).__name__}", "server_error")
        info = err.body.error
        yield event("error", code=info.type, message=info.message, param=None)
        yield event(
            "response.failed",
            response=response("failed", rm.ResponseError(code=info.type, message=info.message)),
        )
    finally:
        await handling.close(streams)
