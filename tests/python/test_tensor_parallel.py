"""Tensor parallelism (issue: scale-out, item 1): the model alone (``models/tensor_parallel.py``:
2 and 4 ranks over gloo, one process each, give the logits of one rank on tiny Llama / Qwen2
(q/k/v bias, tied embeddings) / Qwen3 (q/k norms, head_dim 24) checkpoints, including fewer KV
heads than ranks; attention there is a dense reference, so the check is the split and the
collectives), then the engine over ranks (``worker/tp_workers.py``): the same greedy and seeded
tokens as one rank under forced preemption (recompute and swap), and a killed rank that leaves
the engine dead, never hung."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from tiny_models import build

from ferryman.engine import Engine, EngineDeadError
from ferryman.models.config import ModelConfig
from ferryman.models.llama import LlamaForCausalLM
from ferryman.models.tensor_parallel import TensorParallel, shard_of
from ferryman.sampling_params import SamplingParams
from ferryman.worker.tp_rendezvous import free_port
from ferryman.worker.tp_workers import RankFailedError, init_rank

TOKENS = [3, 17, 42, 5, 88, 61, 7, 29, 30, 2, 55, 90]


class DenseCausal:
    """Attention over the batch's own tokens, one sequence, no cache."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return out.transpose(0, 1)


def logits(path: Path, tp: TensorParallel) -> torch.Tensor:
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    tensors = load_file(str(path / "model.safetensors"))
    model = LlamaForCausalLM.from_tensors(cfg, tensors, torch.float32, torch.device("cpu"), tp)
    with torch.no_grad():
        ids = torch.tensor(TOKENS)
        hidden = model(ids, torch.arange(len(TOKENS)), DenseCausal())  # type: ignore[arg-type]
        return model.compute_logits(hidden)


