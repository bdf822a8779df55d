"""The ``ferryman`` command: ``generate`` and ``bench throughput`` (serve, chat, bench serve and
plot come with the server)."""

from __future__ import annotations

import argparse
import json
import sys

from ferryman.model_loader import DEFAULT_MODEL
from ferryman.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ferryman", description="ferryman LLM serving engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete a prompt and print the text")
    g.add_argument("prompt", nargs="+", help="one or more prompts")
    g.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2', a .gguf file or a Hugging Face folder")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--num-device-blocks", type=int, default=None)
    g.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"])
    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    t = b.add_parser("throughput", help="offline throughput vs transformers' batched generate")
    t.add_argument("--model", default=DEFAULT_MODEL)
    t.add_argument("--num-prompts", type=int, default=64)
    t.add_argument("--input-len", default="32:256", help="LO:HI prompt tokens, uniform")
    t.add_argument("--output-len", default="16:256", help="LO:HI output tokens, uniform")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--token-range", default="100:1000", help="LO:HI token ids of the random prompts")
    t.add_argument("--num-device-blocks", type=int, default=None, help="default: every request fits")
    t.add_argument("--pool-fraction", type=float, default=None, help="pool = this fraction of the ample peak")
    t.add_argument("--num-host-blocks", type=int, default=None)
    t.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"])
    t.add_argument("--max-num-batched-tokens", type=int, default=None)
    t.add_argument("--no-hf", action="store_true", help="skip the transformers run")
    t.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    if a.cmd == "bench":
        return _bench_throughput(a)
    from ferryman.engine import Engine

    engine = Engine(a.model, num_device_blocks=a.num_device_blocks, preemption_mode=a.preemption_mode)
    params = SamplingParams(
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed, max_tokens=a.max_tokens
    )
    for prompt, out in zip(a.prompt, engine.generate(a.prompt, params), strict=True):
        sys.stdout.write(prompt + out.outputs[0].text + "\n")
    return 0


def _bench_throughput(a: argparse.Namespace) -> int:
    from ferryman import bench

    work = bench.workload(a.token_range, a.num_prompts, a.input_len, a.output_len, a.seed)
    demand = sum(-(-(len(p) + m) // 16) for p, m in work)
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
    ample: dict[str, float] = {}
    if a.pool_fraction:
        ample = bench.run_ferryman(a.model, work, num_device_blocks=demand, **kw)
        report["ferryman_ample"] = ample
        longest = max(-(-(len(p) + m) // 16) for p, m in work)
        blocks = max(longest, int(ample["peak_blocks_used"] * a.pool_fraction))
    ours = bench.run_ferryman(a.model, work, num_device_blocks=blocks, **kw)
    report["ferryman"] = ours
    if a.pool_fraction:
        report["ratio_vs_ample"] = round(ours["output_tokens_per_s"] / ample["output_tokens_per_s"], 3)
    if not a.no_hf:
        hf = bench.run_transformers(a.model, work)
        report["transformers"] = hf
        base = ample or ours  # transformers is compared with the ample-pool run
        report["ratio_vs_transformers"] = round(base["output_tokens_per_s"] / hf["output_tokens_per_s"], 3)
    if a.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
