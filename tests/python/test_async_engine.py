"""AsyncEngine's lifecycle: ``shutdown()`` ends the open streams and aborts their requests and
``add()`` refuses afterwards; an ``add()`` cancelled before its request was accepted aborts it,
and so does a server request cancelled while it submits its prompts; a consumer whose event loop
closed loses its own request only (the engine thread goes on serving others); an iterator
dropped unread aborts its request."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import httpx
import pytest
from tiny_models import build

from ferryman import Engine, SamplingParams
from ferryman.server.app import build_app
from ferryman.server.async_engine import AsyncEngine, EngineDeadError

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("async_engine"), tokenizer=True)


def engine(model: Path) -> Engine:
    return Engine(str(model), block_size=4, num_device_blocks=256, calibrate=False)


async def until(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_shutdown_ends_open_streams_and_add_refuses_after_it(model: Path) -> None:
    eng = engine(model)
    ae = AsyncEngine(eng)
    ae.start()

    async def go() -> None:
        it = await ae.add("s1", [5, 6, 7], LONG, time.monotonic())
        await it.__anext__()
        ae.shutdown()

        async def read_all() -> None:
            async for u in it:  # what went out before the shutdown, then its end
                assert not u.finished

        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(read_all(), 5)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(ae.add("s2", [5, 6, 7], LONG, time.monotonic()), 5)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(ae.add("s3", "a text prompt", LONG, time.monotonic()), 5)

    asyncio.run(go())
    assert not eng.has_unfinished_requests()  # s1 was aborted: a later AsyncEngine starts clean
    assert ae.num_waiting() == 0
    assert eng.stats()["num_free_device_blocks"] == eng.kv.num_device_blocks


def test_a_cancelled_add_and_a_cancelled_submission_abort_their_requests(model: Path) -> None:
    eng = engine(model)
    ae = AsyncEngine(eng)
    app = build_app(ae, "tiny")

    async def go() -> None:
        async with app.router.lifespan_context(app):
            task = asyncio.create_task(ae.add("c1", [5, 6, 7, 8], LONG, time.monotonic()))
            await asyncio.sleep(0)  # its add command is queued; it awaits acceptance
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: not eng.has_unfinished_requests())
            # a server request cancelled (its client left) while it submits its prompts
            body = {"model": "tiny", "prompt": [f"hello {i}" for i in range(50)], "max_tokens": 200}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                post = asyncio.create_task(c.post("/v1/completions", json={**body, "ignore_eos": True}))
                await until(lambda: len(ae._streams) >= 3)
                post.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await post
            await until(lambda: not eng.has_unfinished_requests())
            assert eng.scheduler.stats()["num_generated_tokens"] < 50 * 200

    asyncio.run(go())
    assert eng.stats()["num_free_device_blocks"] == eng.kv.num_device_blocks


def test_a_closed_event_loop_loses_its_own_request_only(model: Path) -> None:
    eng = engine(model)
    ae = AsyncEngine(eng)
    ae.start()

    async def gives_up() -> None:
        it = await ae.add("a", [5, 6, 7], LONG, time.monotonic())
        await it.__anext__()
        raise TimeoutError  # the caller gives up; asyncio.run closes its loop

    with pytest.raises(TimeoutError):
        asyncio.run(gives_up())

    async def next_one() -> list[int]:
        it = await ae.add("b", [5, 6, 7], SHORT, time.monotonic())
        return [t async for u in it for t in u.deltas[0].token_ids]

    assert len(asyncio.run(next_one())) == 5
    assert ae.error is None and ae._thread.is_alive()
    ae.shutdown()
    assert not eng.has_unfinished_requests()


def test_an_iterator_dropped_unread_aborts_its_request(model: Path) -> None:
    eng = engine(model)
    ae = AsyncEngine(eng)
    ae.start()

    async def go() -> None:
        it = await ae.add("d1", [5, 6, 7], LONG, time.monotonic())
        gc.disable()  # refcounting alone must drop it (a cycle waited for the collector)
        try:
            del it
            await until(lambda: not eng.has_unfinished_requests())
        finally:
            gc.enable()
        # an iterator dropped after its request ended aborts nothing, not a later one of its id
        done = await ae.add("r", [5, 6, 7], SHORT, time.monotonic())
        await until(lambda: not eng.has_unfinished_requests())
        later = await ae.add("r", [5, 6, 7], SHORT, time.monotonic())
        del done
        got = [u async for u in later]
        assert sum(len(u.deltas[0].token_ids) for u in got) == 5 and got[-1].finished

    asyncio.run(go())
    ae.shutdown()
    assert eng.scheduler.stats()["num_generated_tokens"] < LONG.max_tokens
