"""GPU benchmarks: decode against the HBM roofline, the host's share of a step, CUDA graphs and swap
bandwidth, printed as one JSON object (``scripts/gpu_check.sh`` runs this on a GPU machine; it needs
CUDA, and FlashInfer for the attention backend).

- decode and prefill throughput of a randomly initialised Llama-3-8B-shaped model in bf16 at
  batch 1, 32 and 256 (context 512), through the real scheduler, runner and sampler, next to the
  HBM roofline of that decode step (every weight once + the batch's KV, over peak bandwidth);
- the scheduler's share of a decode step: ``schedule()`` + ``update()`` through the binding, over
  the step's wall time (the runner's own Python, plans and input tensors, overlaps the GPU's work
  and is inside the synchronised forward time);
- swap bandwidth (device -> host -> device, GB/s) for block sizes 16 and 64, blocks scattered
  on the device, as the pool runs it (staged on CUDA: ``worker/kv_cache.py``) and run by run,
  against one plain pinned ``copy_`` of a buffer of the same size;
- CUDA graphs vs eager decode: the same runner's median decode step with its graphs, then with
  them switched off, at each batch size (graphs only exist on CUDA with FlashInfer);
- at batches up to 32, the same runner's decode step with the skinny GEMM kernel on the
  projections and row counts where it measured faster than cuBLAS (``ModelRunner.use_skinny_gemm``),
  then as many steps on cuBLAS again: ``skinny_decode_step_ms``, ``cublas_again_decode_step_ms``,
  their ratio ``skinny_over_cublas``, ``skinny_decode_vs_roofline`` (``decode_vs_roofline`` over
  that ratio), which row counts chose the kernel and each candidate's time per shape;
- the whole ``Engine.step()`` at each batch size (``engine_step_ms``: an Engine on the same shape
  with ``load_format="dummy"``, its defaults on: async scheduling, CUDA graphs, the sampler,
  outputs) over the runner-alone step above (``engine_step_over_runner``; target <= 1.10), and
  over that step's forward + sampling part (``engine_step_over_forward``). The engine overlaps
  its host work with the device (async scheduling), the runner-alone step does not.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ferryman._core import RequestParams, Scheduler, SchedulerConfig
from ferryman.engine import Engine
from ferryman.models.llama import LlamaForCausalLM, ModelConfig
from ferryman.sampling_params import SamplingParams
from ferryman.worker.kv_cache import KvCache
from ferryman.worker.model_runner import ModelRunner

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet; the report names it


def llama3_8b_config(smoke: bool = False) -> dict[str, Any]:
    """Llama-3-8B's config.json (``smoke``: a tiny shape, for a CPU dry run)."""
    h, heads, kvh, layers, inter, vocab = (
        (256, 4, 2, 2, 512, 1000) if smoke else (4096, 32, 8, 32, 14336, 128256)
    )
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kvh,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    }


