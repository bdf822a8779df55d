"""The real core driven through the binding by a fake transformer (``fakemodel.py``) over random
workloads, in every preemption mode and policy, with tight pools: each step stays within its
budgets, every request ends with exactly its tokens — the same tokens as an unconstrained run —
and every block is free at the end."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fakemodel import FakeModel, run_to_completion
from ferryman import RequestParams, Scheduler, SchedulerConfig

Arrivals = dict[int, list[tuple[int, list[int], int, dict[str, int]]]]


def workload(seed: int, num_requests: int, vocab: int = 4) -> Arrivals:
    """Random prompts over a tiny vocabulary (so prefixes are shared), some with n > 1."""
    rng = random.Random(seed)
    arrivals: Arrivals = {}
    for r in range(num_requests):
        prompt = [rng.randrange(1, vocab + 1) for _ in range(rng.randint(1, 40))]
        kw = {"priority": rng.randrange(3), "ignore_eos": True}
        if rng.random() < 0.15:
            kw["n"] = rng.randint(2, 3)
        arrivals.setdefault(rng.randrange(30), []).append((r, prompt, rng.randint(1, 24), kw))
    return arrivals


def run(arrivals: Arrivals, **cfg: object) -> tuple[dict[tuple[int, int], list[int]], Scheduler, list]:  # type: ignore[type-arg]
    c = SchedulerConfig(**cfg)  # type: ignore[arg-type]
    s = Scheduler(c)
    model = FakeModel(c.block_size, c.num_device_blocks, c.num_host_blocks)
    tokens, reasons, outs = run_to_completion(s, model, arrivals)
    for out in outs:
        assert out.num_scheduled_tokens == len(out.input_ids) <= c.max_num_batched_tokens
        assert out.num_running <= c.max_num_seqs
    st = s.stats()
    assert st["num_free_device_blocks"] == c.num_device_blocks
    assert st["num_free_host_blocks"] == c.num_host_blocks
    assert not s.has_unfinished_requests()
    assert st["num_preemptions"] == st["num_events"] == len(s.drain_events())
    assert set(reasons.values()) == {"length"}
    return tokens, s, outs


def expected_lengths(arrivals: Arrivals) -> dict[tuple[int, int], int]:
    want = {}
    for reqs in arrivals.values():
        for r, _, max_tokens, kw in reqs:
            for k in range(kw.get("n", 1)):
                want[(r, k)] = max_tokens
    return want


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1])
def test_tight_pools_give_the_same_tokens_as_an_ample_one(mode: str, policy: str, seed: int) -> None:
    arrivals = workload(seed, 40)
    want = expected_lengths(arrivals)
    ample, _, _ = run(arrivals, block_size=4, num_device_blocks=4096, max_model_len=128, policy=policy)
    assert {k: len(v) for k, v in ample.items()} == want
    tight, s, outs = run(
        arrivals,
        block_size=4,
        num_device_blocks=20,
        num_host_blocks=12,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        max_model_len=64,
        preemption_mode=mode,
        policy=policy,
        watermark=0.05,
        bytes_per_block=[1e3, 1e9][seed],
        host_link_bytes_per_s=1e9,
        prefill_tokens_per_s=1e4,
    )
    assert tight == ample
    st = s.stats()
    assert st["num_preemptions"] > 0, "the pool must be tight enough to preempt"
    if mode == "recompute":
        assert st["num_preemptions_swap"] == 0
    if mode == "swap":
        assert st["num_preemptions_swap"] > 0
    assert sum(len(o.preempted_req_ids) for o in outs) == st["num_preemptions"]


def test_without_chunking_or_prefix_cache() -> None:
    arrivals = workload(7, 30)
    ample, _, _ = run(
        arrivals, block_size=2, num_device_blocks=4096, max_model_len=64, max_num_batched_tokens=64
    )
    tight, s, _ = run(
        arrivals,
        block_size=2,
        num_device_blocks=40,
        num_host_blocks=20,
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        preemption_mode="auto",
    )
    assert tight == ample
    assert s.stats()["prefix_cache_queries"] == 0


def test_abort_and_stop_string_finish_free_blocks_mid_run() -> None:
    c = SchedulerConfig(
        block_size=4, num_device_blocks=12, num_host_blocks=8, max_model_len=64, watermark=0.0
    )
    s = Scheduler(c)
    model = FakeModel(4, 12, 8)
    for r in range(6):
        s.add_request(r, [r + 1] * 10, RequestParams(20, ignore_eos=True, n=2 if r == 0 else 1))
    for step in range(12):
        out = s.schedule()
        if step == 5:
            assert s.abort_request(3)
            s.finish_request(0, "stop", seq_index=1)
        s.update(model.forward(out))
        s.check_invariants()
    while s.has_unfinished_requests():
        s.update(model.forward(s.schedule()))
    assert s.stats()["num_free_device_blocks"] == 12
    assert np.all(model.device[0] == 0), "the null block is never written"
