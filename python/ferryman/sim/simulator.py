"""``simulate()``: ferryman's own Rust scheduler, unchanged, driven by a virtual clock whose steps
last what the roofline (``cost.py``) says the planned batch takes on the chosen GPU.

Each iteration: admit the requests that have arrived by now, ``schedule()``, price the plan
(forward + swap traffic), advance the clock, and ``update()`` with a dummy token per sample (no
EOS, so every request ends at its ``output_len``). When nothing is running or waiting the clock
jumps to the next arrival.

Pool sizes follow a GPU deployment (one rank's with ``tensor_parallel_size`` > 1: its share of
the weights and of every block's KV heads): device KV = ``memory * gpu_memory_utilization`` minus
the weights and an activation reserve (``max_num_batched_tokens * (8 h + 2 I) * b`` plus fp32 logits
for ``max_num_seqs`` rows), host KV = ``swap_space`` GiB. The core's ``auto`` cost model gets
what start-up calibration would measure there: the exact bytes per block, the GPU's host-link
bandwidth, and the roofline's prefill rate at the token budget.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ferryman._core import RequestParams, Scheduler
from ferryman.engine_args import SchedulerArgs, at_least, in_unit_interval, knob
from ferryman.outputs import PreemptionEvent, StepStats
from ferryman.sim.cost import Roofline
from ferryman.sim.presets import LINKS, GpuSpec, ModelShape, tp_split
from ferryman.sim.workload import Workload
from ferryman.trace import TraceWriter, step_record

_TOKEN = np.int32(1)


@dataclass(kw_only=True)
class SimConfig(SchedulerArgs):
    """The scheduler's knobs (``SchedulerArgs``, shared with the Engine) plus the cost model's.
    ``max_model_len`` defaults to the workload's longest request; the token budget to a GPU's."""

    dtype_bytes: int = knob(2, "bytes per weight and KV element", check=at_least(1))
    compute_efficiency: float = knob(0.6, "share of peak FLOP/s a step reaches", check=in_unit_interval)
    bandwidth_efficiency: float = knob(
        0.8, "share of peak HBM bandwidth a step reaches", check=in_unit_interval
    )
    step_overhead_s: float = knob(1e-3, "fixed host time per step, seconds", check=at_least(0))
    tensor_parallel_size: int = knob(
        1, "GPUs one model is split over (tensor parallelism)", check=at_least(1)
    )
    interconnect: str = knob("nvlink", "how the tensor-parallel GPUs talk", choices=("nvlink", "pcie"))

    def budget(self, max_model_len: int) -> int:
        """The step's token budget on the simulated GPU."""
        return self.token_budget("cuda", max_model_len)


