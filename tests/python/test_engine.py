"""The Engine on tiny random checkpoints (CPU, no downloads): greedy parity with transformers,
identical greedy output under forced preemption in every mode, and seeded sampling that does not
depend on the batch."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import build, dense_causal

from ferryman import InvalidRequestError
from ferryman.engine import Engine
from ferryman.models import cpu_linear
from ferryman.outputs import StepResult
from ferryman.sampling_params import SamplingParams

PROMPTS = [[5, 9, 3], list(range(10, 40)), [7] * 17, [1, 2, 3, 4, 5, 6, 7, 8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: build(kind, root) for kind in ("llama", "qwen2", "qwen3")}


def hf_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        g = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
        out.append(g[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(models: dict[str, Path], kind: str) -> None:
    want = hf_greedy(models[kind], PROMPTS, 12)
    for overlap in (False, True):
        eng = Engine(
            str(models[kind]), block_size=4, num_device_blocks=64, num_host_blocks=0, async_scheduling=overlap
        )
        # CPU float32 runs the packed projections at padded row counts: the first step's 58
        # prompt tokens run as 60 rows, so parity here covers the padding too
        assert eng.runner.model.pad_rows == cpu_linear.can_pack(torch.device("cpu"), torch.float32)
        outs = eng.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == want, f"async_scheduling={overlap}"
        assert [o.prompt_token_ids for o in outs] == PROMPTS
        assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def ample_and_tight(path: str, mode: str) -> tuple[Engine, Engine]:
    """An engine whose pool holds everything, and one small enough to force preemption in ``mode``."""
    ample = Engine(path, block_size=4, num_device_blocks=256, num_host_blocks=0)
    tight = Engine(
        path,
        block_size=4,
        num_device_blocks=24,
        num_host_blocks=32,
        max_num_batched_tokens=16,
        preemption_mode=mode,
    )
    return ample, tight


def shared_prefix_prompts() -> list[list[int]]:
    base = list(range(20, 44))  # 24 tokens: 6 full blocks shared by every prompt
    return [*([*base, i, i + 1, i + 2] for i in range(6)), base[:10]]


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_forced_preemption_gives_identical_greedy_output(models: dict[str, Path], mode: str) -> None:
    path = str(models["llama"])
    prompts = shared_prefix_prompts()
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2 if i == 2 else 1)
        for i in range(7)
    ]
    ample, tight = ample_and_tight(path, mode)
    want = [[c.token_ids for c in o.outputs] for o in ample.generate(prompts, params)]
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        tight.add_request(str(i), prompt, dataclasses.replace(sp, output_kind="final_only"))
    done, events = {}, []
    while tight.has_unfinished_requests():
        res = tight.step()
        done.update({o.request_id: o for o in res.outputs})
        events += res.preemptions
        assert res.stats is not None and all(e.step == res.stats.step for e in res.preemptions)
    got = [[c.token_ids for c in done[str(i)].outputs] for i in range(len(prompts))]
    assert got == want
    assert want[2][0] == want[2][1], "greedy forks of one request agree"
    st = tight.stats()
    assert st["num_preemptions"] > 0, "the pool must force preemption"
    if mode == "swap":
        assert st["num_preemptions_swap"] > 0
    assert st["prefix_cache_hits"] > 0
    assert st["num_free_device_blocks"] == 24 and st["num_free_host_blocks"] == 32
    assert len(events) == st["num_preemptions"]
    assert {e.mode for e in events} <= {"recompute", "swap"} and all(e.request_id in done for e in events)
    assert not tight.has_unfinished_requests()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_survives_forced_preemption(models: dict[str, Path], mode: str) -> None:
    """A preempted request comes back in another batch row; its sampling parameters must follow
    it (they live per row on the device), so seeded samples match an ample pool's."""
    path = str(models["llama"])
    prompts = shared_prefix_prompts()
    params = [
        SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=100 + i, max_tokens=16, ignore_eos=True)
        for i in range(len(prompts))
    ]
    ample, tight = ample_and_tight(path, mode)
    want = [o.outputs[0].token_ids for o in ample.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.stats()["num_preemptions"] > 0, "the pool must force preemption"
    assert got == want


def test_seeded_sampling_does_not_depend_on_the_batch(models: dict[str, Path]) -> None:
    path = str(models["qwen2"])
    sp = SamplingParams(
        temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=1234, max_tokens=10, ignore_eos=True
    )
    alone = (
        Engine(path, block_size=4, num_device_blocks=64).generate([PROMPTS[1]], sp)[0].outputs[0].token_ids
    )
    batch = Engine(path, block_size=4, num_device_blocks=64).generate(PROMPTS, [sp, sp, sp, sp])
    assert batch[1].outputs[0].token_ids == alone
    greedy_like = SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True, seed=5)
    eng = Engine(path, block_size=4, num_device_blocks=64)
    assert (
        eng.generate([PROMPTS[0]], greedy_like)[0].outputs[0].token_ids
        == eng.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    )


