"""Where each tensor-parallel rank runs, over which ``torch.distributed`` backend, and how many
KV blocks every rank's pool gets.

- **Devices**: on CPU every rank is the CPU; with the engine on ``cuda:B`` rank r runs on
  ``cuda:B+r`` (the ``mp`` backend's processes on one machine), so N ranks need GPUs B..B+N-1.
- **Backends**: the model's collectives (all-reduce, the logits' all-gather) run over NCCL on
  CUDA and gloo on CPU; the per-step plans and the start-up agreement below always go over a
  gloo group, since they are host objects (vLLM keeps a CPU group beside NCCL for the same).
  The gloo group is also what notices a rank that died between steps: rank 0's next plan
  broadcast fails on the closed connection, before any NCCL collective would wait out its
  timeout.
- **KV sizing**: given a block count, every rank takes it. On CUDA without one, every rank
  profiles its own device (``profile_kv_blocks``: the same prefill forward on each, meeting in
  its collectives; only rank 0, which samples, adds the sampler's peak) and the smallest count
  wins, so every block id the core hands out exists on every rank. A rank that finds no room
  makes every rank raise, never leaves the others waiting.

On CUDA the ranks run eager (capturing NCCL collectives in CUDA graphs is not done here). The
start-up's load report over gloo (``tp_workers.build_runner``) matters there: NCCL's set-up,
at a rank's first collective, waits for the others with no timeout. A rank that dies
mid-forward leaves rank 0 waiting for the step's results until NCCL's watchdog ends the process
at the collective timeout (exit non-zero, for a supervisor to restart), not the clean
``RankFailedError`` of gloo.

Invariant: every rank of a group ends with the same ``num_device_blocks``.
The CUDA half has not run: the GPU machine lent here has one device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class KvSizing:
    """What a CUDA rank profiles its pool with when no block count was given."""

    max_num_batched_tokens: int
    bytes_per_block: int
    gpu_memory_utilization: float
    max_num_seqs: int


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device when the engine (rank 0) runs on ``device``."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + rank)


def backend_of(device: str) -> str:
    """The backend of the model's collectives on ``device``."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def check_devices(device: torch.device, world: int, executor: str) -> str | None:
    """Why ``world`` ranks cannot start from ``device``, or None when they can."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"tensor_parallel_size > 1 runs on CPU (gloo) or CUDA (NCCL), not {device.type}"
    if executor != "mp":
        return "tensor_parallel_size > 1 on CUDA runs with distributed_executor_backend='mp' only for now"
    first, visible = device.index or 0, torch.cuda.device_count()
    if visible < first + world:
        return (
            f"tensor_parallel_size={world} from {device} needs GPUs {first}..{first + world - 1}, one "
            f"per rank; {visible} visible"
        )
    return None


def agree_min(n: int, group: Any) -> int:
    """The smallest ``n`` over the ranks of ``group`` (a gloo group)."""
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def everywhere(fn: Callable[[], T], group: Any, elsewhere: Exception | None = None) -> T:
    """``fn()`` on this rank, returned once every rank of ``group`` has run its own: a rank whose
    ``fn`` raises makes every rank raise (it its own error, the others ``elsewhere`` or a
    ``RuntimeError``), rather than leaving the others waiting in the next collective."""
    try:
        out = fn()
    except BaseException:
        agree_min(-1, group)
        raise
    if agree_min(1, group) < 0:
        raise elsewhere or RuntimeError(
            "another tensor-parallel rank failed while starting (its error is in its log)"
        )
    return out


def rank_num_blocks(given: int | None, sizing: KvSizing | None, rank: int, group: Any, profile: Any) -> int:
    """This rank's device KV blocks: ``given``, else the smallest over the ranks of what
    ``profile(sizing, sampler_rows)`` finds on each (an error there, on any rank, raises on every
    rank, though one inside its forward leaves the others in a collective)."""
    if given is not None:
        return given
    if sizing is None:
        raise ValueError("a rank with no block count needs a KvSizing to profile its device")
    rows = sizing.max_num_seqs if rank == 0 else 0
    none_left = ValueError("another tensor-parallel rank has no memory left for KV blocks")
    return agree_min(everywhere(lambda: int(profile(sizing, rows)), group, none_left), group)
