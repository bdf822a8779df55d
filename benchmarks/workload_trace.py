"""The workload trace the scheduler benchmarks replay, and its token ids.

A trace is a JSON list of ``{"id", "arrival_step", "prompt_len", "output_len"}``. The token of
request r at position p is ``splitmix64((seed << 48) | (r << 24) | p) % 151936``; a fake model
emits, for every sample, the token of position ``len(request)``. No ferryman import, so replays
of other engines' schedulers (``vllm_scheduler.py``) share it from their own environment.
"""

from __future__ import annotations

import random

import numpy as np
import numpy.typing as npt

VOCAB = 151936


def splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 on an array of uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
        return out


def tokens(seed: int, req: npt.NDArray[np.uint64], pos: npt.NDArray[np.uint64]) -> npt.NDArray[np.int32]:
    """The token of each (request, position) pair."""
    key = (np.uint64(seed) << np.uint64(48)) | (req << np.uint64(24)) | pos
    out: npt.NDArray[np.int32] = (splitmix64(key) % np.uint64(VOCAB)).astype(np.int32)
    return out


def prompt(seed: int, req_id: int, length: int) -> npt.NDArray[np.int32]:
    """The prompt of request `req_id`."""
    return tokens(seed, np.full(length, req_id, dtype=np.uint64), np.arange(length, dtype=np.uint64))


def generate(n: int, seed: int, per_step: int) -> list[dict[str, int]]:
    """Prompts 128-2048 and outputs 64-512 tokens, uniform; `per_step` arrivals per step."""
    rng = random.Random(seed)
    return [
        {
            "id": i,
            "arrival_step": i // per_step,
            "prompt_len": rng.randint(128, 2048),
            "output_len": rng.randint(64, 512),
        }
        for i in range(n)
    ]


def trace_problem(trace: object) -> str | None:
    """What makes ``trace`` unplayable (said in one line), or None: a non-empty list of requests
    with distinct integer ids, arrival steps >= 0 and lengths >= 1."""
    if not isinstance(trace, list) or not trace:
        return "a trace is a non-empty JSON list of requests"
    keys = ("id", "arrival_step", "prompt_len", "output_len")
    for i, r in enumerate(trace):
        if not isinstance(r, dict) or not all(type(r.get(k)) is int for k in keys):
            return f"request {i} needs integer {', '.join(keys)}"
        if r["id"] < 0 or r["arrival_step"] < 0 or r["prompt_len"] < 1 or r["output_len"] < 1:
            return f"request {i}: id and arrival_step must be >= 0, prompt_len and output_len >= 1"
    if len({r["id"] for r in trace}) < len(trace):
        return "two requests share an id"
    return None


def blocks_needed(trace: list[dict[str, int]], block_size: int) -> list[int]:
    """Blocks each request holds when complete."""
    return [-(-(r["prompt_len"] + r["output_len"]) // block_size) for r in trace]
