"""Building an engine's parts from ``EngineArgs``: the device and dtype, the model and tokenizer,
its context length (checked against the model: ``model_loader.check_context``; when not given,
at most what the device KV pool holds, so that every request it admits can fit) and the sampling
defaults of its ``generation_config.json``, the KV pools (sized by profiling on CUDA, on every
tensor-parallel rank; by ``kv_cache_memory`` on CPU; the host pool by ``swap_space``), the model
runner, start-up calibration of the cost model, and the Rust ``Scheduler`` configured with all
of it. ``Engine`` owns the parts; this module only makes them.

Invariant: the scheduler's pool sizes, block size and ``bytes_per_block`` are those of the
``KvCache`` built here, so every block id the core hands out indexes a real KV block.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ferryman._core import InvalidRequestError, Scheduler
from ferryman.engine_args import EngineArgs
from ferryman.model_loader import (
    check_context,
    generation_defaults,
    is_gguf,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from ferryman.models.llama import LlamaForCausalLM
from ferryman.models.tensor_parallel import TensorParallel
from ferryman.worker.calibrate import host_link_bytes_per_s, prefill_tokens_per_s, profile_kv_blocks
from ferryman.worker.kv_cache import KvCache
from ferryman.worker.model_runner import ModelRunner, runner_with_pool
from ferryman.worker.tp_devices import KvSizing, check_devices
from ferryman.worker.tp_rendezvous import free_port
from ferryman.worker.tp_workers import RankSpec, SpawnedWorkers, Workers
from ferryman.worker.tp_workers import start as start_ranks

log = logging.getLogger("ferryman")


@dataclass(slots=True)
class EngineParts:
    device: torch.device
    dtype: torch.dtype
    model: LlamaForCausalLM
    tokenizer: Any  # a ChatTokenizer or a transformers tokenizer (same interface), or None
    max_model_len: int
    kv: KvCache
    runner: ModelRunner  # with tensor parallelism, rank 0's (a TensorParallelRunner)
    scheduler: Scheduler
    calibration: dict[str, float]  # what start-up measured for the cost model
    calibration_s: float
    # SamplingParams fields from the model's generation_config.json (vLLM's generation_config="auto")
    generation_defaults: dict[str, Any] = field(default_factory=dict)


def resolve_device(device: str) -> torch.device:
    """``auto`` becomes CUDA when there is one; a ``cuda`` without an index, the current GPU (so
    that the model, the KV pool and tensor-parallel ranks count from the same one)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    f32, f16 = torch.float32, torch.float16
    return {"float32": f32, "float": f32, "float16": f16, "half": f16, "bfloat16": torch.bfloat16}[dtype]


