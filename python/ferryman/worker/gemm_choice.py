"""Which GEMM each projection runs at each decode row count on CUDA: cuBLAS (``F.linear``) or
the skinny kernel (``kernels/skinny_gemm.py``) at one of its tile shapes, whichever this device
runs faster on this model's own weights. ``ModelRunner.use_skinny_gemm()`` measures and applies
it (off by default until a device run says it pays; docs/gpu.md).

How: the projections are grouped by weight shape, dtype and bias (Llama-3-8B: qkv, o, gate_up,
down and the LM head). For each group and row count, each candidate is captured as a CUDA graph
that runs every module of the group once (a weight is read again only after the rest of its
group, as in a forward; at 8B's shapes each group is far larger than the L2), so the timing is
the device's, not the host's launch cost (a decode step replays graphs too). The candidates'
graphs are replayed in turn, ``REPEATS`` times, and each takes its median. A tile shape is first
checked against ``skinny_gemm.reference`` on the first ``CHECK_ROWS`` output features of the
group's first module; one that fails to compile, raises or differs is left out, with the reason
in the report. The kernel is chosen only where it beats cuBLAS by ``MARGIN``.

Invariant: a ``Linear``'s ``skinny`` maps row counts to a checked, measured launcher; row counts
without one (and any non-contiguous input) run ``F.linear``. Graphs captured before a change
must be captured again (the runner does).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from ferryman.models.llama import Linear

MARGIN = 0.03  # the kernel must take at most 97% of cuBLAS's time
REPEATS = 5
CHECK_ROWS = 256  # of the weight, for the check against the reference (not a float32 copy of it all)


def choose(timings: dict[str, float], margin: float = MARGIN) -> str | None:
    """The fastest tile shape of ``timings`` (name -> seconds, ``"cublas"`` among them), if it
    beats cuBLAS by ``margin``; else None."""
    base = timings["cublas"]
    rest = {n: t for n, t in timings.items() if n != "cublas"}
    if not rest:
        return None
    best = min(rest, key=lambda n: rest[n])
    return best if rest[best] <= base * (1 - margin) else None


def groups(model: torch.nn.Module) -> dict[tuple[int, int, torch.dtype, bool], list[Linear]]:
    """The model's bf16/fp16 CUDA projections by (out, in, dtype, has bias)."""
    out: dict[tuple[int, int, torch.dtype, bool], list[Linear]] = {}
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not isinstance(mod, Linear) or w is None or w.device.type != "cuda" or w.dim() != 2:
            continue
        if w.dtype not in (torch.bfloat16, torch.float16) or not w.is_contiguous():
            continue
        out.setdefault((w.shape[0], w.shape[1], w.dtype, mod.bias is not None), []).append(mod)
    return out


def _graph(fn: Callable[[Linear], Any], mods: list[Linear]) -> torch.cuda.CUDAGraph:
    """``fn`` over every module of ``mods`` once, captured; run once first on a side stream, as
    torch's capture wants (lazy initialisation, Triton's compile, cuBLAS's workspace)."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(mods[0])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for m in mods:
            fn(m)
    return g


def _median_seconds(graphs: dict[str, torch.cuda.CUDAGraph], calls: int) -> dict[str, float]:
    """Per graph, the median seconds per call over ``REPEATS`` replays, the graphs in turn."""
    times: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(REPEATS):
        for n, g in graphs.items():
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[n].append(float(start.elapsed_time(end)) / 1e3 / calls)
    return {n: sorted(t)[len(t) // 2] for n, t in times.items()}


def calibrate(model: torch.nn.Module, rows: Iterable[int]) -> dict[str, Any]:
    """Measures and sets every projection's ``skinny`` for ``rows`` (each 1..``MAX_ROWS``);
    returns a report: per group, per row count, the seconds of each candidate and the choice."""
    from ferryman.kernels import skinny_gemm as sg

    with torch.inference_mode():
        return _calibrate(model, rows, sg)


def _calibrate(model: torch.nn.Module, rows: Iterable[int], sg: Any) -> dict[str, Any]:
    report: dict[str, Any] = {}
    row_counts = sorted({m for m in rows if 1 <= m <= sg.MAX_ROWS})
    for (n, k, dtype, _), mods in groups(model).items():
        chosen: dict[int, Callable[..., torch.Tensor]] = {}
        per_rows: dict[int, Any] = {}
        for m in row_counts:
            x = torch.randn(m, k, dtype=dtype, device=mods[0].weight.device)
            timings, cfgs, rejected = _measure(x, mods, sg)
            pick = choose(timings)
            per_rows[m] = {"us": {t: round(s * 1e6, 2) for t, s in timings.items()}, "chosen": pick}
            if rejected:
                per_rows[m]["rejected"] = rejected
            if pick is not None:
                chosen[m] = functools.partial(sg.skinny_linear, cfg=cfgs[pick])
        for mod in mods:
            mod.skinny = dict(chosen) if chosen else None
        report[f"{n}x{k}"] = {"modules": len(mods), "rows": per_rows}
    return report


def _measure(
    x: torch.Tensor, mods: list[Linear], sg: Any
) -> tuple[dict[str, float], dict[str, Any], dict[str, str]]:
    """Seconds per call of cuBLAS and of each tile shape that compiles and matches the reference,
    on input ``x``; those tile shapes by name; why the others were left out."""
    first = mods[0]
    w, b = first.weight[:CHECK_ROWS], None if first.bias is None else first.bias[:CHECK_ROWS]
    want = sg.reference(x, w, b).float()
    graphs = {"cublas": _graph(lambda mod: F.linear(x, mod.weight, mod.bias), mods)}
    cfgs, rejected = {}, {}
    for cfg in sg.configs_for(x.shape[0]):
        name = cfg.name
        try:
            err = float((sg.skinny_linear(x, w, b, cfg).float() - want).abs().max())
            if not err <= 2e-2 * max(1.0, float(want.abs().max())):
                rejected[name] = f"differs from the reference by {err:.3g}"
                continue

            def run(mod: Linear, c: Any = cfg) -> torch.Tensor:
                return sg.skinny_linear(x, mod.weight, mod.bias, c)  # type: ignore[no-any-return]

            graphs[name] = _graph(run, mods)
            cfgs[name] = cfg
        except Exception as e:  # too much shared memory for this device, or worse: reported
            rejected[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return _median_seconds(graphs, len(mods)), cfgs, rejected


def clear(model: torch.nn.Module) -> None:
    """Every projection back to ``F.linear``."""
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.skinny = None
