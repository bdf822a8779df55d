"""What structured outputs cost per token: the grammar mask the core computes for each constrained
sample (llguidance, inside ``schedule()``), the sampler applying it (the bitmask unpacked into an
additive -inf bias on the logits' device), and the whole step against the same requests without a
grammar. Prints one JSON line.

    python benchmarks/structured.py                       # SmolLM2 (49,152 tokens), CPU
    python benchmarks/structured.py --model tiny          # the tests' 259-token random Llama

Each kind (a JSON schema, a regex, a choice) runs ``--requests`` greedy chat requests together,
constrained, then the same requests unconstrained, on one engine (async scheduling off, so the
two runs step alike). Mask time is the core's own counter (``grammar_mask_ns`` over
``num_grammar_masks``: one mask per constrained sample); the sampler's part is timed by wrapping
``apply_grammar`` where the sampling table calls it. Step time per output token is wall time over
output tokens, constrained against unconstrained (greedy outputs differ, so lengths differ:
per-token figures only).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from args import count
from tiny import tiny_model

import ferryman.worker.sampling_table as st
from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
KINDS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9], [A-Z][a-z]{2,12}"),
    "choice": StructuredOutputsParams(choice=["positive", "negative", "neutral", "mixed"]),
}


def run(eng: Engine, so: StructuredOutputsParams | None, n: int, max_tokens: int) -> dict[str, Any]:
    prompts: list[Any] = [
        f"Describe person number {i} (name, age, hobbies) in a short answer." for i in range(n)
    ]
    if getattr(eng.tokenizer, "chat_template", None):  # an instruct model: ask through its template
        prompts = [eng.render_chat([{"role": "user", "content": p}])[1] for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
    before = eng.scheduler.stats()
    applied = [0, 0]  # calls, ns
    inner = st.apply_grammar

    def timed(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return inner(*a, **kw)
        finally:
            applied[0] += 1
            applied[1] += time.perf_counter_ns() - t

    st.apply_grammar = timed
    try:
        t0 = time.perf_counter()
        outs = eng.generate(prompts, [sp] * n, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        st.apply_grammar = inner
    after = eng.scheduler.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    masks = after["num_grammar_masks"] - before["num_grammar_masks"]
    mask_ns = after["grammar_mask_ns"] - before["grammar_mask_ns"]
    return {
        "output_tokens": tokens,
        "ms_per_output_token": round(wall * 1e3 / max(tokens, 1), 3),
        "masks": masks,
        "mask_us_per_token": round(mask_ns / max(masks, 1) / 1e3, 2),
        "apply_us_per_token": round(applied[1] / max(tokens, 1) / 1e3, 2),
        "errors": after["num_grammar_errors"] - before["num_grammar_errors"],
        "sample": outs[0].outputs[0].text[:80],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2' (default), 'tiny', or a model path")
    ap.add_argument("--requests", type=count, default=8)
    ap.add_argument("--max-tokens", type=count, default=48)
    a = ap.parse_args(argv)
    model = tiny_model(Path(tempfile.mkdtemp())) if a.model == "tiny" else a.model
    eng = Engine(model, device="cpu", calibrate=False, seed=0, max_model_len=256, async_scheduling=False)
    report: dict[str, Any] = {"model": a.model, "vocab": eng.model.cfg.vocab_size, "requests": a.requests}
    run(eng, KINDS["choice"], 2, 4)  # warm-up: builds the tokenizer environment once
    for name, so in KINDS.items():
        report[name] = run(eng, so, a.requests, a.max_tokens)
        report[name + "_unconstrained"] = run(eng, None, a.requests, a.max_tokens)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
