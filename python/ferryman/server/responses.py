"""Turning engine updates into OpenAI response bodies: merging a request's per-prompt streams,
accumulating non-streamed choices, usage, logprobs in the completions and chat formats, and SSE
framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from ferryman._core import TokenBytes
from ferryman.outputs import Logprob
from ferryman.server import protocol as api
from ferryman.server.async_engine import Delta, EngineDeadError, RequestFailedError, Update
from ferryman.server.errors import ApiError

# characters that JSON and SSE allow raw but that line splitters such as str.splitlines (httpx's
# aiter_lines) break on: escaped, the event stays one line for every client
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: BaseModel | dict[str, Any]) -> str:
    data = obj.model_dump_json(exclude_none=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data.translate(_LINE_BREAKS)}\n\n"


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


# a prompt's ids, their logprobs and their ranks (with prompt logprobs)
PromptData = tuple[list[int], list[dict[int, Logprob] | None], list[int | None]]


@dataclass(slots=True)
class Accumulated:
    """A non-streamed response's choices, by choice index (prompt * n + sequence)."""

    text: dict[int, list[str]] = field(default_factory=dict)
    toks: dict[int, list[int]] = field(default_factory=dict)
    lps: dict[int, list[dict[int, Logprob]]] = field(default_factory=dict)
    reasons: dict[int, str | None] = field(default_factory=dict)
    stop_reasons: dict[int, str | int | None] = field(default_factory=dict)
    prompt_tokens: dict[int, tuple[int, int]] = field(default_factory=dict)  # (tokens, cached)
    # by prompt index, with prompt logprobs: the prompt's ids and their logprobs
    prompts: dict[int, PromptData] = field(default_factory=dict)

    def usage(self) -> api.Usage:
        return usage(self.prompt_tokens, sum(len(t) for t in self.toks.values()))


async def accumulate(streams: list[AsyncIterator[Update]], n: int) -> Accumulated:
    acc = Accumulated()
    async for i, u in merge(streams):
        prompt_counts(acc.prompt_tokens, i, u)
        if u.prompt_token_ids is not None and u.prompt_logprobs is not None:
            acc.prompts[i] = (u.prompt_token_ids, u.prompt_logprobs, u.prompt_logprob_ranks or [])
        for d in u.deltas:
            c = i * n + d.index
            acc.text.setdefault(c, []).append(d.text)
            acc.toks.setdefault(c, []).extend(d.token_ids)
            acc.lps.setdefault(c, []).extend(d.logprobs or [])
            acc.reasons[c] = d.finish_reason
            acc.stop_reasons[c] = d.stop_reason
    return acc


def prompt_counts(counts: dict[int, tuple[int, int]], i: int, u: Update) -> None:
    """Records prompt ``i``'s (tokens, cached tokens) from its update ``u`` (an update made when
    the request was aborted knows no cached count: the count an earlier one gave stays)."""
    counts[i] = (u.num_prompt_tokens, max(u.num_cached_tokens, counts.get(i, (0, 0))[1]))


def usage(prompts: dict[int, tuple[int, int]], completion: int) -> api.Usage:
    """Of prompts' (tokens, cached tokens) by prompt index, and the completion tokens."""
    prompt, cached = sum(p for p, _ in prompts.values()), sum(c for _, c in prompts.values())
    return api.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=api.PromptTokensDetails(cached_tokens=cached),
    )


