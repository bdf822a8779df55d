"""vLLM v1's scheduler (pure Python) replaying the same trace with the same fake model as
``sched_overhead.py``: the side-by-side figure for ferryman's core.

Times ``Scheduler.schedule()`` + ``Scheduler.update_from_output()`` per output token, as
``sched_overhead.py`` times ferryman's ``schedule()`` + ``update()``. The work differs in one
known way: vLLM's scheduler hands the model runner per-request diffs (new block ids, token
counts) and the runner builds the attention arrays, while ferryman's core builds them
(``input_ids``, ``positions``, ``slot_mapping``, ``kv_indices``...) inside the timed calls.
Prefix caching is on in both (vLLM hashes blocks with sha256 by default; ``--hash`` picks
another of its algorithms). Preemption in vLLM v1 is recompute only.

Needs vLLM, which is not a ferryman dependency; give it its own environment (CI does not run
this script):

    python -m venv /tmp/vllm && /tmp/vllm/bin/pip install vllm==0.33.0
    /tmp/vllm/bin/python benchmarks/vllm_scheduler.py --trace trace.json
    /tmp/vllm/bin/python benchmarks/vllm_scheduler.py --trace trace.json --num-device-blocks 5426

(``--hash xxhash`` needs ``pip install xxhash`` in that environment too.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import numpy as np
from workload_trace import blocks_needed, prompt, tokens


def build_scheduler(a: argparse.Namespace, num_blocks: int, max_model_len: int, model_dir: str) -> Any:
    import torch
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    # the scheduler reads only the architecture's shape from the model config: a tiny Llama
    LlamaConfig(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_model_len,
    ).save_pretrained(model_dir)  # fmt: skip
    model = ModelConfig(model_dir, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float32")
    sched = SchedulerConfig(
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        enable_chunked_prefill=True,
    )
    cache = CacheConfig(block_size=a.block_size, enable_prefix_caching=True, prefix_caching_hash_algo=a.hash)
    cpu = DeviceConfig(device="cpu")
    cfg = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, device_config=cpu)
    spec = FullAttentionSpec(block_size=a.block_size, num_kv_heads=1, head_size=64, dtype=torch.float32)
    # vLLM's pool includes its null block, ferryman's num_device_blocks does not
    kv = KVCacheConfig(
        num_blocks=num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    cfg.cache_config.num_gpu_blocks = num_blocks + 1  # what the engine sets after profiling
    return Scheduler(cfg, kv, StructuredOutputManager(cfg), block_size=a.block_size, log_stats=False)


def replay(a: argparse.Namespace, trace: list[dict[str, int]], num_blocks: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    max_model_len = max(r["prompt_len"] + r["output_len"] for r in trace)
    with tempfile.TemporaryDirectory() as model_dir:
        s = build_scheduler(a, num_blocks, max_model_len, model_dir)
    hash_fn = get_hash_fn_by_name(a.hash)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(a.block_size, hash_fn)
    trace = sorted(trace, key=lambda r: (r["arrival_step"], r["id"]))
    lens = np.zeros(max(r["id"] for r in trace) + 1, dtype=np.uint64)
    step_ns: list[int] = []
    nxt = step = num_generated = num_preemptions = 0
    while nxt < len(trace) or s.has_unfinished_requests():
        while nxt < len(trace) and trace[nxt]["arrival_step"] <= step:
            r = trace[nxt]
            params = SamplingParams(max_tokens=r["output_len"], ignore_eos=True, temperature=0.0)
            ids = prompt(a.seed, r["id"], r["prompt_len"]).tolist()
            s.add_request(Request(str(r["id"]), ids, params, None, block_hasher=hasher))
            lens[r["id"]] = r["prompt_len"]
            nxt += 1
        t0 = time.perf_counter_ns()
        out = s.schedule()
        t1 = time.perf_counter_ns()
        # fake model: a token for every request whose scheduled tokens reach its known end
        req_ids = list(out.num_scheduled_tokens)
        done = [r for r in req_ids if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens]
        ids = np.array([int(r) for r in done], dtype=np.uint64)
        new = dict(zip(done, tokens(a.seed, ids, lens[ids]).tolist(), strict=True))
        sampled = [[new[r]] if r in new else [] for r in req_ids]
        index = {r: i for i, r in enumerate(req_ids)}
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index=index, sampled_token_ids=sampled)
        t2 = time.perf_counter_ns()
        s.update_from_output(out, mro)
        t3 = time.perf_counter_ns()
        lens[ids] += np.uint64(1)
        num_generated += len(done)
        num_preemptions += len(out.preempted_req_ids or ())
        step_ns.append((t1 - t0) + (t3 - t2))
        step += 1
    total = float(sum(step_ns))
    return {
        "scheduler": "vllm-v1",
        "requests": len(trace),
        "num_device_blocks": num_blocks,
        "hash": a.hash,
        "steps": step,
        "preemptions": num_preemptions,
        "output_tokens": num_generated,
        "us_per_step_mean": round(total / len(step_ns) / 1e3, 2),
        "ns_per_output_token": round(total / num_generated, 1),
        "scheduler_ms_total": round(total / 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="JSON trace (sched_overhead.py --generate N --out F)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-device-blocks", type=int, help="default: every request fits at once")
    p.add_argument("--hash", default="sha256", help="vLLM's prefix_caching_hash_algo")
    a = p.parse_args(argv)
    with open(a.trace) as f:
        trace = json.load(f)
    blocks = a.num_device_blocks or sum(blocks_needed(trace, a.block_size))
    print(json.dumps(replay(a, trace, blocks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
