"""Tensor-parallel ranks of one engine (``tensor_parallel_size`` > 1): rank 0 is the engine's own
process, which schedules, samples and turns tokens into text; ranks 1..N-1 are workers that only
run the forward of their slice of the model (``models/tensor_parallel.py``) over their own KV
pool, which holds their KV heads of every block. How the workers start is the one thing the
executor backends differ in (``Workers``): ``mp`` spawns processes (``torch.multiprocessing``),
``ray`` places Ray actors in a placement group (``worker/ray_ranks.py``); both run
``worker_main``, the same groups and the same plans. Where each rank runs, over which backend
(gloo on CPU, NCCL on CUDA) and how its pool is sized: ``worker/tp_devices.py``.

Each step's plan (the arrays the runner reads, about twenty small numpy arrays) reaches the
workers in one ``broadcast_object_list`` from rank 0 before rank 0 runs it; every rank then runs
the same swap, copy and forward, meeting in the model's all-reduces, and the logits come back
whole on rank 0 (``models/tensor_parallel.py``). ``plan_send_s`` adds up the broadcasts; a
``None`` plan stops the workers.

The plans go over a group of their own whose broadcasts never time out (a worker waits for the
next plan as long as the engine idles); the forward's collectives time out after
``RankSpec.timeout_s`` (60 s). A rank that dies makes the next collective fail (gloo reports the
closed connection at once): the step raises ``RankFailedError``, which the engine treats as fatal
(it reports itself dead; the server fails every open request), as any error of a step here, and
the next step after a Ctrl-C in one: a rank that stopped mid-step leaves the others out of step.

With async scheduling a plan may hold decode inputs whose token is still in flight; only rank 0
holds the previous step's sampled ids, so it broadcasts them over the model's group right after
the plan, and each rank fills those inputs on its device as rank 0's runner does (on CUDA that
broadcast queues behind rank 0's sampling). Calibration's prefill runs through this runner, so
every rank takes part. Before the model's first collective every rank reports over the plans'
group that its slice loaded, so a rank that failed fails the start-up everywhere. What differs
on CUDA, and what of it has not run: ``worker/tp_devices.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import signal
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ferryman.models.tensor_parallel import TensorParallel
from ferryman.worker.calibrate import profile_kv_blocks
from ferryman.worker.model_runner import ModelRunner, runner_with_pool
from ferryman.worker.tp_devices import KvSizing, everywhere, rank_device, rank_num_blocks
from ferryman.worker.tp_rendezvous import RankFailedError as RankFailedError
from ferryman.worker.tp_rendezvous import init_rank as init_rank

PLAN_FIELDS = (
    "table_rows",
    "table_cols",
    "table_blocks",
    "rows",
    "seq_lens",
    "qo_indptr",
    "kv_indptr",
    "kv_last_page_len",
    "input_ids",
    "inflight_token_indices",
    "inflight_sample_indices",
    "logits_indices",
    "blocks_to_swap_out",
    "blocks_to_swap_in",
    "blocks_to_copy",
    "num_scheduled_tokens",
)


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank builds its part from (picklable, sent to the workers at spawn)."""

    model: str
    dtype: str  # torch dtype name, e.g. "float32"
    world: int
    init_method: str
    block_size: int
    num_device_blocks: int | None  # None: every rank profiles its device with ``sizing`` (CUDA)
    num_host_blocks: int
    max_num_seqs: int
    max_model_len: int
    attention_backend: str
    timeout_s: float = 60.0  # the forward's collectives (FERRYMAN_TEST_TP_TIMEOUT_S in tests)
    device: str = "cpu"  # rank 0's; rank r runs on ``tp_devices.rank_device(device, r)``
    sizing: KvSizing | None = None


def build_runner(spec: RankSpec, rank: int, plans: Any, model: Any = None) -> ModelRunner:
    """This rank's KV pool and runner around its model slice (loaded here unless given), on its
    device; the pool's size is agreed over ``plans`` when it is profiled."""
    from ferryman.model_loader import load_model

    device, dtype = rank_device(spec.device, rank), getattr(torch, spec.dtype)
    given, tp = model, TensorParallel(rank, spec.world)

    def load() -> Any:  # rank 0 brings its slice
        return given if given is not None else load_model(spec.model, dtype, device, tp)[0]

    model = everywhere(load, plans)  # a load that fails anywhere fails everywhere

    def profile(s: KvSizing, sampler_rows: int) -> int:
        return profile_kv_blocks(
            model, spec.block_size, s.max_num_batched_tokens, s.bytes_per_block,
            s.gpu_memory_utilization, spec.attention_backend, sampler_rows,
        )  # fmt: skip

    blocks = rank_num_blocks(spec.num_device_blocks, spec.sizing, rank, plans, profile)
    return runner_with_pool(
        model,
        dtype,
        device,
        spec.block_size,
        blocks,
        spec.num_host_blocks,
        spec.attention_backend,
        enforce_eager=device.type == "cuda",
        max_num_seqs=spec.max_num_seqs,
        max_model_len=spec.max_model_len,
    )


def worker_main(rank: int, spec: RankSpec) -> None:
    """A worker rank: build its part, then run every plan rank 0 broadcasts until ``None``."""
    plans = init_rank(spec, rank)
    runner = build_runner(spec, rank, plans)
    try:
        with torch.inference_mode():
            while True:
                box: list[Any] = [None]
                dist.broadcast_object_list(box, src=0, group=plans)
                if box[0] is None:
                    return
                fields, also, inflight = box[0]
                ids = sent_ids(inflight, runner.device)
                runner.execute(SimpleNamespace(**fields), ids, also)  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()