def _rank(rank: int, world: int, path: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        got = logits(Path(path), TensorParallel(rank, world))
        torch.save(got, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("kind", "world"), [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen3", 2)])
def test_ranks_give_the_logits_of_one(tmp_path: Path, kind: str, world: int) -> None:
    path = build(kind, tmp_path / "m")
    want = logits(path, TensorParallel())
    out = str(tmp_path / "logits")
    mp.spawn(_rank, args=(world, str(path), f"file://{tmp_path / 'rendezvous'}", out), nprocs=world)
    for r in range(world):
        got = torch.load(f"{out}.{r}")
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # a sum's order differs


def test_shards_cover_the_model_once() -> None:
    cfg = ModelConfig.from_hf(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 259}
    )  # fmt: skip
    shards = [shard_of(cfg, TensorParallel(r, 4)) for r in range(4)]
    assert [list(s.q_heads) for s in shards] == [[0], [1], [2], [3]]
    assert [list(s.kv_heads) for s in shards] == [[0], [0], [1], [1]]  # replicated: 2 heads, 4 ranks
    assert shards[-1].vocab.stop == 260 and all(s.vocab_size == 65 for s in shards)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        shard_of(cfg, TensorParallel(0, 3))


PROMPTS = [[5, 9, 5, 9, 5, 1, 2], [17, 3, 3, 3, 8, 1], [40, 41], [7, 7, 7, 7, 7, 7, 7, 8, 9, 10, 11]]


def run(path: Path, world: int, **kw: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy and seeded-sampled tokens of every prompt, and the engine's stats (with the
    runner's count of in-flight inputs filled into plans, tensor parallelism only, and what
    start-up calibrated)."""
    sp = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True, n=2),
    ]
    eng = Engine(str(path), **{"calibrate": False, **kw}, tensor_parallel_size=world, block_size=4)
    try:
        outs = eng.generate(PROMPTS * 2, [sp[0]] * len(PROMPTS) + [sp[1]] * len(PROMPTS))
        filled = getattr(eng.runner, "num_inputs_filled", None)
        st = {**eng.stats(), "num_inputs_filled": filled, "calibrated": sorted(eng.calibration)}
        return [o.token_ids for r in outs for o in r.outputs], st
    finally:
        if world > 1:
            eng.shutdown()


@pytest.mark.parametrize(
    ("kind", "world", "mode"),
    [
        ("llama", 2, "recompute"),
        ("llama", 2, "swap"),
        ("llama", 4, "swap"),
        ("qwen2", 2, "recompute"),
        ("qwen3", 4, "recompute"),
    ],
)
def test_the_engine_over_ranks_gives_one_ranks_tokens(
    tmp_path: Path, kind: str, world: int, mode: str
) -> None:
    """Greedy and seeded sampling, with a pool small enough to preempt (every rank runs the same
    swap plans over its own KV heads)."""
    path = build(kind, tmp_path / "m")
    tight = {
        "num_device_blocks": 14,
        "num_host_blocks": 64,
        "max_num_batched_tokens": 16,
        "preemption_mode": mode,
    }
    want, _ = run(path, 1)
    got, st = run(path, world, **tight)
    assert got == want
    assert st["num_preemptions"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_scheduling_and_calibration_over_ranks(tmp_path: Path, mode: str) -> None:
    """With async scheduling a decode input whose token is in flight reaches the workers filled
    in by rank 0 (the only rank holding the sampled ids); calibration's prefill runs on every
    rank. The tokens are one rank's without either, under preemption."""
    path = build("llama", tmp_path / "m")
    tight = {"num_device_blocks": 14, "num_host_blocks": 64, "max_num_batched_tokens": 16}
    want, _ = run(path, 1)
    got, st = run(path, 2, async_scheduling=True, calibrate=True, preemption_mode=mode, **tight)
    assert got == want
    assert st["num_preemptions"] > 0
    assert st["num_inputs_filled"] > 0, "no step ran with a token in flight"
    assert st["calibrated"] == ["host_link_bytes_per_s", "prefill_tokens_per_s"]


def test_a_dead_rank_kills_the_engine_not_hangs_it(tmp_path: Path) -> None:
    path = build("llama", tmp_path / "m")
    eng = Engine(str(path), calibrate=False, tensor_parallel_size=2)
    try:
        eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        eng.step()
        worker = eng.runner.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="tensor-parallel rank failed"):
            while eng.has_unfinished_requests():
                eng.step()
        assert time.monotonic() - started < 30
        with pytest.raises(EngineDeadError):
            eng.step()
    finally:
        eng.shutdown()


def test_a_ctrl_c_in_a_step_over_ranks_leaves_the_next_call_failing_at_once(tmp_path: Path) -> None:
    """An interrupt inside rank 0's forward leaves the workers in that step's collectives: the
    next call raised only when their 60 s timeout killed them; now at once."""
    path = build("llama", tmp_path / "m")
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eng = Engine(str(path), calibrate=False, tensor_parallel_size=2)
    try:
        layer = eng.runner.local.model.layers[1]
        real, calls = layer.forward, []

        def forward(*args: Any, **kw: Any) -> Any:
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt  # between the layer's collectives
            return real(*args, **kw)

        layer.forward = forward
        with pytest.raises(KeyboardInterrupt):
            eng.generate([PROMPTS[0]], sp)
        layer.forward = real
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="interrupted: the ranks are out of step"):
            eng.generate([PROMPTS[0]], sp)
        assert time.monotonic() - started < 10
    finally:
        eng.shutdown()


def test_a_worker_that_dies_while_the_server_idles_stops_it(tmp_path: Path) -> None:
    """The engine thread checks its ranks while idle: a dead worker ends it (the server then
    exits, and /health says so) instead of /health answering ok until a request is lost to it."""
    from ferryman.server.async_engine import AsyncEngine

    path = build("llama", tmp_path / "m")
    eng = Engine(str(path), calibrate=False, tensor_parallel_size=2)
    died: list[BaseException] = []
    ae = AsyncEngine(eng, on_dead=died.append)
    ae.start()
    try:
        worker = eng.runner.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        deadline = time.monotonic() + 10
        while not died and time.monotonic() < deadline:
            time.sleep(0.05)
        assert died and "tensor-parallel rank stopped" in str(ae.error)
    finally:
        ae.shutdown()
        eng.shutdown()


