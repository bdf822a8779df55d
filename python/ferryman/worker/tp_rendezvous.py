"""How tensor-parallel ranks meet: a TCP store that rank 0 hosts, then the process group over it.

Rank 0 waits up to ``RENDEZVOUS_TIMEOUT_S`` for every worker to report in (a rank starting on a
loaded machine, importing torch, is late, not dead), but not for one that has already stopped:
it polls the workers while it waits and fails within a fraction of a second of one exiting (a
script without an ``if __name__ == "__main__":`` guard, an import error, a bad slice), naming
it, instead of waiting out the timeout. Workers join the store, report, then the group."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ferryman.worker.tp_devices import backend_of, rank_device

RENDEZVOUS_TIMEOUT_S = 300.0  # how long ranks wait for each other to start
JOINED = "ferryman/joined"  # the store's count of workers that reached it


class RankFailedError(RuntimeError):
    """A tensor-parallel rank stopped, or the ranks are out of step: the engine cannot go on."""


def free_port() -> int:
    """A free TCP port on this host (for rank 0's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_rank(spec: Any, rank: int, dead: Callable[[], list[str]] | None = None) -> Any:
    """Joins the group (the forward's collectives time out after ``spec.timeout_s``) and returns
    the plans' group, whose broadcasts wait as long as the engine idles. ``dead`` (rank 0): the
    workers that have stopped, polled while waiting for them. On CUDA the rank's device becomes
    current first (NCCL binds a rank to it)."""
    device = rank_device(spec.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host, port = spec.init_method.removeprefix("tcp://").rsplit(":", 1)
    wait = max(RENDEZVOUS_TIMEOUT_S, spec.timeout_s)
    store = dist.TCPStore(  # type: ignore[attr-defined]  # re-exported by torch.distributed
        host,
        int(port),
        spec.world,
        is_master=rank == 0,
        timeout=timedelta(seconds=wait),
        wait_for_workers=False,
    )
    if rank == 0:
        _await_workers(store, spec.world - 1, dead or list, time.monotonic() + wait)
    else:
        store.add(JOINED, 1)
    dist.init_process_group(
        backend_of(spec.device),
        store=store,
        rank=rank,
        world_size=spec.world,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    return dist.new_group(list(range(spec.world)), timeout=timedelta(days=365), backend="gloo")


def _await_workers(store: Any, n: int, dead: Callable[[], list[str]], deadline: float) -> None:
    while (joined := int(store.add(JOINED, 0))) < n:
        stopped = dead()
        if stopped:
            said = f"a tensor-parallel worker stopped before joining ({', '.join(stopped)})"
            if any(name.startswith("pid ") for name in stopped):  # the mp backend's spawned processes
                said += (
                    '; a script that starts a tensor-parallel engine needs an `if __name__ == "__main__":`'
                )
                said += " guard, since each spawned worker imports it again"
            raise RankFailedError(said)
        if time.monotonic() > deadline:
            raise RankFailedError(
                f"{joined} of {n} tensor-parallel workers joined within the rendezvous' wait"
            )
        time.sleep(0.05)