def test_bad_requests_are_rejected_and_others_keep_running(models: dict[str, Path]) -> None:
    eng = Engine(str(models["llama"]), block_size=4, num_device_blocks=16, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        eng.add_request("long", list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match=r"host KV pool .* exceeds this machine's memory"):
        Engine(str(models["llama"]), block_size=4, num_device_blocks=16, num_host_blocks=(1 << 31) - 2)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        eng.add_request("text", "no tokenizer here", None)
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request("empty", [], None)
    with pytest.raises(InvalidRequestError, match=r"token id 96 out of range \[0, 96\)"):
        eng.add_request("vocab", [5, 96], None)
    # ids that are not integers are refused, never truncated or read as numbers
    for bad_prompt, why in [([1.9, 2.7], "integers, got float"), ([True], "got bool"), (b"hi", "got bytes")]:
        with pytest.raises(InvalidRequestError, match=why):
            eng.add_request("ids", bad_prompt, None)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match=why):
            eng.generate([bad_prompt], GREEDY)  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError, match="got NoneType"):
        eng.add_request("none", None, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="got NoneType"):  # TypeErrors before
        eng.generate([None], GREEDY)  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError, match="sampling_params must be SamplingParams, got NoneType"):
        eng.generate([[1], [2]], [GREEDY, None])  # type: ignore[list-item]
    assert not eng.has_unfinished_requests()
    # vLLM's prompt dicts, as generate() takes them; numpy's integers are ids too
    eng.add_request("dict", {"prompt_token_ids": np.array([3, 4, 5])}, SamplingParams(max_tokens=2))  # type: ignore[arg-type]
    assert eng.abort_request("dict")
    with pytest.raises(InvalidRequestError, match="not supported"):
        eng.add_request("dict", {"prompt": "x", "image": 1}, None)  # type: ignore[arg-type]
    bad_values = [{"temperature": -1}, {"max_tokens": 0}, {"top_p": 0.0}, {"top_k": -2}]
    for bad in [*bad_values, {"min_p": 2}, {"n": 0}]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)  # type: ignore[arg-type]
    eng.add_request("ok", [3, 4, 5], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already exists"):
        eng.add_request("ok", [3], None)
    assert eng.abort_request("ok") and not eng.abort_request("ok")
    out = eng.generate([PROMPTS[0]], GREEDY)
    assert len(out[0].outputs[0].token_ids) == 12


def test_a_refused_request_or_call_leaves_nothing_queued(models: dict[str, Path]) -> None:
    # no max_model_len given and a pool smaller than the context (256): the context is the pool's
    eng = Engine(str(models["llama"]), block_size=4, num_device_blocks=16, calibrate=False)
    assert eng.max_model_len == 64 and eng.scheduler.config.max_model_len == 64
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**63)  # the sampler's seeds are int64
    for bad in ({"n": 1.5}, {"stop": [1]}, {"priority": "hi"}, {"ignore_eos": "no"}, {"top_k": 2.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)  # type: ignore[arg-type]
    for name in ("logprobs", "prompt_logprobs"):  # past max_logprobs (20): refused, not a failed step
        with pytest.raises(InvalidRequestError, match=f"{name} must be at most 20"):
            eng.add_request(name, [3, 4], SamplingParams(max_tokens=2, **{name: 21}))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="request_id must be a string, got int"):
        eng.add_request(7, [3, 4], GREEDY)  # type: ignore[arg-type]
    # an open max_tokens is the room the prompt leaves, and cuts min_tokens to it (vLLM's offline
    # rule: it checks min_tokens against a max_tokens given, not against the room it fills in)
    room = SamplingParams(temperature=0.0, max_tokens=None, min_tokens=9, ignore_eos=True)
    out = eng.generate([list(range(3, 63))], room)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (4, "length")
    # a priority the fcfs policy would ignore is refused (vLLM's rule)
    with pytest.raises(InvalidRequestError, match="priority 1 needs the priority scheduling policy"):
        eng.generate([[3, 4]], dataclasses.replace(GREEDY, priority=1))
    # a generate() whose later prompt is refused queues none of its prompts
    with pytest.raises(InvalidRequestError, match="out of range"):
        eng.generate([PROMPTS[0], [-1]], GREEDY)
    with pytest.raises(ValueError, match="2 prompts but 3"):
        eng.generate(PROMPTS[:2], [GREEDY] * 3)
    assert not eng.has_unfinished_requests() and eng.stats()["num_waiting"] == 0
    # a request of add_request's advances inside generate(); its outputs come with the next step()
    eng.add_request("mine", PROMPTS[2], dataclasses.replace(GREEDY, output_kind="final_only"))
    longer = eng.generate(PROMPTS[:1], dataclasses.replace(GREEDY, max_tokens=40))  # outlives "mine"
    assert len(longer) == 1 and len(longer[0].outputs[0].token_ids) == 40
    assert eng.has_unfinished_requests()  # "mine" is done, but its final output is still held
    mine = [o for o in eng.step().outputs if o.request_id == "mine"]
    assert len(mine) == 1 and mine[0].finished and len(mine[0].outputs[0].token_ids) == 12
    assert not eng.has_unfinished_requests()

    real, calls = eng.step, []

    def step() -> StepResult:  # Ctrl-C between two steps of a generate()
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real()

    eng.step = step  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        eng.generate(PROMPTS[:2], GREEDY)
    del eng.step
    assert not eng.has_unfinished_requests()  # its requests were aborted: the next call runs
    out = eng.generate(PROMPTS[:2], GREEDY)
    assert [len(o.outputs[0].token_ids) for o in out] == [12, 12]
    assert eng.generate(np.array(PROMPTS[0]), GREEDY)[0].outputs[0].token_ids == out[0].outputs[0].token_ids


