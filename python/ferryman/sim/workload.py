"""Workloads for ``ferryman sim``: synthetic (Poisson or burst arrivals, prompt and output length
distributions) or a JSON trace. Everything is drawn from one seeded generator, so a seed fixes the
workload exactly.

Length distributions are written ``fixed:N``, ``uniform:LO:HI`` or ``lognormal:MEDIAN:SIGMA``
(clipped to at least 1). A JSON trace is a list of ``{"arrival_s", "prompt_len", "output_len"}``
objects (``arrival_s`` defaults to 0; ``prompt_tokens`` may replace ``prompt_len``; ``priority``, an
integer, lower first, defaults to 0 and matters under the ``priority`` policy).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(slots=True)
class Workload:
    arrival_s: np.ndarray  # float64 [n], non-decreasing
    prompt_len: np.ndarray  # int64 [n]
    output_len: np.ndarray  # int64 [n]
    prompts: list[np.ndarray]  # int32 token ids per request (prefix caching sees real ids)
    priority: np.ndarray | None = None  # int64 [n]; lower runs first, higher is preempted first

    def __len__(self) -> int:
        return len(self.arrival_s)


def lengths(spec: str, n: int, rng: np.random.Generator) -> np.ndarray:
    kind, _, rest = spec.partition(":")
    args = [float(x) for x in rest.split(":")] if rest else []
    valid = {"fixed": lambda: args[0] >= 1, "uniform": lambda: 1 <= args[0] <= args[1]}
    valid["lognormal"] = lambda: args[0] > 0 and args[1] >= 0
    if kind in valid and len(args) == (1 if kind == "fixed" else 2) and not valid[kind]():
        raise ValueError(f"length distribution {spec!r}: lengths are >= 1 (uniform: LO <= HI)")
    if kind == "fixed" and len(args) == 1:
        out = np.full(n, args[0])
    elif kind == "uniform" and len(args) == 2:
        out = rng.integers(int(args[0]), int(args[1]) + 1, size=n)
    elif kind == "lognormal" and len(args) == 2:
        out = rng.lognormal(np.log(args[0]), args[1], size=n)
    else:
        raise ValueError(
            f"bad length distribution {spec!r}: use fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA"
        )
    result: np.ndarray = np.maximum(1, np.rint(out)).astype(np.int64)
    return result


def _prompts(
    own_len: np.ndarray, rng: np.random.Generator, vocab: int, shared_prefix: int
) -> list[np.ndarray]:
    """Token ids: a common prefix of ``shared_prefix`` tokens, then each request's own tokens."""
    prefix = rng.integers(0, vocab, size=shared_prefix, dtype=np.int32)
    return [
        np.concatenate([prefix, rng.integers(0, vocab, size=n, dtype=np.int32)]) for n in own_len.tolist()
    ]


def synthetic(
    num_requests: int,
    rate: float,
    prompt_len: str,
    output_len: str,
    *,
    arrival: str = "poisson",
    burst_size: int = 64,
    shared_prefix: int = 0,
    interactive_every: int = 0,
    vocab: int = 32000,
    seed: int = 0,
) -> Workload:
    """``arrival="poisson"``: exponential gaps at ``rate`` per second (``inf``: all at t=0).
    ``"burst"``: groups of ``burst_size`` requests arrive together, groups at ``rate / burst_size``
    per second (the same mean rate). ``shared_prefix`` tokens (a system prompt) precede each
    prompt's own ``prompt_len`` tokens. ``interactive_every=k`` gives every k-th request priority 0
    and the rest priority 1 (for the ``priority`` victim policy)."""
    if num_requests < 1 or interactive_every < 0:
        raise ValueError("num_requests must be >= 1 and interactive_every >= 0")
    rng = np.random.default_rng(seed)
    if shared_prefix < 0:
        raise ValueError(f"shared_prefix must be >= 0, got {shared_prefix}")
    if rate == float("inf"):
        t = np.zeros(num_requests)
    elif not rate > 0:  # NaN too: its gaps would never advance the clock
        raise ValueError(f"rate must be > 0 (or inf), got {rate}")
    elif arrival == "poisson":
        t = np.cumsum(rng.exponential(1.0 / rate, size=num_requests))
    elif arrival == "burst":
        groups = -(-num_requests // burst_size)
        starts = np.cumsum(rng.exponential(burst_size / rate, size=groups))
        t = np.repeat(starts, burst_size)[:num_requests]
    else:
        raise ValueError(f"arrival must be 'poisson' or 'burst', got {arrival!r}")
    p, o = lengths(prompt_len, num_requests, rng), lengths(output_len, num_requests, rng)
    prio = None
    if interactive_every > 0:
        prio = np.ones(num_requests, dtype=np.int64)
        prio[::interactive_every] = 0
    return Workload(t, p + shared_prefix, o, _prompts(p, rng, vocab, shared_prefix), prio)


def _count(v: Any) -> int:
    """A length from JSON: an integer (10.0 too), never a truncated 2.5 or a bool."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not float(v).is_integer():
        raise TypeError(f"{v!r} is not a whole number")
    return int(v)


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int and 0 <= t < 1 << 31 for t in v)


def _arrival(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"arrival_s {v!r} is not a number")
    return float(v)


def from_json(path: str | Path, *, vocab: int = 32000, seed: int = 0) -> Workload:
    try:
        rows = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: expected a non-empty JSON list of requests")
    try:
        t = np.array([_arrival(r.get("arrival_s", 0.0)) for r in rows])
        lens = [r["prompt_len"] if "prompt_len" in r else len(r["prompt_tokens"]) for r in rows]
        p = np.array([_count(n) for n in lens])
        o = np.array([_count(r["output_len"]) for r in rows], dtype=np.int64)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{path}: each request needs prompt_len (or prompt_tokens) and output_len ({e})"
        ) from None
    p = p.astype(np.int64)
    if (p < 1).any() or (o < 1).any() or (p + o > 1 << 31).any():
        raise ValueError(f"{path}: prompt_len and output_len must be >= 1, together at most 2**31")
    for i, r in enumerate(rows):
        ids = r.get("prompt_tokens")
        if isinstance(ids, list) and "prompt_len" in r and len(ids) != p[i]:
            raise ValueError(f"{path}: request {i}'s prompt_len {p[i]} is not its {len(ids)} prompt_tokens")
    prio = None
    if any("priority" in r for r in rows):
        prio = np.array([r.get("priority", 0) for r in rows], dtype=object)
        if not all(type(v) is int and -(1 << 31) <= v < 1 << 31 for v in prio):
            raise ValueError(f"{path}: priority must be an integer in [-2**31, 2**31)")
        prio = prio.astype(np.int64)
    bad = next((i for i, r in enumerate(rows) if not _token_ids(r.get("prompt_tokens", []))), None)
    if bad is not None:
        raise ValueError(f"{path}: request {bad}'s prompt_tokens are not token ids (integers in [0, 2**31))")
    if not (np.isfinite(t) & (t >= 0)).all():
        raise ValueError(f"{path}: arrival_s must be a finite number of seconds >= 0")
    order = np.argsort(t, kind="stable")
    rng = np.random.default_rng(seed)
    prompts = [
        np.asarray(rows[i]["prompt_tokens"], dtype=np.int32) if "prompt_tokens" in rows[i] else None
        for i in order.tolist()
    ]
    drawn = _prompts(p[order], rng, vocab, 0)
    return Workload(
        t[order],
        p[order],
        o[order],
        [a if a is not None else b for a, b in zip(prompts, drawn, strict=True)],
        None if prio is None else prio[order],
    )