def pool_sizes(
    gpu: GpuSpec, shape: ModelShape, cfg: SimConfig, budget: int | None = None
) -> tuple[int, int, int]:
    """(device blocks, host blocks, bytes per block) for this deployment; the activation reserve
    is sized for ``budget`` tokens a step (default: ``cfg``'s budget at its ``max_model_len``)."""
    b, tp = cfg.dtype_bytes, cfg.tensor_parallel_size
    # one rank's: its share of the KV heads, of the weights; every rank holds every block's slice
    block_bytes = int(shape.kv_bytes_per_token(b) * cfg.block_size * tp_split(shape, tp))
    if cfg.num_device_blocks is None:
        weights = shape.num_params * b / tp
        h, inter = shape.hidden_size, shape.intermediate_size
        activations = (budget or cfg.budget(cfg.max_model_len or 0)) * (
            8 * h + 2 * inter
        ) * b + cfg.max_num_seqs * shape.vocab_size * 4
        kv = gpu.memory_bytes * cfg.gpu_memory_utilization - weights - activations
        if kv < block_bytes:
            raise ValueError(
                f"{shape.name} ({weights / 1e9:.1f} GB of weights) leaves no KV memory on {gpu.name} at "
                f"gpu_memory_utilization={cfg.gpu_memory_utilization}"
            )
        device = int(kv // block_bytes)
    else:
        device = cfg.num_device_blocks
    host = (
        cfg.num_host_blocks
        if cfg.num_host_blocks is not None
        else int(cfg.swap_space * (1 << 30)) // block_bytes
    )
    return device, host, block_bytes


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else 0.0


def _dist(name: str, x: np.ndarray) -> dict[str, float]:
    ms = x * 1e3
    return {
        f"{name}_mean_ms": round(float(ms.mean()) if len(ms) else 0.0, 3),
        **{f"{name}_p{q}_ms": round(_pct(ms, q), 3) for q in (50, 90, 99)},
    }


def _token_times(step_ids: list[np.ndarray], step_clock: list[float], n: int) -> tuple[np.ndarray, ...]:
    """Per request, its first and last token times, and every inter-token gap, from the list of
    requests that got a token at each step (done once at the end: cheaper than per step)."""
    if not step_ids:
        return np.full(n, np.nan), np.full(n, np.nan), np.zeros(0)
    ids = np.concatenate(step_ids)
    t = np.repeat(np.asarray(step_clock), [len(a) for a in step_ids])
    order = np.lexsort((t, ids))  # by request, then time
    ids, t = ids[order], t[order]
    new = np.ones(len(ids), dtype=bool)
    new[1:] = ids[1:] != ids[:-1]
    end = np.ones(len(ids), dtype=bool)
    end[:-1] = new[1:]
    first, done = np.full(n, np.nan), np.full(n, np.nan)
    first[ids[new]] = t[new]
    done[ids[end]] = t[end]
    gaps = np.diff(t)[~new[1:]]
    return first, done, gaps


def simulate(
    gpu: GpuSpec,
    shape: ModelShape,
    work: Workload,
    cfg: SimConfig | None = None,
    trace: TraceWriter | None = None,
) -> dict[str, Any]:
    """Runs the workload to completion; returns the report (throughput, latency percentiles,
    preemptions by mode, bytes swapped, recomputed tokens, KV utilisation)."""
    cfg = cfg or SimConfig()
    if cfg.interconnect not in LINKS:
        raise ValueError(f"interconnect must be one of {sorted(LINKS)}, got {cfg.interconnect!r}")
    roof = Roofline(
        gpu,
        shape,
        cfg.dtype_bytes,
        cfg.compute_efficiency,
        cfg.bandwidth_efficiency,
        cfg.step_overhead_s,
        cfg.tensor_parallel_size,
        LINKS[cfg.interconnect],
    )
    longest = int((work.prompt_len + work.output_len).max())
    max_model_len = cfg.max_model_len or longest
    budget = cfg.budget(max_model_len)
    device, host, block_bytes = pool_sizes(gpu, shape, cfg, budget)
    sched = Scheduler(
        cfg.scheduler_config(
            num_device_blocks=device,
            num_host_blocks=host,
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            bytes_per_block=float(block_bytes),
            host_link_bytes_per_s=gpu.host_link_bytes_per_s,
            prefill_tokens_per_s=roof.prefill_tokens_per_s(budget),
        )
    )
    n = len(work)
    step_ids: list[np.ndarray] = []  # requests that got a token in each step, and when
    step_clock: list[float] = []
    clock, nxt, steps, busy_s, kv_used_s, swap_s_total, comm_s_total = 0.0, 0, 0, 0.0, 0.0, 0.0, 0.0
    started = time.perf_counter()
    out_len = work.output_len
    tokens = np.full(cfg.max_num_seqs, _TOKEN, dtype=np.int32)  # the dummy sample of every row
    while nxt < n or sched.has_unfinished_requests():
        while nxt < n and work.arrival_s[nxt] <= clock:
            prio = 0 if work.priority is None else int(work.priority[nxt])
            sched.add_request(nxt, work.prompts[nxt], RequestParams(int(out_len[nxt]), priority=prio))
            nxt += 1
        if not sched.has_unfinished_requests():
            clock = float(work.arrival_s[nxt])
            continue
        plan = sched.schedule()
        cost = roof.plan_cost(plan)
        moved = len(plan.blocks_to_swap_out) + len(plan.blocks_to_swap_in)
        swap_s = moved * block_bytes / gpu.host_link_bytes_per_s
        dt = cost.step_s + swap_s
        if dt == 0.0:  # nothing could run: only a new arrival changes that
            if nxt >= n:
                raise RuntimeError("simulation stalled: requests left but none can be scheduled")
            clock = max(clock, float(work.arrival_s[nxt]))
            sched.update(np.zeros(0, dtype=np.int32))
            continue
        clock += dt
        steps += 1
        busy_s += dt
        swap_s_total += swap_s
        comm_s_total += cost.comm_s
        kv_used_s += dt * (1.0 - plan.num_free_device_blocks / device)
        res = sched.update(tokens[: len(plan.logits_indices)])
        step_ids.append(res.req_ids)
        step_clock.append(clock)
        raw = sched.drain_events()  # drained every step, so none pile up in the core
        if trace is not None:
            events = [PreemptionEvent(**e) for e in raw]
            trace.write(step_record(StepStats.of(plan, len(res)), sched.config, events, clock, dt))
            for e in events:
                trace.write({"type": "preemption", **asdict(e)})
    first, done, itl = _token_times(step_ids, step_clock, n)
    wall = time.perf_counter() - started
    st = sched.stats()
    arrival = work.arrival_s
    tpot_mask = out_len > 1
    tpot = (done - first)[tpot_mask] / (out_len[tpot_mask] - 1)
    makespan = float(done.max() - arrival.min())
    by_class = {}
    if work.priority is not None:
        for p in np.unique(work.priority).tolist():
            sel = work.priority == p
            by_class[f"ttft_p99_ms_priority_{p}"] = round(_pct((first - arrival)[sel] * 1e3, 99), 3)
    return {
        "gpu": gpu.name,
        "model": shape.name,
        "num_requests": n,
        "config": {**asdict(cfg), "max_model_len": max_model_len, "max_num_batched_tokens": budget},
        "num_device_blocks": device,
        "num_host_blocks": host,
        "bytes_per_block": block_bytes,
        "steps": steps,
        "duration_s": round(makespan, 4),
        "request_throughput": round(n / makespan, 4),
        "output_token_throughput": round(float(out_len.sum()) / makespan, 2),
        **_dist("ttft", first - arrival),
        **_dist("tpot", tpot),
        **_dist("itl", itl),
        **_dist("e2e", done - arrival),
        **by_class,
        "preemptions_recompute": st["num_preemptions_recompute"],
        "preemptions_swap": st["num_preemptions_swap"],
        "swap_fallbacks": st["num_swap_fallbacks"],
        "bytes_swapped": (st["num_blocks_swapped_out"] + st["num_blocks_swapped_in"]) * block_bytes,
        "swap_time_s": round(swap_s_total, 4),
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "comm_share": round(comm_s_total / busy_s, 4) if busy_s else 0.0,  # of busy time
        "tokens_recomputed": st["num_tokens_recomputed"],
        "prefix_cache_hit_rate": round(st["prefix_cache_hits"] / max(1, st["prefix_cache_queries"]), 4),
        "kv_utilization": round(kv_used_s / busy_s, 4) if busy_s else 0.0,
        "sim_wall_s": round(wall, 3),
    }
