"""Faults (docs/faults.md): a request whose logits go non-finite fails alone and leaves nothing
behind; KV positions attention masks contribute nothing whatever they hold; a step that raises
fails its requests and the engine goes on, until repeated failures mark it dead (a Ctrl-C inside
a forward fails that step's requests alone and is re-raised); the server
answers a failed request 500 (an error event when streaming), exits non-zero when its engine
dies, and drains on SIGTERM (503 for new requests, open streams end with a finish reason, exit 0).

The non-finite request comes from a checkpoint with one NaN embedding row (``POISON``), as a user
would meet it; step failures are injected with ``FERRYMAN_TEST_FAULT_STEPS``."""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file, save_file
from test_server import Server, sse
from tiny_models import build

from ferryman.engine import MAX_STEP_FAILURES, Engine, EngineDeadError
from ferryman.sampling_params import SamplingParams

POISON = 200  # a byte token of the tiny tokenizer whose embedding row is NaN
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100, 33, 32], [65, 66]]  # never POISON
BAD = [72, POISON, 105]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a tokenizer whose embedding row ``POISON`` is NaN."""
    path = build("llama", tmp_path_factory.mktemp("faults"), tokenizer=True)
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][POISON] = float("nan")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def engine(model: Path, async_scheduling: bool = False, **kw: Any) -> Engine:
    args = {"block_size": 4, "num_device_blocks": 24, "num_host_blocks": 16, "calibrate": False, **kw}
    return Engine(str(model), async_scheduling=async_scheduling, **args)


def alone(model: Path, prompt: list[int]) -> list[int]:
    return engine(model, num_device_blocks=64).generate([prompt], GREEDY)[0].outputs[0].token_ids


def assert_pools_empty(eng: Engine) -> None:
    st = eng.stats()
    assert st["num_free_device_blocks"] == eng.kv.num_device_blocks
    assert st["num_free_host_blocks"] == eng.kv.num_host_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_non_finite_request_fails_alone(model: Path, async_scheduling: bool, mode: str) -> None:
    want = [alone(model, p) for p in PROMPTS]
    eng = engine(model, async_scheduling, preemption_mode=mode, max_num_batched_tokens=8)
    outs = eng.generate([PROMPTS[0], BAD, PROMPTS[1], PROMPTS[2]], GREEDY)
    bad = outs[1]
    assert bad.finished and bad.error is not None and "not finite" in bad.error
    assert [o.finish_reason for o in bad.outputs] == ["error"]
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2], outs[3])] == want
    assert all(
        o.error is None and o.outputs[0].finish_reason == "length" for o in (outs[0], outs[2], outs[3])
    )
    assert_pools_empty(eng)
    # the blocks it wrote (NaN) are free and reused: later requests come out as they would alone
    again = eng.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == want
    assert_pools_empty(eng)


def test_a_request_failed_before_its_first_token_reads_the_same_in_every_output_kind(model: Path) -> None:
    """final_only gave logprobs [] and cumulative_logprob 0 where the other kinds give None."""
    eng, got = engine(model), {}
    for kind in ("cumulative", "delta", "final_only"):
        eng.add_request(kind, BAD, dataclasses.replace(GREEDY, logprobs=1, output_kind=kind))
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step().outputs
        o = outs[-1].outputs[0]
        got[kind] = (o.token_ids, o.text, o.finish_reason, o.logprobs, o.cumulative_logprob)
    assert got == dict.fromkeys(got, ([], "", "error", None, None))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_masked_kv_positions_contribute_nothing_whatever_they_hold(
    model: Path, async_scheduling: bool
) -> None:
    """Every block a request can own (device and host) filled with NaN before the run, as a
    previous owner may leave it: the positions attention masks (past a row's length in its last
    block) must not leak. Block 0, the null block that pads decode groups, is never owned."""
    want = [alone(model, p) for p in PROMPTS]
    eng = engine(model, async_scheduling, preemption_mode="swap", max_num_batched_tokens=8)
    eng.kv.device_kv[1:].fill_(float("nan"))
    eng.kv.host_kv.fill_(float("nan"))
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)] == want


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(
    model: Path, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = [alone(model, p) for p in PROMPTS]
    monkeypatch.setenv("FERRYMAN_TEST_FAULT_STEPS", "3")
    eng = engine(model, async_scheduling)
    outs = eng.generate(PROMPTS, GREEDY)  # every request runs in step 3 (a decode step)
    assert all(o.error is not None and "injected fault at step 3" in o.error for o in outs)
    assert all(o.outputs[0].finish_reason == "error" for o in outs)
    assert all(len(o.outputs[0].token_ids) < GREEDY.max_tokens for o in outs)  # final_only: no partial
    assert_pools_empty(eng)
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)] == want  # it goes on
    assert eng.dead is None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ctrl_c_inside_a_forward_fails_that_step_and_the_engine_goes_on(
    model: Path, async_scheduling: bool
) -> None:
    want = [alone(model, p) for p in PROMPTS]
    eng = engine(model, async_scheduling)
    eng.add_request("other", PROMPTS[2], GREEDY)  # add_request's: its failure is handed out later
    real, calls = eng._worker.run, []

    def run(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # lands in the forward, where a step spends its time
        return real(*args, **kw)

    eng._worker.run = run  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        eng.generate(PROMPTS[:2], GREEDY)
    eng._worker.run = real  # type: ignore[method-assign]
    assert eng.dead is None and not eng.scheduler.has_unfinished_requests()
    other = [o for o in eng.step().outputs if o.request_id == "other"]  # each step's, then its end
    assert [o.finished for o in other] == [False, False, True]
    assert other[-1].error is not None and "interrupted" in other[-1].error
    assert not eng.has_unfinished_requests()
    assert_pools_empty(eng)
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)] == want  # it goes on
    assert not eng._failures  # an interruption is no step failure


@pytest.mark.parametrize("wait", ["device", "applier"])
def test_ctrl_c_in_an_async_steps_wait_is_raised_once_the_step_is_applied(
    model: Path, wait: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With async scheduling the host waits outside the forward: on CUDA for the samples
    (``Sampled.host_ids``, taken here by running without the CPU's applier thread), on CPU for
    the apply beside the forward. A Ctrl-C there left the core with a step open (the next call
    failed); now the step is applied first, and nothing is lost."""
    from ferryman.worker.step_worker import Sampled

    want = [alone(model, p) for p in PROMPTS]
    eng = engine(model, True, num_device_blocks=64)
    eng.add_request("other", PROMPTS[2], dataclasses.replace(GREEDY, output_kind="delta"))  # none lost
    calls = []
    if wait == "device":
        eng._applier = None
        real_ids = Sampled.host_ids

        def host_ids(self: Sampled) -> Any:
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real_ids(self)

        monkeypatch.setattr(Sampled, "host_ids", host_ids)
    else:
        assert eng._applier is not None
        real_submit = eng._applier.submit

        class Interrupted:  # the first wait for it is interrupted, as a Ctrl-C would
            def __init__(self, f: Any) -> None:
                self.f = f

            def result(self) -> Any:
                calls.append(1)
                if len(calls) == 2:
                    self.f.result()
                    raise KeyboardInterrupt
                return self.f.result()

        monkeypatch.setattr(eng._applier, "submit", lambda *a: Interrupted(real_submit(*a)))
    with pytest.raises(KeyboardInterrupt):
        eng.generate(PROMPTS[:2], GREEDY)
    monkeypatch.undo()
    assert eng.dead is None
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS[:2], GREEDY)] == want[:2]  # it goes on
    other = []
    while eng.has_unfinished_requests():
        other += [o for o in eng.step().outputs if o.request_id == "other"]
    assert other[-1].finished and other[-1].error is None
    assert [t for o in other for t in o.outputs[0].token_ids] == want[2]
    assert_pools_empty(eng)


