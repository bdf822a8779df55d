"""The ``ferryman`` command, one entry point: ``serve``, ``generate``, ``chat``,
``bench throughput``, ``bench serve``, ``sim`` and ``plot``. Every Engine knob is a flag of the commands
that build an engine (``add_engine_args``)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from ferryman.detokenizer import releasable
from ferryman.model_loader import DEFAULT_MODEL
from ferryman.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2', a .gguf file or a Hugging Face folder")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda[:N]'")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (a power of two)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    g.add_argument("--num-device-blocks", type=int, default=None, help="default: from --kv-cache-memory")
    g.add_argument("--num-host-blocks", type=int, default=None, help="default: from --swap-space")
    g.add_argument("--swap-space", type=float, default=4, help="host KV for swap, GiB")
    g.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="device KV bytes (CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of the GPU (CUDA)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flashinfer"])
    g.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (GPU + FlashInfer)"
    )
    g.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"])
    g.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"], help="victim order")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--seed", type=int, default=0, help="engine seed (requests without their own seed)")
    g.add_argument("--no-calibrate", action="store_true", help="keep the cost model's default rates")


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": a.dtype,
        "device": a.device,
        "block_size": a.block_size,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "max_num_seqs": a.max_num_seqs,
        "max_model_len": a.max_model_len,
        "num_device_blocks": a.num_device_blocks,
        "num_host_blocks": a.num_host_blocks,
        "swap_space": a.swap_space,
        "kv_cache_memory": a.kv_cache_memory,
        "gpu_memory_utilization": a.gpu_memory_utilization,
        "attention_backend": a.attention_backend,
        "enforce_eager": a.enforce_eager,
        "preemption_mode": a.preemption_mode,
        "policy": a.policy,
        "enable_prefix_caching": not a.no_prefix_caching,
        "enable_chunked_prefill": not a.no_chunked_prefill,
        "seed": a.seed,
        "calibrate": not a.no_calibrate,
    }


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        seed=a.request_seed,
        max_tokens=a.max_tokens,
        stop=a.stop,
    )


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferryman", description="ferryman LLM serving engine")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    s.add_argument("--max-waiting", type=int, default=None, help="answer 503 once this many requests wait")
    s.add_argument("--trace", default=None, help="write one JSON line per step and preemption to this file")
    s.add_argument("--log-level", default="info")

    g = sub.add_parser("generate", help="complete prompts and print the text")
    g.add_argument("prompt", nargs="+", help="one or more prompts")
    add_engine_args(g)
    _add_sampling_args(g, 64)
    g.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt at a time)")

    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    add_engine_args(c)
    _add_sampling_args(c, 256)
    c.add_argument("--system", default=None, help="a system message")

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    t = b.add_parser("throughput", help="offline throughput vs transformers' batched generate")
    t.add_argument("--model", default=DEFAULT_MODEL)
    t.add_argument("--num-prompts", type=int, default=64)
    t.add_argument("--input-len", default="32:256", help="LO:HI prompt tokens, uniform")
    t.add_argument("--output-len", default="16:256", help="LO:HI output tokens, uniform")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--token-range", default="100:1000", help="LO:HI token ids of the random prompts")
    t.add_argument("--num-device-blocks", type=int, default=None, help="default: every request fits")
    t.add_argument("--pool-fraction", type=float, default=None, help="a second run's pool, see --pool-basis")
    t.add_argument(
        "--pool-basis",
        default="demand",
        choices=["demand", "peak"],
        help="--pool-fraction of the total demand (every request's prompt + output, i.e. the ample pool; "
        "the Engine issue's measure) or of the ample run's peak use (stricter)",
    )
    t.add_argument("--num-host-blocks", type=int, default=None)
    t.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"])
    t.add_argument("--max-num-batched-tokens", type=int, default=None)
    t.add_argument("--no-hf", action="store_true", help="skip the transformers run")
    t.add_argument(
        "--repeats",
        type=_positive_int,
        default=1,
        help="run every variant this many times, interleaved; ratios are medians (each run listed)",
    )
    t.add_argument("--json", action="store_true", help="print one JSON object")

    from ferryman import bench_serve

    bench_serve.add_args(b.add_parser("serve", help="load generator against a running server"))

    from ferryman.sim import command as sim_command

    sim_command.add_args(sub.add_parser("sim", help="the real scheduler against a GPU step-time model"))

    pl = sub.add_parser("plot", help="draw a --trace file: KV use, token budget, queues, preemptions")
    pl.add_argument("trace")
    pl.add_argument("-o", "--out", default="trace.png")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.cmd == "bench":
        if a.bench == "serve":
            from ferryman import bench_serve

            return bench_serve.main(a)
        return _bench_throughput(a)
    if a.cmd == "sim":
        from ferryman.sim import command as sim_command

        return sim_command.main(a)
    if a.cmd == "plot":
        from ferryman.plot import plot_trace

        print(plot_trace(a.trace, a.out))
        return 0
    if a.cmd == "serve":
        from ferryman.server.run import serve

        return serve(a)
    from ferryman.engine import Engine

    engine = Engine(a.model, **engine_kwargs(a))
    if a.cmd == "chat":
        return _chat(engine, a)
    params = _sampling(a)
    if a.stream:
        for prompt in a.prompt:
            sys.stdout.write(prompt)
            for delta in _stream(engine, prompt, params):
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
        return 0
    for prompt, out in zip(a.prompt, engine.generate(a.prompt, params), strict=True):
        sys.stdout.write(prompt + out.outputs[0].text + "\n")
    return 0


def _stream(engine: Any, prompt: str, params: SamplingParams) -> Any:
    """Yields the text of one request as the engine steps, holding back a possible stop string."""
    rid = f"cli-{id(prompt)}"
    engine.add_request(rid, prompt, params)
    sent = 0
    while engine.has_unfinished_requests():
        for ro in engine.step():
            o = ro.outputs[0]
            end = releasable(o.text, sent, params.stop, ro.finished)
            if end > sent:
                yield o.text[sent:end]
                sent = end
            if ro.finished:
                return


def _chat(engine: Any, a: argparse.Namespace) -> int:
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        print("this model has no chat template", file=sys.stderr)
        return 2
    history: list[dict[str, str]] = [{"role": "system", "content": a.system}] if a.system else []
    params = _sampling(a)
    print("ferryman chat: an empty line or Ctrl-D quits, /reset forgets the conversation", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        history.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        reply = []
        for delta in _stream(engine, prompt, params):
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _bench_throughput(a: argparse.Namespace) -> int:
    from ferryman import bench

    work = bench.workload(a.token_range, a.num_prompts, a.input_len, a.output_len, a.seed)
    demand = bench.demand_blocks(work)
    kw = {
        "num_host_blocks": a.num_host_blocks,
        "preemption_mode": a.preemption_mode,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "max_model_len": max(len(p) + m for p, m in work),
    }
    report: dict[str, object] = {
        "num_prompts": a.num_prompts,
        "input_len": a.input_len,
        "output_len": a.output_len,
    }
    blocks = a.num_device_blocks or demand
    longest = max(bench.request_blocks(work))  # a tight pool still fits each request
    vs_ample: list[float] = []
    vs_hf: list[float] = []
    for rep in range(a.repeats):  # each repeat runs every variant again, interleaved
        ample: dict[str, float] = {}
        if a.pool_fraction:
            ample = bench.run_ferryman(a.model, work, num_device_blocks=demand, **kw)
            basis = ample["peak_blocks_used"] if a.pool_basis == "peak" else demand
            blocks = max(longest, int(basis * a.pool_fraction))
        ours = bench.run_ferryman(a.model, work, num_device_blocks=blocks, **kw)
        if a.pool_fraction:
            vs_ample.append(round(ours["output_tokens_per_s"] / ample["output_tokens_per_s"], 3))
        hf: dict[str, float] = {}
        if not a.no_hf:
            hf = bench.run_transformers(a.model, work)
            base = ample or ours  # transformers is compared with the ample-pool run
            vs_hf.append(round(base["output_tokens_per_s"] / hf["output_tokens_per_s"], 3))
        if rep == 0:  # the first repeat's full figures; later ones add their ratios
            if a.pool_fraction:
                report["ferryman_ample"] = ample
                report["pool_basis"] = a.pool_basis
            report["ferryman"] = ours
            if hf:
                report["transformers"] = hf
    if vs_ample:
        report["ratio_vs_ample"] = statistics.median(vs_ample)
    if vs_hf:
        report["ratio_vs_transformers"] = statistics.median(vs_hf)
    if a.repeats > 1:
        report["repeats"] = a.repeats
        report["ratio_vs_ample_runs"] = vs_ample
        report["ratio_vs_transformers_runs"] = vs_hf
    print_report(report, a.json)
    return 0


def print_report(report: dict[str, Any], as_json: bool) -> None:
    """A benchmark's report: one JSON object, or ``key: value`` lines."""
    if as_json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    sys.exit(main())