def make_current(device: torch.device) -> None:
    """``cuda:N`` becomes the calling thread's current device: the streams, events and graph
    captures that name no device take it."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def build_parts(args: EngineArgs) -> EngineParts:
    device = resolve_device(args.device)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.tensor_parallel_size == 1 and device.type == "cuda" and (device.index or 0) >= count:
        raise InvalidRequestError(
            f"device {args.device!r}: no such CUDA GPU here ({count} visible; 'cpu' runs on the CPU)"
        )
    make_current(device)  # after the check: torch's error for a missing GPU names no knob
    dtype = resolve_dtype(args.dtype, device)
    path = resolve_model_path(args.model, args.load_format != "dummy", args.revision, args.download_dir)
    defaults = generation_defaults(path, args.generation_config)  # a mistyped folder: before loading
    if args.quantization == "gguf" and not is_gguf(path):
        raise InvalidRequestError(f"quantization='gguf' needs a .gguf model; {args.model!r} is not one")
    n = args.tensor_parallel_size
    cannot = check_devices(device, n, args.distributed_executor_backend) if n > 1 else None
    if cannot is not None:
        raise InvalidRequestError(cannot)
    if n > 1 and args.load_format == "dummy":
        raise InvalidRequestError("load_format='dummy' runs on one rank (tensor_parallel_size 1)")
    ray_backend = n > 1 and args.distributed_executor_backend == "ray"
    launch = ray_workers() if ray_backend else SpawnedWorkers  # before loading: fails fast without Ray
    model, tokenizer = load_model(path, dtype, device, TensorParallel(0, n), args.load_format)
    if args.tokenizer is not None:  # vLLM's tokenizer=: another than the model's own
        tokenizer = load_tokenizer(args.tokenizer, args.revision, args.download_dir)
    mc, block_size = model.cfg, args.block_size
    # one rank's KV heads of a block (all of them without tensor parallelism)
    bpb = KvCache.bytes_per_block(mc.num_layers, block_size, model.shard.num_kv_heads, mc.head_dim, dtype)
    max_model_len = check_context(mc, args.max_model_len)
    budget = args.token_budget(device.type, max_model_len)
    num_device_blocks = args.num_device_blocks
    if num_device_blocks is None and device.type != "cuda":
        num_device_blocks = max(1, args.kv_cache_memory // bpb)
    num_host_blocks = args.num_host_blocks
    if num_host_blocks is None:
        num_host_blocks = int(args.swap_space * (1 << 30)) // bpb
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.type != "cuda" and num_device_blocks is not None and num_device_blocks * bpb > ram:
        raise InvalidRequestError(  # on the CPU the device pool is host memory too
            f"the KV pool ({num_device_blocks} blocks, {num_device_blocks * bpb / (1 << 30):.1f} GiB: "
            f"kv_cache_memory / num_device_blocks) exceeds this machine's memory ({ram / (1 << 30):.1f} GiB)"
        )
    if num_host_blocks * bpb > ram:  # the host pool is allocated now: say why, not torch's error
        raise InvalidRequestError(
            f"the host KV pool ({num_host_blocks} blocks, {num_host_blocks * bpb / (1 << 30):.1f} GiB: "
            f"swap_space / num_host_blocks) exceeds this machine's memory ({ram / (1 << 30):.1f} GiB)"
        )
    if n > 1:  # ranks 1..n-1 in worker processes; rank 0's runner sends them each plan
        sizing = KvSizing(budget, bpb, args.gpu_memory_utilization, args.max_num_seqs)
        spec = RankSpec(
            str(path), str(dtype).removeprefix("torch."), n, f"tcp://127.0.0.1:{free_port()}", block_size,
            num_device_blocks, num_host_blocks, args.max_num_seqs, max_model_len, args.attention_backend,
            float(os.environ.get("FERRYMAN_TEST_TP_TIMEOUT_S") or 60), str(device), sizing,
        )  # fmt: skip
        runner: Any = start_ranks(spec, model, launch)
    else:
        if num_device_blocks is None:  # CUDA (over ranks, each rank profiles its own: tp_devices)
            num_device_blocks = profile_kv_blocks(
                model, block_size, budget, bpb, args.gpu_memory_utilization, args.attention_backend,
                args.max_num_seqs,
            )  # fmt: skip
        runner = runner_with_pool(
            model,
            dtype,
            device,
            block_size,
            num_device_blocks,
            num_host_blocks,
            args.attention_backend,
            args.enforce_eager,
            args.max_num_seqs,
            max_model_len,
        )
    kv = runner.kv
    num_device_blocks = kv.num_device_blocks  # over ranks that profiled, the count they agreed on
    pool_tokens = num_device_blocks * block_size
    if args.max_model_len is None and pool_tokens < max_model_len:
        # a request of the model's whole context could never fit: the context is what the pool holds
        # (an open max_tokens then fills the pool, instead of asking for more than it has)
        log.warning("the KV pool holds %d tokens, fewer than the model's context of %d: max_model_len is %d",
                    pool_tokens, max_model_len, pool_tokens)  # fmt: skip
        max_model_len = pool_tokens
    calibration: dict[str, float] = {}
    started = time.perf_counter()
    if args.calibrate:  # with tensor parallelism the prefill runs on every rank (through the runner)
        link = host_link_bytes_per_s(kv, bpb)
        if link is not None:
            calibration["host_link_bytes_per_s"] = link
        calibration["prefill_tokens_per_s"] = prefill_tokens_per_s(runner, block_size, num_device_blocks)
    calibration_s = time.perf_counter() - started
    scheduler = Scheduler(
        args.scheduler_config(
            num_device_blocks=num_device_blocks,
            num_host_blocks=num_host_blocks,
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            async_scheduling=overlap(args, device),
            bytes_per_block=float(bpb),
            **calibration,
        )
    )
    return EngineParts(
        device,
        dtype,
        model,
        tokenizer,
        max_model_len,
        kv,
        runner,
        scheduler,
        calibration,
        calibration_s,
        defaults,
    )


def ray_workers() -> Callable[[RankSpec], Workers]:
    """The ``ray`` executor backend's launcher, or a clear error without Ray."""
    try:
        from ferryman.worker.ray_ranks import RayWorkers
    except ImportError as e:
        raise InvalidRequestError(
            f"distributed_executor_backend='ray' needs ray (pip install 'ray[serve]'): {e}"
        ) from None
    return RayWorkers


def overlap(args: EngineArgs, device: torch.device) -> bool:
    """``async_scheduling``, or its default: on with CUDA, off on CPU."""
    return args.async_scheduling if args.async_scheduling is not None else device.type == "cuda"