class Workers(Protocol):
    """Ranks 1..N-1, however they were started (each runs ``worker_main``); ``spec`` is the one
    they joined with, which rank 0 joins with too."""

    spec: RankSpec

    def dead(self) -> list[str]:
        """The workers that have stopped, named for an error message."""

    def join(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for every worker to return."""

    def kill(self) -> None:
        """Stops every worker still running and frees what starting them took."""


def _spawned_main(rank: int, spec: RankSpec) -> None:
    """``worker_main`` deaf to a process group's Ctrl-C and SIGTERM: rank 0 drains, then stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    worker_main(rank, spec)


class SpawnedWorkers:
    """The ``mp`` backend: a spawned process per worker rank (deaf to SIGTERM: ``_stop`` kills them)."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(target=_spawned_main, args=(r, spec), daemon=True) for r in range(1, spec.world)
        ]
        for p in self.procs:
            p.start()

    def dead(self) -> list[str]:
        return [f"pid {p.pid}" for p in self.procs if not p.is_alive()]

    def join(self, timeout: float) -> None:
        for p in self.procs:
            p.join(timeout=timeout)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)  # reaped, not left a zombie


def start(
    spec: RankSpec, model: Any, launch: Callable[[RankSpec], Workers] = SpawnedWorkers
) -> TensorParallelRunner:
    """Starts ranks 1..N-1 with ``launch`` (the ``mp`` backend unless given), joins them as rank 0
    and builds rank 0's runner around ``model``. One tensor-parallel engine per process: the
    default process group is the process's (a dropped engine's runner gives it up when
    collected)."""
    if dist.is_initialized():
        gc.collect()
    if dist.is_initialized():
        raise RuntimeError(
            "another tensor-parallel engine runs in this process (one at a time): shut it down first "
            "(engine.shutdown())"
        )
    workers = launch(spec)
    try:
        plans = init_rank(workers.spec, 0, workers.dead)
        return TensorParallelRunner(build_runner(workers.spec, 0, plans, model), workers, plans)
    except BaseException:  # no half-started ranks left behind
        workers.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


def sent_ids(inflight: tuple[int, str] | None, device: torch.device) -> torch.Tensor | None:
    """The previous step's sampled ids rank 0 broadcasts after a plan with tokens in flight
    (``inflight``: their count and dtype), received on this rank's device."""
    if inflight is None:
        return None
    ids = torch.empty(inflight[0], dtype=getattr(torch, inflight[1]), device=device)
    dist.broadcast(ids, src=0)
    return ids


@dataclass
class _Ranks:
    """What stopping the workers takes, apart from the runner, so a runner that is dropped (or the
    interpreter's exit) can stop them (``_stop``). ``broken``: a step on rank 0 did not complete
    (it raised, or was interrupted): the workers may wait inside a collective, no step runs."""

    workers: Workers
    plans: Any
    broken: bool = False


def _stop(ranks: _Ranks) -> None:
    """Stops the workers and leaves the group: idle workers exit on the ``None`` plan; those left
    (after a broken step they may sit in a collective until it times out, 60 s) are killed."""
    if not ranks.broken:
        # a worker already gone (gloo raises plain RuntimeErrors), or the group already destroyed
        with contextlib.suppress(RuntimeError, ValueError):
            dist.broadcast_object_list([None], src=0, group=ranks.plans)
        ranks.workers.join(timeout=10)
    ranks.workers.kill()
    if dist.is_initialized():
        dist.destroy_process_group()


class TensorParallelRunner:
    """Rank 0's runner: sends each plan to the workers, then runs it here. Anything else (the KV
    pool, the model, graph counts) is rank 0's runner's."""

    def __init__(self, local: ModelRunner, workers: Workers, plans: Any) -> None:
        self.local, self.workers, self.plans = local, workers, plans
        self.plan_send_s, self.num_plans, self.num_inputs_filled = 0.0, 0, 0  # the last: sent ids (async)
        self.ranks = _Ranks(workers, plans)
        self._stopper = weakref.finalize(self, _stop, self.ranks)  # once: shutdown, drop or exit
        self._stopper.atexit = False  # at exit before multiprocessing's hook (its SIGTERM is ignored)
        atexit.register(self._stopper)

    def execute(
        self, out: Any, prev: torch.Tensor | None = None, also: np.ndarray | None = None
    ) -> torch.Tensor:
        started, sent, done = time.perf_counter(), False, False
        try:
            if self.ranks.broken:  # the workers may sit in that step's collectives: no plan reaches them
                raise RuntimeError("a step on rank 0 was interrupted: the ranks are out of step")
            plan = {f: getattr(out, f) for f in PLAN_FIELDS}
            ids = prev if len(out.inflight_token_indices) else None
            inflight = None if ids is None else (len(ids), str(ids.dtype).removeprefix("torch."))
            sent = True  # from here a Ctrl-C leaves them out of step
            dist.broadcast_object_list([(plan, also, inflight)], src=0, group=self.plans)
            if ids is not None:  # queued behind this rank's sampling on CUDA; the host does not wait
                dist.broadcast(ids.contiguous(), src=0)
                self.num_inputs_filled += len(out.inflight_token_indices)
            self.plan_send_s += time.perf_counter() - started
            self.num_plans += 1
            logits = self.local.execute(out, prev, also)
            done = True
            return logits
        except Exception as e:  # a collective failed, or the ranks are out of step: nothing can run
            dead = ", ".join(self.workers.dead()) or "none yet"
            raise RankFailedError(f"a tensor-parallel rank failed (workers stopped: {dead}): {e!r}") from e
        finally:
            self.ranks.broken |= sent and not done  # Ctrl-C inside the forward too

    def shutdown(self) -> None:
        """Stops the workers and leaves the group (``_stop``), once."""
        self._stopper()
        atexit.unregister(self._stopper)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)
