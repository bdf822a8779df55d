"""Turning engine updates into OpenAI response bodies: merging a request's per-prompt streams,
accumulating non-streamed choices, usage, logprobs in the completions and chat formats, and SSE
framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from ferryman.server import protocol as api
from ferryman.server.async_engine import Update


def sse(obj: BaseModel | dict[str, Any]) -> str:
    data = obj.model_dump_json(exclude_none=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


async def merge(streams: list[AsyncIterator[Update]]) -> AsyncIterator[tuple[int, Update]]:
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


@dataclass(slots=True)
class Accumulated:
    """A non-streamed response's choices, by choice index (prompt * n + sequence)."""

    text: dict[int, list[str]] = field(default_factory=dict)
    toks: dict[int, list[int]] = field(default_factory=dict)
    lps: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    reasons: dict[int, str | None] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)

    def usage(self) -> api.Usage:
        return usage(sum(self.prompt_tokens.values()), sum(len(t) for t in self.toks.values()))


async def accumulate(streams: list[AsyncIterator[Update]], n: int) -> Accumulated:
    acc = Accumulated()
    async for i, u in merge(streams):
        acc.prompt_tokens[i] = u.num_prompt_tokens
        for d in u.deltas:
            c = i * n + d.index
            acc.text.setdefault(c, []).append(d.text)
            acc.toks.setdefault(c, []).extend(d.token_ids)
            acc.lps.setdefault(c, []).extend(d.logprobs or [])
            acc.reasons[c] = d.finish_reason
    return acc


def usage(prompt: int, completion: int) -> api.Usage:
    return api.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion_logprobs(
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


def chat_logprobs(
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
