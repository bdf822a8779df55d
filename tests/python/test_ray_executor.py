"""The ``ray`` executor backend of tensor parallelism (``worker/ray_ranks.py``): on a local Ray
cluster (2 CPUs), rank 1 of a 2-rank engine runs as a Ray actor in a placement group. It gives
one rank's greedy tokens under forced preemption (swap), frees its actor and placement group on
shutdown, and a rank actor killed with ``ray.kill`` leaves the engine dead, never hung."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tiny_models import build

from ferryman.engine import Engine, EngineDeadError
from ferryman.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="ray is not installed (pip install 'ray[serve]'); distributed_executor_backend='ray' needs it",
)

PROMPTS = [[5, 9, 5, 9, 5, 1, 2], [17, 3, 3, 3, 8, 1], [40, 41], [7, 7, 7, 7, 7, 7, 7, 8, 9, 10, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("ray_tp"))


def tokens(eng: Engine) -> list[list[int]]:
    return [o.token_ids for r in eng.generate(PROMPTS, GREEDY) for o in r.outputs]


def test_ray_ranks_give_one_ranks_tokens_and_leave_nothing_behind(ray_cluster: Any, model_dir: Path) -> None:
    want = tokens(Engine(str(model_dir), calibrate=False, block_size=4))
    tight = {"num_device_blocks": 14, "num_host_blocks": 64, "max_num_batched_tokens": 16}
    eng = Engine(
        str(model_dir),
        calibrate=False,
        block_size=4,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        preemption_mode="swap",
        **tight,
    )
    workers = eng.runner.workers
    try:
        assert len(workers.actors) == 1 and workers.dead() == []
        assert tokens(eng) == want
        assert eng.stats()["num_preemptions"] > 0
    finally:
        eng.shutdown()
    assert workers.dead() == ["rank 1 (a Ray actor)"]  # its worker_main returned after the last plan
    group = ray_cluster.util.placement_group_table(workers.group)
    assert group["state"] == "REMOVED"


def test_a_killed_rank_actor_kills_the_engine_not_hangs_it(ray_cluster: Any, model_dir: Path) -> None:
    eng = Engine(str(model_dir), calibrate=False, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        eng.step()
        ray_cluster.kill(eng.runner.workers.actors[0])
        with pytest.raises(EngineDeadError, match="tensor-parallel rank failed"):
            while eng.has_unfinished_requests():
                eng.step()
        with pytest.raises(EngineDeadError):
            eng.step()
        assert eng.runner.workers.dead() == ["rank 1 (a Ray actor)"]
    finally:
        eng.shutdown()