def random_llama(device: torch.device, smoke: bool = False) -> LlamaForCausalLM:
    """Llama-3-8B's shape with random bf16 weights (``smoke``: tiny)."""
    return LlamaForCausalLM.random(ModelConfig.from_hf(llama3_8b_config(smoke)), torch.bfloat16, device)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def output_room(batch: int, ctx: int, steps: int) -> int:
    """Output tokens a request needs: the prefill steps of the whole batch (8192 tokens each),
    in which it may already decode, then 4 * ``steps`` decode steps (graphs, eager, the skinny
    GEMM, cuBLAS again) and a margin."""
    return -(-batch * ctx // 8192) + 4 * steps + 8


def prepare(
    model: LlamaForCausalLM, batch: int, ctx: int, steps: int
) -> tuple[Scheduler, ModelRunner, int, float]:
    """``batch`` requests of ``ctx`` random tokens, prefilled (timed) and one decode step run, with
    room for 2 * ``steps`` more decode steps: (scheduler, runner, prefill tokens, prefill s).
    Requests prefilled first decode while the rest prefill, so each has room for those steps too
    and the timed steps keep the whole batch."""
    cfg, dev, bs = model.cfg, next(model.parameters()).device, 16
    out_len = output_room(batch, ctx, steps)
    blocks = batch * (-(-(ctx + out_len + 4) // bs)) + 8
    kv = KvCache(cfg.num_layers, blocks, 0, bs, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, dev)
    runner = ModelRunner(model, kv, bs, dev, max_num_seqs=max(batch, 1), max_model_len=ctx + out_len + 4)
    s = Scheduler(
        SchedulerConfig(
            block_size=bs,
            num_device_blocks=blocks,
            max_num_batched_tokens=8192,
            max_num_seqs=max(batch, 1),
            max_model_len=ctx + out_len + 4,
            enable_prefix_caching=False,
        )
    )
    rng = np.random.default_rng(batch)
    for r in range(batch):
        s.add_request(
            r,
            rng.integers(0, cfg.vocab_size, ctx).astype(np.int32),
            RequestParams(out_len, ignore_eos=True),
        )
    prefill_tokens, prefill_s = 0, 0.0
    while True:  # prefill everything (the budget splits it into chunks)
        out = s.schedule()
        if out.num_prefill_tokens == 0:
            break
        sync()
        t = time.perf_counter()
        logits = runner.execute(out)
        toks = logits.argmax(-1).to(torch.int32).cpu().numpy()
        sync()
        prefill_s += time.perf_counter() - t
        prefill_tokens += out.num_prefill_tokens
        s.update(toks)
    s.update(runner.execute(out).argmax(-1).to(torch.int32).cpu().numpy())  # the first decode step
    return s, runner, prefill_tokens, prefill_s


def decode_and_prefill(model: LlamaForCausalLM, batch: int, ctx: int, steps: int) -> dict[str, Any]:
    cfg = model.cfg
    s, runner, prefill_tokens, prefill_s = prepare(model, batch, ctx, steps)
    step_s, fwd_s = decode_steps(s, runner, steps)
    graphs, runner.graphs = runner.graphs, None
    eager_s = decode_steps(s, runner, steps)[0] if graphs is not None else None
    runner.graphs = graphs
    skinny = skinny_steps(s, runner, batch, steps)
    step, fwd = float(np.median(step_s)), float(np.median(fwd_s))
    kv_bytes = batch * (ctx + steps / 2) * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    weights = (
        sum(p.numel() for p in model.parameters()) * 2 - cfg.vocab_size * cfg.hidden_size * 2
    )  # no embed read
    roofline_s = (weights + kv_bytes) / HBM_BYTES_PER_S
    row: dict[str, Any] = {
        "batch": batch,
        "context": ctx,
        "attention_backend": runner.attention_backend,
        "decode_tokens_per_s": round(batch / step, 1),
        "decode_step_ms": round(step * 1e3, 3),
        "decode_forward_ms": round(fwd * 1e3, 3),
        "host_overhead_share": round((step - fwd) / step, 4),
        "hbm_roofline_step_ms": round(roofline_s * 1e3, 3),
        "decode_vs_roofline": round(roofline_s / step, 3),
        "prefill_tokens_per_s": round(prefill_tokens / prefill_s, 1) if prefill_s else None,
        "cuda_graphs": graphs is not None,
        "eager_decode_step_ms": round(float(np.median(eager_s)) * 1e3, 3) if eager_s else None,
        "graph_speedup": round(float(np.median(eager_s)) / step, 3) if eager_s else None,
        **skinny,
    }
    if "skinny_decode_step_ms" in row:
        # the first timed steps' roofline fraction, scaled by the adjacent skinny / cuBLAS ratio
        row["skinny_decode_vs_roofline"] = round(row["decode_vs_roofline"] / row["skinny_over_cublas"], 3)
    return row


def skinny_steps(s: Scheduler, runner: ModelRunner, batch: int, steps: int) -> dict[str, Any]:
    """Decode steps with the skinny GEMM where it measured faster than cuBLAS on this device
    (``ModelRunner.use_skinny_gemm``; CUDA, batches up to 32), then as many on cuBLAS again, so
    the two sides are next to each other in time (the contexts grow by ``steps`` in between):
    both medians, their ratio, and per projection shape which row counts chose the kernel."""
    if runner.device.type != "cuda" or batch > 32:
        return {}
    try:
        report = runner.use_skinny_gemm()
        skinny_s = decode_steps(s, runner, steps)[0]
    except Exception as e:  # the cuBLAS figures above still count
        return {"skinny_error": f"{type(e).__name__}: {e}"}
    finally:
        runner.use_skinny_gemm(on=False)  # the model is shared with the next batch's runner
    cublas_s = decode_steps(s, runner, steps)[0]

    def per_shape(key: str) -> dict[str, Any]:
        return {shape: {m: r[key] for m, r in g["rows"].items() if key in r} for shape, g in report.items()}

    chosen, rejected = per_shape("chosen"), per_shape("rejected")
    sk, cb = float(np.median(skinny_s)), float(np.median(cublas_s))
    return {
        "skinny_decode_step_ms": round(sk * 1e3, 3),
        "cublas_again_decode_step_ms": round(cb * 1e3, 3),
        "skinny_over_cublas": round(sk / cb, 3),
        "skinny_chosen": chosen,
        "skinny_rejected": {k: v for k, v in rejected.items() if v},
        "skinny_us": per_shape("us"),
    }


def decode_steps(s: Scheduler, runner: ModelRunner, steps: int) -> tuple[list[float], list[float]]:
    """Wall time of whole decode steps and of their forward + sampling part."""
    step_s, fwd_s = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        out = s.schedule()
        t1 = time.perf_counter()
        logits = runner.execute(out)
        toks = logits.argmax(-1).to(torch.int32).cpu().numpy()  # the sync point
        t2 = time.perf_counter()
        s.update(toks)
        t3 = time.perf_counter()
        step_s.append(t3 - t0)
        fwd_s.append(t2 - t1)
    return step_s, fwd_s


def engine_steps(smoke: bool, device: torch.device, batch: int, ctx: int, steps: int) -> float:
    """Median wall time (s) of ``Engine.step()`` over ``steps`` decode steps of ``batch`` requests
    of ``ctx`` random tokens: the whole engine (async scheduling and CUDA graphs as by default, the
    sampler, text-free outputs) on the same shape as ``random_llama``, from its config.json with
    ``load_format="dummy"``. Raises if a timed step does not decode the whole batch."""
    eng = None
    try:
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(llama3_8b_config(smoke)))
            out_len = output_room(batch, ctx, steps)
            max_len = ctx + out_len + 8
            eng = Engine(
                d,
                load_format="dummy",
                dtype="bfloat16",
                device=device.type,
                max_num_seqs=max(batch, 1),
                max_model_len=max_len,
                num_device_blocks=batch * (-(-max_len // 16)) + 8,
                num_host_blocks=0,
                enable_prefix_caching=False,
                calibrate=False,
            )
        rng = np.random.default_rng(batch)
        sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        for r in range(batch):
            eng.add_request(str(r), rng.integers(0, eng.model.cfg.vocab_size, ctx).tolist(), sp)
        for _ in range(10_000):  # prefill, then decode steps until async scheduling's steady state
            st = eng.step().stats
            if st is not None and st.num_prefill_tokens == 0 and st.num_scheduled_seqs == batch:
                break
        else:
            raise RuntimeError(f"{batch} requests never decoded together")
        eng.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            st = eng.step().stats
            times.append(time.perf_counter() - t)
            if st is None or st.num_scheduled_seqs != batch:
                raise RuntimeError(f"a timed step ran {st and st.num_scheduled_seqs} of {batch} rows")
        return float(np.median(times))
    finally:  # the engine holds a model, a KV pool and CUDA graphs: free them before the next
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def swap_bandwidth(
    block_size: int, dev: torch.device, num_blocks: int = 1024, layers: int = 32, reps: int = 3
) -> dict[str, Any]:
    """Llama-3-8B's KV block (32 layers, 8 KV heads of 128) unless ``layers`` says otherwise:
    ``num_blocks`` scattered device blocks swapped out to consecutive host blocks and back, as
    the pool does it (staged on CUDA, gathers on a side stream), staged on the copy stream alone
    (``staged_one_stream``) and copied run by run (no staging), against one plain
    pinned copy of the same bytes; medians of ``reps``."""
    kv = KvCache(layers, num_blocks * 2, num_blocks, block_size, 8, 128, torch.bfloat16, dev)
    nbytes = num_blocks * KvCache.bytes_per_block(layers, block_size, 8, 128, torch.bfloat16)
    rng = np.random.default_rng(block_size)
    src = rng.permutation(np.arange(1, num_blocks * 2 + 1))[:num_blocks].astype(np.int32)  # scattered
    host = np.arange(1, num_blocks + 1, dtype=np.int32)
    out_plan, in_plan, none = np.stack([src, host], 1), np.stack([host, src], 1), np.zeros((0, 2), np.int32)

    def timed(fn: Any) -> float:
        times = []
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    gb = nbytes / 1e9
    row: dict[str, Any] = {"block_size": block_size, "bytes": nbytes}
    staging, side = kv._staging, kv._side_stream
    modes = ("staged", "staged_one_stream", "per_run")  # the last two: before double-buffering
    for mode in modes:
        kv._staging = None if mode == "per_run" else staging
        kv._side_stream = side if mode == "staged" else None
        kv.run_plans(out_plan, none, none)  # warm-up
        kv.run_plans(none, in_plan, none)
        t_out = timed(lambda: kv.run_plans(out_plan, none, none))
        t_in = timed(lambda: kv.run_plans(none, in_plan, none))
        row[mode] = {"out_GBps": round(gb / t_out, 2), "in_GBps": round(gb / t_in, 2), "s": t_out + t_in}
    kv._staging, kv._side_stream = staging, side
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    b.copy_(a)
    base_out = timed(lambda: b.copy_(a, non_blocking=True))
    base_in = timed(lambda: a.copy_(b, non_blocking=True))
    row["plain_copy_out_GBps"] = round(gb / base_out, 2)
    row["plain_copy_in_GBps"] = round(gb / base_in, 2)
    for mode in modes:  # time over time: the same bytes both ways
        row[mode]["of_plain_copy"] = round((base_out + base_in) / row[mode].pop("s"), 3)
    row["swap_vs_plain"] = row["staged" if staging is not None else "per_run"]["of_plain_copy"]
    row["staging_blocks"] = 0 if staging is None else len(staging)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="a tiny dry run on CPU (what CI checks)")
    p.add_argument("--out", help="also write the report here after every section (a timeout keeps those)")
    a = p.parse_args()
    if not a.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (--smoke runs the same code on CPU)")
    dev = torch.device("cpu" if a.smoke else "cuda")
    name = "cpu (smoke)" if a.smoke else torch.cuda.get_device_name()
    report: dict[str, Any] = {"gpu": name, "torch": torch.__version__}

    def save() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps(report))

    n, layers = (8, 2) if a.smoke else (1024, 32)
    report["swap"] = [swap_bandwidth(16, dev, n, layers), swap_bandwidth(64, dev, n, layers)]
    save()
    model = random_llama(dev, a.smoke)
    report["decode"] = []
    for b in a.batches.split(","):
        report["decode"].append(decode_and_prefill(model, int(b), a.context, a.steps))
        save()
    del model
    for row in report["decode"]:  # the whole Engine.step() beside the runner alone (decode_step_ms)
        try:
            engine_s = engine_steps(a.smoke, dev, row["batch"], a.context, a.steps)
        except Exception as e:  # the runner's figures above still count
            row["engine_step_error"] = f"{type(e).__name__}: {e}"
            continue
        row["engine_step_ms"] = round(engine_s * 1e3, 3)
        # over the runner-alone step (scheduler, forward, argmax, host copy, update; synchronous),
        # and over its forward + sampling part alone
        row["engine_step_over_runner"] = round(engine_s * 1e3 / row["decode_step_ms"], 3)
        row["engine_step_over_forward"] = round(engine_s * 1e3 / row["decode_forward_ms"], 3)
        save()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
