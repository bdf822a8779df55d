"""``ferryman bench throughput``: offline throughput of the Engine on random prompts, side by side
with Hugging Face transformers' batched ``generate`` on the same prompts and weights.

Prompts are random token ids with lengths drawn uniformly from ``--input-len``; each request
asks for a number of tokens drawn from ``--output-len`` and ignores EOS, so both systems produce
exactly the same number of useful tokens. transformers runs them as one left-padded batch that
generates the longest output for every row (static batching); only the requested tokens count.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from ferryman.sampling_params import SamplingParams


def _span(s: str, least: int = 1) -> tuple[int, int]:
    """``LO:HI`` (or ``N``) with ``least <= LO <= HI``; ``ValueError`` otherwise."""
    lo, _, hi = s.partition(":")
    span = int(lo), int(hi or lo)
    if not least <= span[0] <= span[1]:
        raise ValueError(f"{s!r}: want LO:HI with {least} <= LO <= HI")
    return span


def workload(
    token_range: str, n: int, input_len: str, output_len: str, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    (tlo, thi), (ilo, ihi), (olo, ohi) = _span(token_range, 0), _span(input_len), _span(output_len)
    if thi == tlo:
        raise ValueError(f"--token-range {token_range!r}: token ids are drawn from LO to HI - 1")
    return [
        ([rng.randrange(tlo, thi) for _ in range(rng.randint(ilo, ihi))], rng.randint(olo, ohi))
        for _ in range(n)
    ]


def request_blocks(work: list[tuple[list[int], int]], block_size: int = 16) -> list[int]:
    """KV blocks each request holds when complete: its prompt plus all its output."""
    return [-(-(len(p) + m) // block_size) for p, m in work]


def demand_blocks(work: list[tuple[list[int], int]], block_size: int = 16) -> int:
    """KV blocks the whole workload asks for."""
    return sum(request_blocks(work, block_size))


@dataclass(frozen=True)
class Sampling:
    """How every request of the workload samples (greedy by default); request i is seeded with i."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


def run_ferryman(
    model: str, work: list[tuple[list[int], int]], sampling: Sampling = Sampling(), **engine_kw: Any
) -> dict[str, Any]:
    from ferryman.engine import Engine

    engine = Engine(model, **engine_kw)
    sp = sampling
    params = [
        SamplingParams(
            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=i, max_tokens=m, ignore_eos=True
        )
        for i, (_, m) in enumerate(work)
    ]
    t = time.perf_counter()
    outs = engine.generate([p for p, _ in work], params)
    dt = time.perf_counter() - t
    st = engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "seconds": round(dt, 2),
        "requests_per_s": round(len(work) / dt, 3),
        "output_tokens_per_s": round(tokens / dt, 1),
        "output_tokens": tokens,
        "num_device_blocks": st["num_device_blocks"],
        "preemptions_recompute": st["num_preemptions_recompute"],
        "preemptions_swap": st["num_preemptions_swap"],
        "peak_blocks_used": engine.peak_blocks_used,
        "async_scheduling": engine.scheduler.config.async_scheduling,
    }


def run_transformers(
    model: str, work: list[tuple[list[int], int]], sampling: Sampling = Sampling(), dtype: str = "auto"
) -> dict[str, Any]:
    """transformers' batched ``generate`` on the same weights, on the CPU, in ``dtype`` as the
    Engine's knob names it (``auto``: float32 there); the dtype it ran in is in the result."""
    import torch
    import transformers as tf

    from ferryman.engine_setup import resolve_dtype
    from ferryman.model_loader import is_gguf, resolve_model_path

    path = resolve_model_path(model)
    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    hf: Any
    if is_gguf(path):
        hf = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    else:
        hf = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    hf.eval()
    width = max(len(p) for p, _ in work)
    ids = torch.zeros((len(work), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(work):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    longest = max(m for _, m in work)
    t = time.perf_counter()
    with torch.inference_mode():
        hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            pad_token_id=0,
            **(
                {"do_sample": False}
                if sampling.temperature == 0
                else {
                    "do_sample": True,
                    "temperature": sampling.temperature,
                    "top_p": sampling.top_p,
                    "top_k": max(sampling.top_k, 0),  # 0: off
                }
            ),
        )
    dt = time.perf_counter() - t
    tokens = sum(m for _, m in work)
    return {
        "seconds": round(dt, 2),
        "requests_per_s": round(len(work) / dt, 3),
        "output_tokens_per_s": round(tokens / dt, 1),
        "output_tokens": tokens,
        "dtype": str(torch_dtype).removeprefix("torch."),
    }
