"""What every generation route does around the engine: turning a bad sampling value into a 400,
running a non-streamed request until it completes or its client goes away (then aborting it),
and mapping the engine's failures to HTTP errors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request

from ferryman.sampling_params import SamplingParams
from ferryman.server.async_engine import EngineDeadError, RequestFailedError, Update
from ferryman.server.errors import ApiError

T = TypeVar("T")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs ``work``; cancels it (aborting its requests) if the client goes away first, or if
    this handler is cancelled (what Ray Serve does when a client leaves), and waits for it to
    stop, so that its streams can be closed after."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ApiError(499, "client disconnected", "client_closed_request")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def params(make: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return make()
    except ValueError as e:
        raise ApiError(400, str(e), "invalid_request_error") from None


async def close(streams: list[AsyncIterator[Update]]) -> None:
    for s in streams:
        await s.aclose()  # type: ignore[attr-defined]


async def run_collect(request: Request, work: Awaitable[T], streams: list[AsyncIterator[Update]]) -> T:
    try:
        return await until_disconnect(request, work)
    except EngineDeadError as e:
        raise ApiError(503, str(e), "server_error") from None
    except RequestFailedError as e:
        raise ApiError(e.status, str(e), e.type) from None
    finally:
        await close(streams)
