"""Prometheus metrics of a running engine, in a registry owned by one server (no global state).

Updated only from the engine thread (``on_step``, ``set_state``, ``on_finished``, ``on_added``), read by
``GET /metrics``. Counters about preemption come from the core's telemetry events, so they equal
the ``"preemption"`` records of the step trace one for one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ferryman._core import SchedulerConfig
from ferryman.outputs import PreemptionEvent, RequestMetrics, StepStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_FAST_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class Metrics:
    def __init__(self, config: SchedulerConfig, model_name: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._cfg = config
        p = "ferryman_"
        self.running = Gauge(p + "num_requests_running", "requests running", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "requests waiting to be scheduled", registry=r)
        self.swapped = Gauge(p + "num_requests_swapped", "requests swapped out to host memory", registry=r)
        self.device_usage = Gauge(
            p + "kv_device_usage_ratio", "fraction of device KV blocks in use", registry=r
        )
        self.host_usage = Gauge(p + "kv_host_usage_ratio", "fraction of host KV blocks in use", registry=r)
        self.device_free = Gauge(p + "kv_device_blocks_free", "free device KV blocks", registry=r)
        self.host_free = Gauge(p + "kv_host_blocks_free", "free host KV blocks", registry=r)
        self.device_free.set(config.num_device_blocks)  # all free until the first step says otherwise
        self.host_free.set(config.num_host_blocks)
        Gauge(p + "kv_device_blocks", "device KV blocks", registry=r).set(config.num_device_blocks)
        Gauge(p + "kv_host_blocks", "host KV blocks", registry=r).set(config.num_host_blocks)
        info = Gauge(p + "model_info", "the served model", ["model"], registry=r)
        info.labels(model=model_name).set(1)
        self.budget_util = Histogram(
            p + "token_budget_utilization",
            "scheduled tokens / max_num_batched_tokens per step",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.preemptions = Counter(
            p + "preemptions", "preemptions by chosen mode and reason", ["mode", "reason"], registry=r
        )
        self.swapped_out = Counter(p + "blocks_swapped_out", "KV blocks copied device->host", registry=r)
        self.swapped_in = Counter(p + "blocks_swapped_in", "KV blocks copied host->device", registry=r)
        self.swap_bytes = Counter(p + "swap_bytes", "KV bytes moved by swap", ["direction"], registry=r)
        # the core's counters (from stats()): blocks swapped out = in + dropped + those held on the host
        self._core_counters = {
            "num_blocks_swap_dropped": Counter(
                p + "swap_blocks_dropped",
                "host blocks freed without a swap-in (the request ended while swapped, or lost its prefix)",
                registry=r,
            ),
            "num_swap_prefix_lost": Counter(
                p + "swap_prefix_lost",
                "swapped requests recomputed, not swapped in (their prefix kept on the device was evicted)",
                registry=r,
            ),
            "num_swap_fallbacks": Counter(
                p + "swap_fallbacks", "swaps refused for lack of host blocks: recomputed instead", registry=r
            ),
        }
        self._last_core = dict.fromkeys(self._core_counters, 0)
        self.prefix_queries = Counter(
            p + "prefix_cache_queries", "prompt tokens looked up (not a resumed victim's)", registry=r
        )
        self.prefix_hits = Counter(p + "prefix_cache_hits", "prompt tokens found cached", registry=r)
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate", "hits / queries since start", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self.requests_finished = Counter(
            p + "requests_finished",
            "finished sequences by reason (each of a request's n; unfinished at a disconnect: abort)",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(p + "time_to_first_token_seconds", "TTFT", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            p + "time_per_output_token_seconds", "TPOT", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds", "end-to-end latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue = Histogram(
            p + "request_queue_time_seconds",
            "arrival to first scheduled",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.sched = Histogram(
            p + "scheduler_time_seconds",
            "core schedule() CPU time per step",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            p + "step_seconds", "wall time per step", buckets=_LATENCY_BUCKETS, registry=r
        )
        self._last_queries = 0
        self._last_hits = 0

    def on_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_step(
        self,
        plans: list[StepStats],
        events: list[PreemptionEvent],
        stats: dict[str, int],
        new_tokens: int,
        step_s: float,
    ) -> None:
        """One ``Engine.step()``: the steps it applied (with async scheduling, also the failed
        step planned after it), their preemptions, the core's stats after it."""
        cfg = self._cfg
        self.set_state(stats)
        for e in events:
            self.preemptions.labels(mode=e.mode, reason=e.reason).inc()
        for plan in plans:
            self.budget_util.observe(plan.num_scheduled_tokens / cfg.max_num_batched_tokens)
            self.sched.observe(plan.schedule_ns * 1e-9)
            out, inn = plan.num_blocks_swapped_out, plan.num_blocks_swapped_in
            if out:
                self.swapped_out.inc(out)
                self.swap_bytes.labels(direction="out").inc(out * cfg.bytes_per_block)
            if inn:
                self.swapped_in.inc(inn)
                self.swap_bytes.labels(direction="in").inc(inn * cfg.bytes_per_block)
        for name, counter in self._core_counters.items():
            counter.inc(stats[name] - self._last_core[name])
            self._last_core[name] = stats[name]
        q, h = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
        self.prefix_queries.inc(q - self._last_queries)
        self.prefix_hits.inc(h - self._last_hits)
        self._last_queries, self._last_hits = q, h
        self.prefix_hit_rate.set(h / q if q else 0.0)
        self.generation_tokens.inc(new_tokens)
        self.step_time.observe(step_s)

    def set_state(self, stats: dict[str, int]) -> None:
        """Queue sizes and KV use from the core's ``stats()``: after every step, and once more
        when the last request has left (finished or aborted) so the gauges show the empty engine."""
        cfg = self._cfg
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.swapped.set(stats["num_swapped"])
        self.device_free.set(stats["num_free_device_blocks"])
        self.host_free.set(stats["num_free_host_blocks"])
        self.device_usage.set(1 - stats["num_free_device_blocks"] / max(1, cfg.num_device_blocks))
        self.host_usage.set(1 - stats["num_free_host_blocks"] / max(1, cfg.num_host_blocks))

    def on_finished(self, m: RequestMetrics | None, reasons: list[str | None], num_tokens: int) -> None:
        """A finished or aborted request: its metrics (None when aborted), each sequence's finish
        reason (None: abort), counted one by one, and the output tokens of its longest sequence."""
        for r in reasons:
            self.requests_finished.labels(reason=r or "abort").inc()
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if num_tokens > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
