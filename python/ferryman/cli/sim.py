"""``ferryman sim``: the real Rust scheduler against a GPU step-time model (``ferryman.sim``); the
engine flags are ``SimConfig``'s fields, the scheduler's knobs shared with the Engine."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ferryman.engine_args import add_cli_args, from_cli
from ferryman.report import print_report
from ferryman.sim.presets import GPUS, MODEL_SHAPES, gpu, model_shape
from ferryman.sim.simulator import SimConfig, simulate
from ferryman.sim.sweep import parse_sweep, plot, sweep, table
from ferryman.sim.workload import from_json, synthetic
from ferryman.trace import TraceWriter


def register(sub: Any) -> None:
    p = sub.add_parser("sim", help="the real scheduler against a GPU step-time model")
    p.add_argument("--gpu", default="h200", help=f"one of {sorted(GPUS)}")
    p.add_argument(
        "--model-shape", default="llama-3-8b", help=f"one of {sorted(MODEL_SHAPES)} or a config.json"
    )
    p.add_argument(
        "--gpu-set", action="append", default=[], metavar="FIELD=VALUE", help="override a GPU field"
    )
    p.add_argument(
        "--shape-set", action="append", default=[], metavar="FIELD=VALUE", help="override a shape field"
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=_positive, default=1000)
    w.add_argument("--rate", type=float, default=8.0, help="requests per second (inf: all at t=0)")
    w.add_argument("--arrival", default="poisson", choices=["poisson", "burst"])
    w.add_argument("--burst-size", type=_positive, default=64)
    w.add_argument(
        "--prompt-len", default="uniform:128:1024", help="fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA"
    )
    w.add_argument("--output-len", default="uniform:64:512")
    w.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    w.add_argument(
        "--interactive-every",
        type=int,
        default=0,
        metavar="K",
        help="every K-th request gets priority 0 and the rest 1, for --policy priority (default: 0, all 0)",
    )
    w.add_argument("--workload", default=None, help="a JSON trace instead of synthetic requests")
    w.add_argument("--seed", type=int, default=0)
    add_cli_args(
        p.add_argument_group("engine and cost model"),
        SimConfig,
        help_overrides={
            "max_model_len": "longest prompt + output of a request (default: the workload's longest)",
            "num_device_blocks": "device KV blocks (default: what the GPU's memory leaves after weights "
            "and activations at gpu_memory_utilization)",
        },
    )
    p.add_argument("--trace", default=None, help="step trace (JSON lines, `ferryman plot` draws it)")
    p.add_argument("--sweep", default=None, metavar="KNOB=V1,V2,...", help="run once per value")
    p.add_argument("--plot", default=None, help="with --sweep: a PNG of throughput and TTFT per value")
    p.add_argument("--json", action="store_true", help="print JSON (one object, or one per sweep value)")
    p.set_defaults(run=run)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _pairs(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep:
            raise ValueError(f"expected FIELD=VALUE, got {item!r}")
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return out


def run(a: argparse.Namespace) -> int:
    g = gpu(a.gpu, **_pairs(a.gpu_set))
    shape = model_shape(a.model_shape, **_pairs(a.shape_set))
    if a.workload and a.interactive_every:
        raise ValueError("--interactive-every shapes synthetic requests: a --workload row gives its priority")
    if a.workload:
        work = from_json(a.workload, vocab=shape.vocab_size, seed=a.seed)
    else:
        work = synthetic(
            a.num_requests,
            a.rate,
            a.prompt_len,
            a.output_len,
            arrival=a.arrival,
            burst_size=a.burst_size,
            shared_prefix=a.shared_prefix,
            interactive_every=a.interactive_every,
            vocab=shape.vocab_size,
            seed=a.seed,
        )
    cfg = from_cli(SimConfig, a)
    if a.sweep and a.trace:
        raise ValueError("--trace records one run; with --sweep, run the value of interest alone")
    if a.plot and not a.sweep:
        raise ValueError("--plot draws a sweep: it needs --sweep")
    if a.sweep:
        knob, values = parse_sweep(a.sweep)
        rows = sweep(g, shape, work, cfg, knob, values)
        if a.json:
            for r in rows:
                print(json.dumps(r))
        else:
            print(f"{g.name}, {shape.name}, {len(work)} requests")
            print(table(rows, knob))
        if a.plot:
            print(plot(rows, knob, a.plot, f"{g.name}, {shape.name}: sweep of {knob}"))
        return 0
    # written beside the path and moved there once the run has stepped: a run refused before its
    # first step leaves the path as it was (a file there is the user's, an earlier trace maybe)
    trace, tmp = None, ""
    if a.trace:
        head, name = os.path.split(os.path.abspath(a.trace))
        tmp = os.path.join(head, f".{name}.{os.getpid()}.partial")
        try:
            trace = TraceWriter(tmp)
        except OSError as e:
            raise OSError(e.errno, f"--trace {a.trace}: {e.strerror}") from None
    done = False
    try:
        report = simulate(g, shape, work, cfg, trace)
        done = True
    finally:
        if trace is not None:
            trace.close()
            if done or os.path.getsize(tmp):
                os.replace(tmp, a.trace)
            else:
                os.unlink(tmp)
    print_report(report, a.json)
    return 0
