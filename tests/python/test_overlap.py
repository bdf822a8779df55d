"""Async scheduling (overlap) against the synchronous engine on tiny random checkpoints: the same
greedy and seeded-sampled outputs, text and stop strings in every preemption mode; a stop found
one step late drops its extra token; an abort while a request's token is in flight loses no
other request's work; pools end empty."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tiny_models import build

from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams

POOLS = {
    "ample": {"num_device_blocks": 256, "num_host_blocks": 0},
    "tight": {"num_device_blocks": 24, "num_host_blocks": 32, "max_num_batched_tokens": 16},
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("models"), tokenizer=True)


def test_overlap_is_off_by_default_on_cpu_and_on_when_asked(model: Path) -> None:
    assert not Engine(str(model), calibrate=False).scheduler.config.async_scheduling
    assert Engine(str(model), calibrate=False, async_scheduling=True).scheduler.config.async_scheduling


def engine(model: Path, async_scheduling: bool, pool: str = "ample", **kw: object) -> Engine:
    args = {"block_size": 4, "calibrate": False, **POOLS[pool], **kw}
    return Engine(str(model), async_scheduling=async_scheduling, **args)  # type: ignore[arg-type]


def workload(model: Path) -> tuple[list[str], list[SamplingParams]]:
    """Prompts sharing a prefix, and a mix of greedy, seeded sampling, n = 2, a stop string and a
    stop token id (both taken from a probe run, so they fire mid-output)."""
    base = "the river runs to the sea and "
    prompts = [base + s for s in ("one", "two", "three", "four", "five", "six")] + [base[:9]]
    params = []
    for i in range(len(prompts)):
        if i % 3 == 1:
            sp = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, seed=7 + i, max_tokens=14)
        else:
            sp = SamplingParams(temperature=0.0, max_tokens=14, n=2 if i == 2 else 1)
        params.append(dataclasses.replace(sp, ignore_eos=True))
    probe = engine(model, False).generate(prompts[:4], params[:4])
    text = probe[3].outputs[0].text
    params[3] = dataclasses.replace(params[3], stop=[text[5:7]])
    params[0] = dataclasses.replace(params[0], stop_token_ids=[probe[0].outputs[0].token_ids[4]])
    return prompts, params


def run(
    eng: Engine, prompts: list[str], params: list[SamplingParams]
) -> list[list[tuple[str, list[int], str]]]:
    outs = eng.generate(prompts, params)
    return [[(c.text, c.token_ids, c.finish_reason or "") for c in o.outputs] for o in outs]


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_overlap_gives_the_synchronous_outputs_under_forced_preemption(model: Path, mode: str) -> None:
    prompts, params = workload(model)
    want = run(engine(model, False), prompts, params)
    sync_tight = engine(model, False, "tight", preemption_mode=mode)
    async_tight = engine(model, True, "tight", preemption_mode=mode)
    assert run(sync_tight, prompts, params) == want
    assert run(async_tight, prompts, params) == want
    st = async_tight.stats()
    assert st["num_preemptions"] > 0, "the pool must force preemption"
    if mode == "swap":
        assert st["num_preemptions_swap"] > 0
    assert st["num_free_device_blocks"] == 24 and st["num_free_host_blocks"] == 32
    assert not async_tight.has_unfinished_requests()
    assert want[0][0][2] == want[3][0][2] == "stop", "the stop token and the stop string fire"


def test_overlap_streams_the_same_deltas_and_counts_only_kept_tokens(model: Path) -> None:
    """Deltas concatenate to the synchronous text; a sequence that stops in step N has its token
    of step N+1 dropped, so the steps' generated-token counts add up to the outputs' tokens."""
    prompts, params = workload(model)
    texts: dict[bool, dict[str, str]] = {}
    for on in (False, True):
        eng = engine(model, on)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            eng.add_request(str(i), p, dataclasses.replace(sp, n=1, output_kind="delta"))
        got: dict[str, str] = {}
        tokens: dict[str, int] = {}
        generated = 0
        while eng.has_unfinished_requests():
            res = eng.step()
            assert res.stats is not None
            generated += res.stats.num_generated_tokens
            for o in res.outputs:
                m = o.metrics
                assert m.first_scheduled_time is not None and m.first_token_time is not None
                assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
                got[o.request_id] = got.get(o.request_id, "") + o.outputs[0].text
                tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.outputs[0].token_ids)
        assert generated == sum(tokens.values())
        texts[on] = got
    assert texts[True] == texts[False]


def test_abort_while_a_token_is_in_flight_keeps_the_others(model: Path) -> None:
    prompts, params = workload(model)
    greedy = [dataclasses.replace(sp, temperature=0.0, n=1, output_kind="final_only") for sp in params]
    want = run(engine(model, False), prompts, greedy)
    eng = engine(model, True, "tight", preemption_mode="swap")
    for i, (p, sp) in enumerate(zip(prompts, greedy, strict=True)):
        eng.add_request(str(i), p, sp)
    done: dict[str, list[tuple[str, list[int], str]]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step().outputs:
            assert o.request_id != "5" or steps < 4, "an aborted request hands out nothing more"
            done[o.request_id] = [(c.text, c.token_ids, c.finish_reason or "") for c in o.outputs]
        steps += 1
        if steps == 4:
            assert eng.abort_request("5"), "request 5 is still running, its next token in flight"
            eng.add_request("late", prompts[0], greedy[0])  # may reuse the aborted core id later
    assert "5" not in done
    assert done["late"] == want[0]
    assert [done[str(i)] for i in range(len(prompts)) if i != 5] == [w for i, w in enumerate(want) if i != 5]
    st = eng.stats()
    assert st["num_free_device_blocks"] == 24 and st["num_free_host_blocks"] == 32


def collect(eng: Engine, prompt: str, sp: SamplingParams) -> list[tuple[list[int], str | None, int]]:
    """Each fork's tokens, finish reason and logprob count as a caller sees them, per output kind
    (deltas concatenated; nothing may follow a fork's finish)."""
    eng.add_request("r", prompt, sp)
    forks: dict[int, tuple[list[int], str | None, int]] = {}
    while eng.has_unfinished_requests():
        for ro in eng.step().outputs:
            for o in ro.outputs:
                lps = len(o.logprobs or [])
                if sp.output_kind != "delta":
                    forks[o.index] = (list(o.token_ids), o.finish_reason, lps)
                    continue
                toks, reason, n = forks.get(o.index, ([], None, 0))
                assert reason is None or not o.token_ids, "a delta after the fork finished"
                forks[o.index] = (toks + o.token_ids, reason or o.finish_reason, n + lps)
    return [forks[k] for k in sorted(forks)]


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_a_fork_that_stops_early_hands_out_no_dropped_token(model: Path, kind: str) -> None:
    """n = 2 where one fork stops while the other runs on: that fork's sample planned before its
    stop is dropped by the core and must reach no output, token or logprob."""
    prompt = "the river runs to the sea and "
    base = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12, ignore_eos=True, logprobs=1)
    probe = engine(model, False).generate([prompt], [base])[0]
    f0, f1 = probe.outputs[0].token_ids, probe.outputs[1].token_ids
    stop = next(t for j, t in enumerate(f0) if j >= 2 and t not in f1 and t not in f0[:j])
    sp = dataclasses.replace(base, stop_token_ids=[stop], output_kind=kind)
    want = collect(engine(model, False), prompt, sp)
    assert want[0][1] == "stop" and want[1][1] == "length" and len(want[0][0]) < len(want[1][0])
    assert collect(engine(model, True), prompt, sp) == want


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_parent_preempted_before_its_fork_loses_its_samples_cleanly(model: Path, mode: str) -> None:
    """An n = 2 parent preempted while its prompt's samples are in flight is recomputed (event
    reason "fork"); the dropped samples must not reach the forks' cumulative outputs."""
    prompts, _ = workload(model)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=2, output_kind="cumulative")
    outs = {}
    for on in (False, True):
        eng = engine(model, on, "tight", preemption_mode=mode)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, sp)
        got, reasons = {}, set()
        while eng.has_unfinished_requests():
            res = eng.step()
            reasons |= {e.reason for e in res.preemptions}
            assert res.stats is not None  # a step's preemptions come with that step, not the one before
            assert all(e.step == res.stats.step for e in res.preemptions), (res.stats.step, res.preemptions)
            got.update({o.request_id: [c.token_ids for c in o.outputs] for o in res.outputs})
        outs[on] = got
        if on:
            assert "fork" in reasons, "the pool must preempt a parent before its fork"
    assert outs[True] == outs[False]
    assert all(len(t) == 10 for forks in outs[True].values() for t in forks)