def test_priorities_are_served_under_the_priority_policy(models: dict[str, Path]) -> None:
    eng = Engine(str(models["llama"]), block_size=4, num_device_blocks=64, policy="priority", calibrate=False)
    params = [dataclasses.replace(GREEDY, priority=p) for p in (1, -3)]
    outs = eng.generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in eng.generate(PROMPTS[:2], GREEDY)
    ]


def test_bench_throughput_smoke(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from ferryman.cli import main

    args = ["bench", "throughput", "--model", str(models["llama"]), "--num-prompts", "6"]
    args += ["--input-len", "4:12", "--output-len", "2:8", "--token-range", "3:90", "--pool-fraction", "0.5"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ours, hf = report["ferryman"], report["transformers"]
    assert ours["output_tokens"] == hf["output_tokens"] == report["ferryman_ample"]["output_tokens"]
    assert ours["num_device_blocks"] < report["ferryman_ample"]["num_device_blocks"]
    assert report["ratio_vs_transformers"] > 0 and report["ratio_vs_ample"] > 0
    demand = report["ferryman_ample"]["num_device_blocks"]  # the ample pool is the whole demand
    assert report["pool_basis"] == "demand" and ours["num_device_blocks"] >= demand // 2
    assert main([*args, "--json", "--no-hf", "--pool-basis", "peak", "--repeats", "2"]) == 0
    strict = json.loads(capsys.readouterr().out)
    runs = strict["ratio_vs_ample_runs"]
    assert strict["repeats"] == 2 and len(runs) == 2 and strict["ratio_vs_ample"] == sum(runs) / 2
    with pytest.raises(SystemExit):  # argparse: "--repeats: must be >= 1"
        main([*args, "--repeats", "0"])
    assert strict["pool_basis"] == "peak" and "transformers" not in strict
    assert main([*args[:4], "--num-prompts", "2", *args[6:12], "--no-hf", "--vs-sync", "--json"]) == 0
    vs = json.loads(capsys.readouterr().out)  # on against off, where the CPU's default is off
    assert vs["ferryman"]["async_scheduling"] and not vs["ferryman_sync"]["async_scheduling"]
    assert vs["ferryman"]["output_tokens"] == vs["ferryman_sync"]["output_tokens"]
    peak = strict["ferryman_ample"]["peak_blocks_used"]
    assert peak // 2 <= strict["ferryman"]["num_device_blocks"] <= ours["num_device_blocks"]
    assert main([*args[:4], "--num-prompts", "2", *args[6:12], "--dtype", "bfloat16", "--json"]) == 0
    half = json.loads(capsys.readouterr().out)  # both sides in bfloat16
    assert half["dtype"] == "bfloat16"
    assert half["ferryman"]["output_tokens"] == half["transformers"]["output_tokens"] > 0


def test_host_overhead_benchmark_smoke() -> None:
    """benchmarks/host_overhead.py (run by hand, never timed here) on a tiny batch: it runs every
    scenario and prints finite figures, so the script cannot rot."""
    import json
    import math
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    args = ["--requests", "8", "--steps", "4", "--json"]
    p = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "host_overhead.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(p.stdout)
    assert list(report["scenarios"]) == ["greedy", "sampled", "stops"]
    for r in report["scenarios"].values():
        figures = [r["host_us_per_token"], r["forward_ms_per_step"], *r["phases_us_per_token"].values()]
        assert all(math.isfinite(x) for x in figures), r


def test_start_up_calibration_feeds_the_cost_model(models: dict[str, Path]) -> None:
    eng = Engine(str(models["llama"]), block_size=4, num_device_blocks=64, num_host_blocks=32)
    assert eng.calibration_s > 0  # it ran; how long it takes is a benchmark's business
    cm = eng.stats()["cost_model"]
    assert cm["calibrated"] == ["host_link_bytes_per_s", "prefill_tokens_per_s"]
    assert cm["host_link_bytes_per_s"] == eng.calibration["host_link_bytes_per_s"] > 0
    assert cm["prefill_tokens_per_s"] == eng.calibration["prefill_tokens_per_s"] > 0
    no_host = Engine(
        str(models["llama"]), block_size=4, num_device_blocks=64, num_host_blocks=0, calibrate=True
    )
    assert no_host.stats()["cost_model"]["calibrated"] == ["prefill_tokens_per_s"]
    # the prefill it times stays within max_model_len (FlashInfer's RoPE table ends there): the
    # runner's block table keeps its 24 / 4 columns
    short = Engine(str(models["llama"]), block_size=4, num_device_blocks=64, max_model_len=24)
    assert short.calibration["prefill_tokens_per_s"] > 0
    assert short.runner.block_table.table.shape[1] == 6
    assert (
        no_host.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
        == eng.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    )


def test_logprobs_report_the_sampled_token_and_the_top_n(models: dict[str, Path]) -> None:
    import transformers as tf

    eng = Engine(str(models["qwen3"]), block_size=4, num_device_blocks=64)
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    out = eng.generate([PROMPTS[1]], sp)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    hf = tf.AutoModelForCausalLM.from_pretrained(models["qwen3"], dtype=torch.float32).eval()
    seq = PROMPTS[1] + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(PROMPTS[1]) - 1 + i]
        top = row.topk(3)
        assert set(lp) == set(top.indices.tolist()) | {tok}
        assert lp[tok] == max(lp.values())  # greedy picks the most likely
        assert abs(lp[tok] - float(row[tok])) < 1e-4
    assert (
        abs(out.cumulative_logprob - sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs, strict=True)))
        < 1e-6
    )
    plain = eng.generate([PROMPTS[1]], GREEDY)[0].outputs[0]
    assert plain.logprobs is None and plain.token_ids[:5] == out.token_ids
    # streamed as deltas, each output's cumulative_logprob is the running sum so far (vLLM's)
    eng.add_request("d", PROMPTS[1], dataclasses.replace(sp, output_kind="delta"))
    sums = [o.outputs[0].cumulative_logprob for _ in range(9) for o in eng.step().outputs]
    running = np.cumsum([lp[t] for t, lp in zip(out.token_ids, out.logprobs, strict=True)])
    assert sums == pytest.approx(running.tolist(), abs=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_on_cpu_keeps_greedy_output_under_preemption(
    models: dict[str, Path], dtype: str
) -> None:
    """bf16/fp16 run on CPU too (KV and weights in that dtype, attention math in float32); their
    greedy tokens drift from float32's after a few steps, so the oracle is the same dtype's
    unconstrained run."""
    path = str(models["llama"])
    free = Engine(path, dtype=dtype, block_size=4, num_device_blocks=64, calibrate=False).generate(
        PROMPTS, GREEDY
    )
    for mode in ("recompute", "swap"):
        eng = Engine(
            path,
            dtype=dtype,
            block_size=4,
            num_device_blocks=12,
            num_host_blocks=32,
            preemption_mode=mode,
            calibrate=False,
        )
        assert eng.kv.device_kv.dtype == getattr(torch, dtype)
        got = eng.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in free]
        assert eng.stats()["num_preemptions"] > 0


