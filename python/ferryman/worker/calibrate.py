"""Start-up calibration of the core's ``auto`` cost model on the loaded model: the host-link
bandwidth (a swap-out and swap-in of a few blocks through the real plan path) and the prefill
rate (one forward of a short prompt through the real runner). About 0.3 s for SmolLM2 on two CPU
cores; ``Engine.calibration_s`` records it."""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch

from ferryman._core import RequestParams, Scheduler, SchedulerConfig
from ferryman.worker.kv_cache import KvCache, staging_blocks
from ferryman.worker.model_runner import ModelRunner
from ferryman.worker.sampler import Filters, sample_random


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_link_bytes_per_s(kv: KvCache, bytes_per_block: int, max_blocks: int = 16) -> float | None:
    """Bytes per second of one direction, or ``None`` without a host pool."""
    n = min(max_blocks, kv.num_device_blocks, kv.num_host_blocks)
    if n <= 0:
        return None
    pairs = np.stack([np.arange(1, n + 1)] * 2, axis=1).astype(np.int32)
    none = np.zeros((0, 2), dtype=np.int32)
    kv.run_plans(pairs, none, none)  # warm-up
    _sync(kv.device_kv.device)
    t = time.perf_counter()
    kv.run_plans(pairs, none, none)
    kv.run_plans(none, pairs, none)
    _sync(kv.device_kv.device)
    return 2 * n * bytes_per_block / max(time.perf_counter() - t, 1e-9)


def prefill_tokens_per_s(
    runner: ModelRunner, block_size: int, num_blocks: int, num_tokens: int = 64
) -> float:
    """Tokens per second of one prefill forward of ``num_tokens`` (after an 8-token warm-up),
    on blocks 1.. of the pool, within the runner's ``max_model_len``."""
    num_tokens = max(1, min(num_tokens, num_blocks * block_size - 1, runner.max_model_len - 1))
    vocab = runner.model.cfg.vocab_size
    s = Scheduler(
        SchedulerConfig(
            block_size=block_size,
            num_device_blocks=num_blocks,
            max_num_batched_tokens=num_tokens,
            max_model_len=num_tokens + 1,
            enable_prefix_caching=False,
        )
    )
    rate = 0.0
    for rid, n in enumerate((min(8, num_tokens), num_tokens)):
        s.add_request(rid, [(7 * i + rid) % vocab for i in range(n)], RequestParams(1))
        out = s.schedule()
        _sync(runner.device)
        t = time.perf_counter()
        runner.execute(out)
        _sync(runner.device)
        rate = n / max(time.perf_counter() - t, 1e-9)
        s.update(np.zeros(len(out.logits_indices), dtype=np.int32))
    return rate


def profile_kv_blocks(
    model: Any,
    block_size: int,
    max_num_batched_tokens: int,
    bytes_per_block: int,
    gpu_memory_utilization: float,
    attention_backend: str = "auto",
    max_num_seqs: int = 256,
) -> int:
    """Device KV blocks for a CUDA deployment (vLLM's sizing): run one prefill forward at the
    full token budget on a throw-away pool, and the sampler over ``max_num_seqs`` random rows
    with every filter (its sort of the vocabulary is its peak), then give KV what is left of
    ``total * gpu_memory_utilization`` after the weights, the larger of those two peaks and
    memory other processes hold, and the swap staging buffer (``worker/kv_cache.py``). With
    tensor parallelism every rank runs it together (the forward meets in its collectives)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    cfg = model.cfg
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    blocks = -(-max_num_batched_tokens // block_size) + 1
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    heads = model.shard.num_kv_heads  # this rank's (all of them without tensor parallelism)
    tmp = KvCache(cfg.num_layers, blocks, 0, block_size, heads, cfg.head_dim, dtype, device)
    # positions up to the budget; no CUDA graphs for a runner that runs one prefill
    runner = ModelRunner(
        model, tmp, block_size, device, attention_backend, enforce_eager=True,
        max_model_len=max_num_batched_tokens + 1,
    )  # fmt: skip
    prefill_tokens_per_s(runner, block_size, blocks, num_tokens=max_num_batched_tokens)
    if max_num_seqs > 0:  # 0: a tensor-parallel worker rank, which never samples
        _sample_full_batch(max_num_seqs, cfg.vocab_size, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - tmp.device_kv.numel() * tmp.device_kv.element_size()
    free, total = torch.cuda.mem_get_info(device)
    others = (total - free) - torch.cuda.memory_reserved(device)
    del runner, tmp
    torch.cuda.empty_cache()
    # the swap staging buffer a pool with host blocks allocates beside the device blocks
    staging = staging_blocks(bytes_per_block) * bytes_per_block
    kv_bytes = total * gpu_memory_utilization - peak - others - staging
    if kv_bytes < bytes_per_block:
        raise ValueError(
            f"no memory left for KV blocks at gpu_memory_utilization={gpu_memory_utilization}: weights and "
            f"activations take {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB"
        )
    return int(kv_bytes // bytes_per_block)


def _sample_full_batch(rows: int, vocab: int, device: torch.device) -> None:
    """The sampler's largest step: ``rows`` random rows of float32 logits with top-k, top-p and
    min-p on (one sort of the vocabulary, float64 noise and probabilities)."""
    logits = torch.randn(rows, vocab, device=device)
    full = functools.partial(torch.full, (rows,), device=device)
    sample_random(
        logits,
        full(1.0),
        full(50, dtype=torch.int64),
        full(0.9),
        full(0.05),
        full(0, dtype=torch.int64),
        full(0, dtype=torch.int64),
        Filters(top_k=True, top_p=True, min_p=True),
    )