def test_ctrl_c_to_the_process_group_drains_a_server_over_ranks(tmp_path: Path) -> None:
    """A terminal's Ctrl-C (or a service manager's SIGTERM) reaches every process of the group:
    the workers used to die of it at once, so the open request failed (503, the engine dead) and
    the server exited 1. The workers ignore it now; rank 0 drains, then stops them."""
    import httpx
    from test_server import Server, sse

    s = Server(
        build("llama", tmp_path / "m"), "--tensor-parallel-size", "2", log=tmp_path / "log", new_session=True
    )
    try:
        body = {"prompt": [3, 17, 42], "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.killpg(s.proc.pid, signal.SIGINT)
            events = sse(iter([first, *lines]))
        assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
        assert s.proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # every process of the group has gone
            try:
                os.killpg(s.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("a worker outlived the server")
    finally:
        s.stop()


def test_an_idle_engine_stays_alive_past_the_collective_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers wait for the next plan on a group without timeout: idling longer than the
    forward's collective timeout (2 s here) kills nothing (the review's finding)."""
    monkeypatch.setenv("FERRYMAN_TEST_TP_TIMEOUT_S", "2")
    path = build("llama", tmp_path / "m")
    eng = Engine(str(path), calibrate=False, tensor_parallel_size=2)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        first = eng.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids
        time.sleep(4)
        assert eng.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids == first
    finally:
        eng.shutdown()


def test_one_engine_at_a_time_each_stopped_by_shutdown_or_drop_and_at_once_after_a_broken_step(
    tmp_path: Path,
) -> None:
    """A second tensor-parallel engine beside a live one is refused and leaves it serving; a
    dropped engine frees its workers and the process group for the next; shutdown after a step
    that raised on rank 0 (the workers inside an all-reduce) kills them at once, not after the
    collective timeout (60 s)."""
    import gc
    import weakref

    path = build("llama", tmp_path / "m")
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eng = Engine(str(path), calibrate=False, tensor_parallel_size=2)
    first = eng.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids
    with pytest.raises(RuntimeError, match="another tensor-parallel engine runs in this process"):
        Engine(str(path), calibrate=False, tensor_parallel_size=2)
    assert eng.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids == first
    procs, runner = eng.runner.workers.procs, weakref.ref(eng.runner)
    del eng
    gc.collect()
    assert runner() is None and not any(p.is_alive() for p in procs)

    eng = Engine(str(path), calibrate=False, tensor_parallel_size=2)
    try:
        assert eng.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids == first
        eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
        eng.step()

        def boom(*args: Any, **kw: Any) -> Any:
            raise RuntimeError("rank 0 failed mid-forward")

        eng.runner.local.model.layers[1].forward = boom
        with pytest.raises(EngineDeadError, match="rank 0 failed mid-forward"):
            while eng.has_unfinished_requests():
                eng.step()
        procs = eng.runner.workers.procs
        started = time.monotonic()
        eng.shutdown()
        assert time.monotonic() - started < 20 and not any(p.is_alive() for p in procs)
        with pytest.raises(EngineDeadError):
            eng.step()
    finally:
        eng.shutdown()


def _late_rank(spec: Any, delay_s: float) -> None:
    time.sleep(delay_s)  # starts after the collectives' timeout has long passed
    init_rank(spec, 1)
    try:
        x = torch.ones(3)
        dist.all_reduce(x)
    finally:
        dist.destroy_process_group()


def test_a_rank_that_arrives_after_the_collective_timeout_still_joins() -> None:
    """The rendezvous waits for a slow rank (a loaded machine importing torch) longer than the
    forward's collectives wait for each other (it used the same 2 s in the test above, which
    failed when the spawned worker was late)."""
    spec = SimpleNamespace(init_method=f"tcp://127.0.0.1:{free_port()}", world=2, timeout_s=1.0, device="cpu")
    late = mp.get_context("spawn").Process(target=_late_rank, args=(spec, 3.0))
    late.start()
    try:
        init_rank(spec, 0)  # type: ignore[arg-type]
        x = torch.full((3,), 2.0)
        dist.all_reduce(x)
        assert x.tolist() == [3.0, 3.0, 3.0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        late.join(timeout=30)
    assert late.exitcode == 0


def _dies_at_start() -> None:
    raise SystemExit(3)  # what a worker does that cannot start (a script without a __main__ guard)


def test_a_worker_that_dies_before_joining_fails_the_start_at_once() -> None:
    """Rank 0 polls its workers while it waits for them: one that has exited fails the start-up
    at once, naming it, instead of after the rendezvous' 300 s (a user trial's hang)."""
    spec = SimpleNamespace(init_method=f"tcp://127.0.0.1:{free_port()}", world=2, timeout_s=1.0, device="cpu")
    worker = mp.get_context("spawn").Process(target=_dies_at_start)
    worker.start()
    worker.join(timeout=60)
    with pytest.raises(RankFailedError, match=r"stopped before joining \(pid \d+\).*__main__"):
        init_rank(spec, 0, lambda: [] if worker.is_alive() else [f"pid {worker.pid}"])
    assert not dist.is_initialized()  # (waiting out the rendezvous would say "0 of 1 ... joined")