def test_steps_that_keep_failing_mark_the_engine_dead(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRYMAN_TEST_FAULT_STEPS", "0-1000")
    eng = engine(model)
    for i in range(MAX_STEP_FAILURES - 1):
        eng.add_request(f"r{i}", PROMPTS[0], GREEDY)
        res = eng.step()
        assert [o.error is not None for o in res.outputs] == [True]
    eng.add_request("last", PROMPTS[0], GREEDY)
    with pytest.raises(EngineDeadError, match="steps failed"):
        eng.step()
    with pytest.raises(EngineDeadError, match="engine stopped"):
        eng.step()
    with pytest.raises(EngineDeadError, match="steps failed"):  # it would never run
        eng.add_request("after", PROMPTS[0], GREEDY)
    spare = engine(model)
    spare.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        spare.add_request("after", PROMPTS[0], GREEDY)


# -- the server ---------------------------------------------------------------------------------


def test_server_fails_the_non_finite_request_with_500_and_serves_the_rest(
    model: Path, tmp_path: Path
) -> None:
    s = Server(model, "--block-size", "4", "--num-device-blocks", "32", log=tmp_path / "log")
    try:
        req = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
        results: dict[str, httpx.Response] = {}

        def post(name: str, prompt: list[int]) -> None:
            results[name] = httpx.post(s.url + "/v1/completions", json={"prompt": prompt, **req}, timeout=60)

        threads = [threading.Thread(target=post, args=(str(i), p)) for i, p in enumerate([*PROMPTS, BAD])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bad = results[str(len(PROMPTS))]
        assert bad.status_code == 500, bad.text
        err = bad.json()["error"]
        assert "not finite" in err["message"] and err["type"] == "server_error"
        for i in range(len(PROMPTS)):
            assert results[str(i)].status_code == 200, results[str(i)].text
        with httpx.stream(
            "POST", s.url + "/v1/completions", json={"prompt": BAD, **req, "stream": True}
        ) as r:
            events = sse(r.iter_lines())  # asserts [DONE] ends it
        assert events and "not finite" in events[-1]["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 200
        s.wait_metric("ferryman_kv_device_blocks_free", 32)
    finally:
        s.stop()


def test_server_exits_non_zero_when_its_engine_dies(model: Path, tmp_path: Path) -> None:
    s = Server(
        model, "--block-size", "4", log=tmp_path / "log", env={"FERRYMAN_TEST_FAULT_STEPS": "0-100000"}
    )
    try:
        statuses = []
        for _ in range(MAX_STEP_FAILURES + 2):
            try:
                r = httpx.post(
                    s.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}, timeout=30
                )
            except httpx.TransportError:
                break  # it has exited
            statuses.append(r.status_code)
            assert r.json()["error"]["type"] == "server_error"
        assert statuses[: MAX_STEP_FAILURES - 1] == [500] * (MAX_STEP_FAILURES - 1)
        assert s.proc.wait(timeout=30) == 1
        assert "the engine died" in s.log.read_text()
    finally:
        s.stop()


def test_sigterm_drains_then_aborts_and_exits_zero(tmp_path: Path) -> None:
    model = build("llama", tmp_path, tokenizer=True, max_position_embeddings=16384)  # room to run long
    s = Server(model, "--block-size", "4", "--shutdown-timeout", "1.5", log=tmp_path / "log")
    try:  # a fresh server's gauges say what is free before any request
        assert s.metric("ferryman_kv_device_blocks_free") == s.metric("ferryman_kv_device_blocks") > 0
        long = {"prompt": PROMPTS[0], "max_tokens": 16000, "ignore_eos": True, "stream": True}
        short = {"prompt": PROMPTS[1], "max_tokens": 3, "ignore_eos": True, "stream": True}
        ends: dict[str, list[dict[str, Any]]] = {}
        started = threading.Barrier(3)

        def stream(name: str, body: dict[str, Any]) -> None:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                started.wait(timeout=60)
                ends[name] = sse(iter([first, *lines]))

        threads = [
            threading.Thread(target=stream, args=(n, b)) for n, b in (("long", long), ("short", short))
        ]
        for t in threads:
            t.start()
        started.wait(timeout=60)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(s.url + "/health").status_code == 503
        for t in threads:
            t.join(timeout=30)
        assert s.proc.wait(timeout=30) == 0
        reasons = {
            n: [c["finish_reason"] for e in ev for c in e["choices"] if c["finish_reason"]]
            for n, ev in ends.items()
        }
        assert reasons == {"long": ["abort"], "short": ["length"]}, json.dumps(ends)[:2000]
    finally:
        s.stop()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_results_add_up_to_the_cores_counters_across_a_failed_step(
    model: Path, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every planned step's statistics reach the caller once, a failed one's included (with async
    scheduling it rides in the result of the step applied beside it, ``failed_stats``): /metrics
    and the trace sum them, and their swap counts broke out = in + dropped."""
    monkeypatch.setenv("FERRYMAN_TEST_FAULT_STEPS", "7")
    eng = engine(model, async_scheduling, num_host_blocks=96, preemption_mode="swap")
    for i in range(16):
        prompt = [(7 * i + j) % 190 + 3 for j in range(4 + (i * 5) % 29)]  # never POISON
        eng.add_request(f"r{i}", prompt, dataclasses.replace(GREEDY, max_tokens=16, n=1 + i % 2))
    plans = []
    while eng.has_unfinished_requests():
        res = eng.step()
        plans += [p for p in (res.stats, res.failed_stats) if p is not None]
    st = eng.stats()
    assert st["num_blocks_swapped_out"] > 0 and 7 in [p.step for p in plans]
    assert len(plans) == len({p.step for p in plans}) == st["num_steps"]
    for key in ("num_blocks_swapped_out", "num_blocks_swapped_in", "num_scheduled_tokens"):
        assert sum(getattr(p, key) for p in plans) == st[key], key
    assert st["num_blocks_swapped_out"] == st["num_blocks_swapped_in"] + st["num_blocks_swap_dropped"]
