"""``ferryman sim``: the roofline on hand-computed cases and on two published measurements,
determinism, and scenarios where swap or recompute must win, checked against ``auto``'s choices."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ferryman.sim import GpuSpec, ModelShape, Roofline, SimConfig, gpu, model_shape, simulate, synthetic
from ferryman.sim.simulator import pool_sizes

TOY_GPU = GpuSpec("toy", peak_flops=1e12, hbm_bytes_per_s=1e11, host_link_bytes_per_s=1e9, memory_bytes=1e10)
TOY = ModelShape(
    "toy",
    num_layers=2,
    hidden_size=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=10,
)


def test_roofline_by_hand() -> None:
    r = Roofline(
        TOY_GPU, TOY, dtype_bytes=2, compute_efficiency=0.5, bandwidth_efficiency=0.5, step_overhead_s=0.0
    )
    # params per layer: q,o 8*2*4*2 = 128; k,v 8*1*4*2 = 64; mlp 3*8*16 = 384 -> 576
    assert TOY.params_per_layer == 576
    # a decode row at KV length 5 and a prefill chunk of 3 tokens ending at 7; both sampled
    q, s = np.array([1, 3]), np.array([5, 7])
    pairs = (1 * 5 - 0) + (3 * 7 - 3)  # 5 + 18 = 23 (query, key) pairs
    flops = 2 * 2 * 576 * 4 + 2 * 8 * 10 * 2 + 4 * 2 * 2 * 4 * pairs
    kv_per_token = 2 * 2 * 1 * 4 * 2  # 32 bytes
    nbytes = 2 * (2 * 576 + 8 * 10) + kv_per_token * (5 + 7) + kv_per_token * 4
    c = r.cost(q, s, 2)
    assert (c.flops, c.bytes) == (flops, nbytes)
    assert c.step_s == pytest.approx(max(flops / 0.5e12, nbytes / 0.5e11))
    assert r.cost(np.zeros(0), np.zeros(0), 0).step_s == 0.0


@pytest.mark.parametrize(
    ("batch", "out_len", "published"),
    [(64, 128, 3486.0), (32, 2048, 1459.0)],  # TensorRT-LLM, A100 80GB FP16, LLaMA 7B, input 128
)
def test_roofline_against_published_static_batches(batch: int, out_len: int, published: float) -> None:
    work = synthetic(batch, float("inf"), "fixed:128", f"fixed:{out_len}", vocab=32000)
    cfg = SimConfig(max_num_seqs=batch, max_num_batched_tokens=8192, enable_prefix_caching=False)
    r = simulate(gpu("a100"), model_shape("llama-2-7b"), work, cfg)
    assert r["preemptions_recompute"] + r["preemptions_swap"] == 0
    assert r["output_token_throughput"] == pytest.approx(published, rel=0.10)


def test_same_seed_same_result_and_different_seed_differs() -> None:
    def run(seed: int) -> dict[str, object]:
        work = synthetic(300, 20.0, "uniform:64:1024", "uniform:16:256", seed=seed, vocab=32000)
        r = simulate(gpu("l4"), model_shape("mistral-7b"), work, SimConfig(num_device_blocks=400))
        r.pop("sim_wall_s")
        return r

    a, b = run(3), run(3)
    assert a == b
    assert a["preemptions_recompute"] + a["preemptions_swap"] > 0  # type: ignore[operator]
    assert run(4) != a


def test_pool_sizes_follow_memory() -> None:
    shape, g = model_shape("llama-3-8b"), gpu("h200")
    dev, host, block = pool_sizes(g, shape, SimConfig(swap_space=4))
    assert block == 16 * 2 * 32 * 8 * 128 * 2
    assert host == (4 << 30) // block
    kv_bytes = dev * block
    assert 0.8 * 141e9 - 16.1e9 < kv_bytes < 0.9 * 141e9 - 16.0e9  # what is left after weights
    with pytest.raises(ValueError, match="leaves no KV memory"):
        pool_sizes(gpu("l4"), model_shape("llama-3-70b"), SimConfig())


def run_modes(g: GpuSpec, work: object, cfg: SimConfig) -> dict[str, dict[str, float]]:
    shape = model_shape("llama-3-8b")
    return {
        m: simulate(g, shape, work, replace(cfg, preemption_mode=m)) for m in ("recompute", "swap", "auto")
    }  # type: ignore[arg-type]


def test_swap_wins_with_long_contexts_and_a_fast_link_and_auto_swaps() -> None:
    # long generations outgrow the pool; re-prefilling a victim's thousands of tokens costs more
    # than moving its blocks over 55 GB/s
    work = synthetic(200, float("inf"), "uniform:500:1000", "uniform:2000:4000", seed=1, vocab=128256)
    r = run_modes(gpu("h200"), work, SimConfig(num_device_blocks=3000, max_num_seqs=128, swap_space=64))
    assert r["recompute"]["preemptions_recompute"] > 0 and r["swap"]["preemptions_swap"] > 0
    assert r["swap"]["output_token_throughput"] > r["recompute"]["output_token_throughput"]
    auto = r["auto"]
    assert auto["preemptions_swap"] > 0 and auto["preemptions_recompute"] == 0
    assert auto["output_token_throughput"] >= 0.98 * r["swap"]["output_token_throughput"]


def test_recompute_wins_with_short_contexts_and_a_slow_link_and_auto_recomputes() -> None:
    # a 1 GB/s host link (a shared or throttled PCIe path): short requests re-prefill faster
    slow = gpu("h200", host_link_bytes_per_s=1e9)
    work = synthetic(600, float("inf"), "uniform:32:128", "uniform:300:900", seed=2, vocab=128256)
    r = run_modes(slow, work, SimConfig(num_device_blocks=1200, max_num_seqs=256))
    assert r["recompute"]["preemptions_recompute"] > 0 and r["swap"]["preemptions_swap"] > 0
    assert r["recompute"]["output_token_throughput"] > r["swap"]["output_token_throughput"]
    auto = r["auto"]
    assert auto["preemptions_recompute"] > 0 and auto["preemptions_swap"] == 0
    assert auto["output_token_throughput"] >= 0.98 * r["recompute"]["output_token_throughput"]


def test_cli_sim_sweep_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ferryman.cli import main
    from ferryman.plot import plot_trace
    from ferryman.trace import read_trace

    common = [
        "sim",
        "--gpu",
        "l4",
        "--model-shape",
        "mistral-7b",
        "--num-requests",
        "120",
        "--rate",
        "30",
        "--num-device-blocks",
        "300",
    ]
    trace = tmp_path / "sim.jsonl"
    assert main([*common, "--trace", str(trace), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    records = list(read_trace(trace))
    assert sum(1 for x in records if x["type"] == "step") == report["steps"]
    events = [x for x in records if x["type"] == "preemption"]
    assert len(events) == report["preemptions_recompute"] + report["preemptions_swap"] > 0
    assert Path(plot_trace(trace, tmp_path / "t.png")).read_bytes()[:4] == b"\x89PNG"
    cut = tmp_path / "cut.jsonl"  # a server killed mid-line
    cut.write_text(trace.read_text() + '{"type": "step", "st')
    with pytest.warns(UserWarning, match="unfinished last line"):
        assert len(list(read_trace(cut))) == len(records)
    cut.write_text('{"type": "st\n' + trace.read_text())  # inside the file it is still an error
    with pytest.raises(ValueError, match=r"cut\.jsonl:1: not a JSON trace line"):
        list(read_trace(cut))
    png = tmp_path / "sweep.png"
    assert main([*common, "--sweep", "preemption_mode=recompute,swap,auto", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n| ") == 4 and "| swap |" in out and png.read_bytes()[:4] == b"\x89PNG"
    assert main([*common, "--sweep", "preemption_mode=recompute,swap", "--plot", str(tmp_path / "bare")]) == 0
    assert str(tmp_path / "bare.png") in capsys.readouterr().out  # the file matplotlib writes
    assert main([*common, "--sweep", "colour=red"]) == 2  # an error line, not a traceback
    assert "KNOB" in capsys.readouterr().err


def test_json_trace_workload_and_config_json_shape(tmp_path: Path) -> None:
    from ferryman.sim import from_json

    rows = [
        {"arrival_s": 0.5, "prompt_len": 40, "output_len": 8},
        {"prompt_tokens": [5, 6, 7], "output_len": 3},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(rows))
    w = from_json(path, vocab=1000)
    assert w.arrival_s.tolist() == [0.0, 0.5]  # sorted by arrival
    assert w.prompt_len.tolist() == [3, 40] and w.output_len.tolist() == [3, 8]
    assert w.prompts[0].tolist() == [5, 6, 7] and len(w.prompts[1]) == 40
    r = simulate(gpu("l4"), model_shape("smollm2-135m"), w)
    assert r["num_requests"] == 2 and r["duration_s"] > 0.5
    path.write_text(json.dumps([{"output_len": 3}]))
    with pytest.raises(ValueError, match="prompt_len"):
        from_json(path)
    for bad, said in [
        ([{"prompt_len": 1000, "prompt_tokens": [1, 2, 3], "output_len": 5}], "prompt_len 1000 is not its 3"),
        ([{"prompt_len": 0, "output_len": 5}], "must be >= 1"),  # 0 is a length, not a missing one
        ([{"prompt_len": 4, "output_len": 5, "arrival_s": "abc"}], "arrival_s 'abc' is not a number"),
        ("", "not JSON"),
    ]:
        path.write_text(json.dumps(bad) if bad else "")
        with pytest.raises(ValueError, match=said) as e:
            from_json(path)
        assert str(path) in str(e.value)
    cfg = {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = model_shape(str(tmp_path))
    assert (shape.num_layers, shape.head_dim, shape.num_kv_heads, shape.tie_word_embeddings) == (
        4,
        32,
        2,
        True,
    )
    assert model_shape("llama-3-8b", num_layers=2).num_layers == 2
    with pytest.raises(ValueError, match="unknown model shape"):
        model_shape("no-such-model")
    with pytest.raises(ValueError, match="unknown field"):
        gpu("h100", colour=1)


def test_tensor_parallel_roofline_splits_the_work_and_adds_the_collectives() -> None:
    """One rank of N: FLOPs and weights over N, its share of the KV heads, and (2L + 1) ring
    all-reduces of the step's hidden states plus the logits' gather over the link."""
    from ferryman.sim.presets import LINKS, tp_split

    g, shape = gpu("h100"), model_shape("llama-3-70b")
    one, four = Roofline(g, shape), Roofline(g, shape, tp=4, link=LINKS["pcie"])
    q, s = np.ones(64, dtype=np.int64), np.full(64, 1000, dtype=np.int64)  # 64 decode rows
    c1, c4 = one.cost(q, s, 64), four.cost(q, s, 64)
    assert c4.flops == pytest.approx(c1.flops / 4)
    kv = shape.kv_bytes_per_token(2) * (64 * 1000 + 64)
    assert c4.bytes == pytest.approx((c1.bytes - kv) / 4 + kv / 4)  # 8 KV heads: 2 a rank
    link, h, L, V = LINKS["pcie"], shape.hidden_size, shape.num_layers, shape.vocab_size
    ring = (2 * L + 1) * (2 * 3 / 4 * 64 * h * 2 / link.bytes_per_s + link.latency_s)
    assert c4.comm_s == pytest.approx(ring + 3 / 4 * 64 * V * 2 / link.bytes_per_s + link.latency_s)
    assert c1.comm_s == 0 and c4.step_s == pytest.approx(max(c4.compute_s, c4.memory_s) + c4.comm_s + 1e-3)
    assert tp_split(shape, 16) == 1 / 8  # more ranks than KV heads: one head each, replicated
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        tp_split(shape, 3)


def test_sim_sizes_llama_3_70b_over_ranks() -> None:
    w = synthetic(200, 4.0, "uniform:128:512", "uniform:64:256", seed=0, vocab=128256)
    h100, llama = gpu("h100"), model_shape("llama-3-70b")
    with pytest.raises(ValueError, match="leaves no KV memory"):
        simulate(h100, llama, w, SimConfig())
    r = {
        (tp, link): simulate(h100, llama, w, SimConfig(tensor_parallel_size=tp, interconnect=link))
        for tp in (4, 8)
        for link in ("nvlink", "pcie")
    }
    assert r[(8, "nvlink")]["num_device_blocks"] > r[(4, "nvlink")]["num_device_blocks"] > 0
    assert r[(4, "pcie")]["comm_share"] > r[(4, "nvlink")]["comm_share"] > 0
    assert r[(8, "nvlink")]["tpot_p50_ms"] < r[(4, "nvlink")]["tpot_p50_ms"]


def test_priorities_reach_the_sim_from_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every request had priority 0 from the CLI, so --policy priority could change nothing: now
    --interactive-every and a workload's "priority" field give them."""
    from ferryman.cli import main

    tight = ["sim", "--gpu", "l4", "--model-shape", "mistral-7b", "--num-device-blocks", "300", "--json"]
    synthetic = [*tight, "--num-requests", "120", "--rate", "inf", "--interactive-every", "4"]
    reports = []
    for policy in ("fcfs", "priority"):
        assert main([*synthetic, "--policy", policy]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert "ttft_p99_ms_priority_0" in reports[1] and "ttft_p99_ms_priority_1" in reports[1]
    fcfs, prio = reports
    assert prio["ttft_p99_ms_priority_0"] < fcfs["ttft_p99_ms_priority_0"]  # class 0 goes first
    rows = [{"prompt_len": 300, "output_len": 200, "priority": i % 3 == 0} for i in range(3)]
    path = tmp_path / "w.json"
    path.write_text(json.dumps(rows))
    assert main([*tight, "--workload", str(path)]) == 2  # true is not an integer
    assert "priority must be an integer" in capsys.readouterr().err
    rows = [{"prompt_len": 300, "output_len": 200, **({"priority": 1} if i % 2 else {})} for i in range(90)]
    path.write_text(json.dumps(rows))
    assert main([*tight, "--workload", str(path), "--policy", "priority"]) == 0
    report = json.loads(capsys.readouterr().out)  # an absent priority is 0
    assert "ttft_p99_ms_priority_0" in report and "ttft_p99_ms_priority_1" in report
    assert main([*tight, "--workload", str(path), "--interactive-every", "2"]) == 2
    assert "--interactive-every shapes synthetic requests" in capsys.readouterr().err