class _DenseCausal:
    """One sequence's plain causal attention, as the oracle attention for a bare model forward."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_causal(q, k, v)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_packed_cpu_weights_give_the_plain_logits(models: dict[str, Path], kind: str) -> None:
    """oneDNN-packed projections and LM head (untied: llama, qwen3; tied with q/k/v bias: qwen2)
    against the plain float32 model on the same tokens; packing frees the plain weights."""
    from ferryman.model_loader import load_model
    from ferryman.models.llama import Linear

    cpu = torch.device("cpu")
    plain, _ = load_model(models[kind], torch.float32, cpu)
    packed, _ = load_model(models[kind], torch.float32, cpu)
    assert packed.pack_cpu_weights()
    lin = [m for m in packed.modules() if isinstance(m, Linear)]
    assert lin and all(m.packed is not None and m.weight.numel() == 0 for m in lin)
    ids = torch.randint(0, plain.cfg.vocab_size, (37,))
    pos = torch.arange(37)
    with torch.inference_mode():
        want = plain.compute_logits(plain(ids, pos, _DenseCausal()))
        got = packed.compute_logits(packed(ids, pos, _DenseCausal()))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert want.abs().max() > 1.0  # not a degenerate comparison
    half, _ = load_model(models[kind], torch.bfloat16, cpu)
    assert not half.pack_cpu_weights()  # packing is for float32 only


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e39, -0.5])
def test_temperatures_out_of_range_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=bad)


def test_a_vanishing_temperature_samples_greedily_beside_other_requests(models: dict[str, Path]) -> None:
    """1e-40 divides the logits into infinities (a NaN softmax): it is greedy instead (vLLM's rule
    below 1e-5), and the sampled requests batched beside it are unaffected."""
    path = str(models["llama"])
    kw = {"block_size": 4, "num_device_blocks": 64, "num_host_blocks": 0}
    want = [o.outputs[0].token_ids for o in Engine(path, **kw).generate(PROMPTS, GREEDY)]
    sampled = SamplingParams(temperature=0.9, seed=1, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in Engine(path, **kw).generate(PROMPTS, sampled)]
    vanishing = dataclasses.replace(GREEDY, temperature=1e-40)
    outs = Engine(path, **kw).generate(PROMPTS * 2, [vanishing] * len(PROMPTS) + [sampled] * len(PROMPTS))
    assert [o.outputs[0].token_ids for o in outs] == want + alone
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_dropped_engine_frees_its_model_without_the_garbage_collector(
    models: dict[str, Path], async_scheduling: bool
) -> None:
    """No reference cycle through the engine (the sampling table once held a bound method of it):
    a model and KV pool go when the engine does, not at some later collection."""
    eng = Engine(str(models["llama"]), calibrate=False, async_scheduling=async_scheduling)
    sp = SamplingParams(temperature=0.8, max_tokens=4, seed=1, presence_penalty=0.5)  # reads history
    assert len(eng.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids) == 4
    model, kv = weakref.ref(eng.model), weakref.ref(eng.kv)
    gc.disable()
    try:
        del eng
        assert model() is None and kv() is None
    finally:
        gc.enable()


def test_num_cached_tokens_counts_the_prefix_cache_hits(models: dict[str, Path]) -> None:
    eng = Engine(str(models["llama"]), block_size=4, num_device_blocks=64, calibrate=False)
    prompt = list(range(3, 22))  # 19 tokens: 4 full blocks
    first = eng.generate([prompt], GREEDY)[0]
    again = eng.generate([prompt, [*prompt[:9], 40, 41]], GREEDY)
    assert first.num_cached_tokens == 0
    # the whole prompt's full blocks but the last token's, which is computed for its logits
    assert [o.num_cached_tokens for o in again] == [16, 8]
    assert again[0].outputs[0].token_ids == first.outputs[0].token_ids