def completion_logprobs(
    toks: list[int], lps: list[dict[int, Logprob]] | None, token_str: Callable[[int], str], offset: int
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


def echo_logprobs(
    prompt: list[int], lps: list[dict[int, Logprob] | None], token_str: Callable[[int], str]
) -> api.CompletionLogprobs:
    """The prompt's part of an echoed choice's logprobs: each prompt token, its logprob (None for
    the first, which nothing predicts) and the top ones."""
    out, offset = api.CompletionLogprobs(), 0
    for t, d in zip(prompt, lps, strict=True):
        out.tokens.append(token_str(t))
        out.token_logprobs.append(None if d is None else d[t])
        out.top_logprobs.append(None if d is None else {token_str(k): v for k, v in d.items()})
        out.text_offset.append(offset)
        offset += len(out.tokens[-1])
    return out


def cut_top(
    prompt: list[int], lps: list[dict[int, Logprob] | None], n: int
) -> list[dict[int, Logprob] | None]:
    """Each prompt position's logprobs cut to its top ``n`` plus the prompt token's own."""
    out: list[dict[int, Logprob] | None] = []
    for t, d in zip(prompt, lps, strict=True):
        keep = None if d is None else {k for k, _ in sorted(d.items(), key=lambda kv: -kv[1])[:n]} | {t}
        out.append(None if d is None or keep is None else {k: v for k, v in d.items() if k in keep})
    return out


def token_namer(token_str: Callable[[int], str], as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or vLLM's ``"token_id:{id}"`` with
    ``return_tokens_as_token_ids``."""
    return (lambda t: f"token_id:{t}") if as_ids else token_str


def prompt_logprobs(
    prompt: list[int],
    lps: list[dict[int, Logprob] | None],
    ranks: list[int | None],
    token_str: Callable[[int], str],
) -> list[dict[str, api.PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` field: per prompt token (the first null), its own and the top
    N tokens as ``{token id: {logprob, rank, decoded_token}}`` (JSON keys are strings). The top N
    rank 1..N in order; the prompt token has the rank the model gave it in the vocabulary."""
    out: list[dict[str, api.PromptLogprob] | None] = []
    for i, (t, d) in enumerate(zip(prompt, lps, strict=True)):
        if d is None:
            out.append(None)
            continue
        order = {k: r for r, (k, _) in enumerate(sorted(d.items(), key=lambda kv: -kv[1]), start=1)}
        given = ranks[i] if i < len(ranks) else None
        own = order[t] if given is None else given
        out.append(
            {
                str(k): api.PromptLogprob(
                    logprob=v, rank=own if k == t else order[k], decoded_token=token_str(k)
                )
                for k, v in d.items()
            }
        )
    return out


def chat_logprobs(
    toks: list[int],
    lps: list[dict[int, Logprob]] | None,
    token_str: Callable[[int], str],
    top_n: int,
    token_bytes: Callable[[int], bytes] | None = None,
) -> api.ChatLogprobs | None:
    """OpenAI's chat logprobs; ``bytes`` from ``token_bytes`` (a token's own bytes, which join up
    where a character is split over tokens; vLLM sends the UTF-8 of its text, "�" there), else
    the UTF-8 of the token's text."""
    if lps is None:
        return None
    raw = token_bytes or (lambda t: token_str(t).encode())
    content = []
    for t, d in zip(toks, lps, strict=False):
        top = sorted(d.items(), key=lambda kv: -kv[1])
        content.append(
            api.ChatTokenLogprob(
                token=token_str(t),
                logprob=d[t],
                bytes=list(raw(t)),
                top_logprobs=[
                    api.TopLogprob(token=token_str(k), logprob=v, bytes=list(raw(k))) for k, v in top[:top_n]
                ],
            )
        )
    return api.ChatLogprobs(content=content)


class TokenBytesOf:
    """A tokenizer's ``TokenBytes``, built on the first call (a server that never returns chat
    logprobs does not parse its tokenizer.json again); None without a fast tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.table: TokenBytes | None = None

    def get(self) -> Callable[[int], bytes] | None:
        if self.backend is None:
            return None
        if self.table is None:
            self.table = TokenBytes(self.backend.to_str())
        return self.table


async def sse_events(
    streams: list[AsyncIterator[Update]],
    choice: Callable[[int, Delta, Update], Any | None],
    chunk: Callable[[list[Any], api.Usage | None], Any],
    include_usage: bool,
    continuous_usage: bool = False,
    opening: Sequence[Any] = (),
) -> AsyncIterator[str]:
    """A streamed response's events: one chunk per choice of each update (``choice`` maps the
    prompt index and a delta to a choice, or None when it has nothing to send), as OpenAI streams
    ``n > 1`` (clients read ``chunk.choices[0]``), the usage chunk when asked, then ``[DONE]``;
    an engine that dies or fails the request mid-stream ends it with an error event, then
    ``[DONE]``. With ``continuous_usage`` (vLLM's, only beside ``include_usage``) each chunk
    carries its own choice's usage so far: its prompt's tokens and its own completion tokens.
    ``opening``: choices sent first, one chunk each (a chat's role-only chunk per choice)."""
    prompt_tokens: dict[int, tuple[int, int]] = {}
    completion_tokens = 0
    own: dict[tuple[int, int], int] = {}  # (prompt, choice of it) -> its completion tokens so far
    continuous_usage = continuous_usage and include_usage
    try:
        for c in opening:
            yield sse(chunk([c], None))
        async for i, u in merge(streams):
            prompt_counts(prompt_tokens, i, u)
            for d in u.deltas:
                completion_tokens += len(d.token_ids)
                own[i, d.index] = own.get((i, d.index), 0) + len(d.token_ids)
                if (c := choice(i, d, u)) is None:  # nothing to say (text held back): no chunk
                    continue
                so_far = usage({i: prompt_tokens[i]}, own[i, d.index]) if continuous_usage else None
                yield sse(chunk([c], so_far))
        if include_usage:
            yield sse(chunk([], usage(prompt_tokens, completion_tokens)))
    except EngineDeadError as e:
        yield sse(ApiError(503, str(e), "server_error").body)
    except RequestFailedError as e:
        yield sse(ApiError(e.status, str(e), e.type).body)
    yield "data: [DONE]\n\n"
