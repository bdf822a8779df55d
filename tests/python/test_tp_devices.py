"""Where tensor-parallel ranks run and how their pools are sized (``worker/tp_devices.py``): the
device and backend of each rank, the engine's refusal of ranks it has no GPUs for, and the
start-up agreement on KV blocks over real gloo ranks (each rank's own count, the smallest wins;
a rank that finds no room makes every rank raise). The CUDA ranks themselves need several GPUs:
not run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny_models import build

from ferryman._core import InvalidRequestError
from ferryman.engine import Engine
from ferryman.worker.tp_devices import (
    KvSizing,
    backend_of,
    check_devices,
    everywhere,
    rank_device,
    rank_num_blocks,
)


def test_each_rank_has_its_own_gpu_and_the_backend_follows_the_device() -> None:
    assert [rank_device("cuda:1", r) for r in range(3)] == [torch.device("cuda", i) for i in (1, 2, 3)]
    assert rank_device("cuda", 2) == torch.device("cuda", 2)
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert (backend_of("cuda:1"), backend_of("cpu")) == ("nccl", "gloo")


def test_ranks_without_a_gpu_each_are_refused_before_loading(tmp_path: Path) -> None:
    path = build("llama", tmp_path / "m")
    visible = torch.cuda.device_count()  # 0 here, 1 on the GPU machine
    want = rf"needs GPUs 0\.\.{visible + 1}, one per rank; {visible} visible"
    with pytest.raises(InvalidRequestError, match=want):
        Engine(str(path), device="cuda", tensor_parallel_size=visible + 2, calibrate=False)
    with pytest.raises(InvalidRequestError, match="distributed_executor_backend='mp' only"):
        Engine(str(path), device="cuda", tensor_parallel_size=2, distributed_executor_backend="ray")
    assert check_devices(torch.device("cpu"), 4, "ray") is None
    assert "not meta" in (check_devices(torch.device("meta"), 2, "mp") or "")


SIZING = KvSizing(max_num_batched_tokens=64, bytes_per_block=1024, gpu_memory_utilization=0.9, max_num_seqs=8)


def _agree(rank: int, world: int, init: str, found: list[int | None], out: str) -> None:
    """One rank: its profile finds ``found[rank]`` blocks (None: no room, as profile_kv_blocks
    raises); writes what ``rank_num_blocks`` returned or raised, and the sampler rows it asked."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    asked: list[int] = []

    def profile(s: KvSizing, sampler_rows: int) -> int:
        assert s == SIZING
        asked.append(sampler_rows)
        n = found[rank]
        if n is None:
            raise ValueError("no memory left for KV blocks on this rank")
        return n

    try:
        got: object = rank_num_blocks(None, SIZING, rank, dist.new_group(backend="gloo"), profile)
    except ValueError as e:
        got = str(e)
    finally:
        dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps({"got": got, "asked": asked}))


def agreed(tmp_path: Path, found: list[int | None]) -> list[dict[str, object]]:
    out, init = str(tmp_path / "agreed"), f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_agree, args=(len(found), init, found, out), nprocs=len(found))
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(len(found))]


def test_every_rank_takes_the_smallest_count_any_rank_found(tmp_path: Path) -> None:
    got = agreed(tmp_path, [900, 640, 777])
    assert [g["got"] for g in got] == [640, 640, 640]
    assert [g["asked"] for g in got] == [[8], [0], [0]]  # only rank 0 samples


def test_a_rank_without_room_fails_every_rank_not_hangs_them(tmp_path: Path) -> None:
    got = agreed(tmp_path, [900, None])
    assert got[0]["got"] == "another tensor-parallel rank has no memory left for KV blocks"
    assert got[1]["got"] == "no memory left for KV blocks on this rank"


def _start(rank: int, world: int, init: str, failing: int, out: str) -> None:
    """One rank's start-up step: rank ``failing`` raises, the others return their rank."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)

    def step() -> int:
        if rank == failing:
            raise OSError("this rank's slice could not be read")
        return rank

    try:
        got: object = everywhere(step, dist.new_group(backend="gloo"))
    except (OSError, RuntimeError) as e:
        got = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps(got))


def test_a_rank_that_fails_to_start_fails_every_rank(tmp_path: Path) -> None:
    """What keeps rank 0 out of a collective (NCCL's set-up has no timeout) when a worker could
    not load its slice."""
    out, init = str(tmp_path / "started"), f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_start, args=(3, init, 2, out), nprocs=3)
    got = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(3)]
    other = "RuntimeError: another tensor-parallel rank failed while starting (its error is in its log)"
    assert got == [other, other, "OSError: this rank's slice could not be read"]
    mp.spawn(_start, args=(2, f"file://{tmp_path / 'rendezvous2'}", -1, out), nprocs=2)
    assert [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)] == [0, 1]


def test_a_given_count_is_taken_without_profiling() -> None:
    def never(s: KvSizing, rows: int) -> int:
        raise AssertionError("profiled although the count was given")

    assert rank_num_blocks(123, None, 1, None, never) == 123
    with pytest.raises(ValueError, match="needs a KvSizing"):
        rank_num_blocks(None, None, 0, None, never)
