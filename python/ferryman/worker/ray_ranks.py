"""The ``ray`` executor backend of tensor parallelism (``distributed_executor_backend="ray"``):
ranks 1..N-1 as Ray actors, one per bundle of a placement group (one CPU each, packed onto as few
nodes as hold them), each running ``worker_main`` from ``worker/tp_workers.py``: the same gloo
group, rendezvous at rank 0's node address, and the same per-step plans as the ``mp`` backend.

The engine joins the Ray cluster already initialised in its process, else the one Ray's rule
finds (``$RAY_ADDRESS``, a cluster ``ray start`` began on this machine), else starts a local one.
A worker is dead once its ``worker_main`` call has returned or failed (an actor killed with
``ray.kill`` included); the next step's collective then fails and the engine reports itself
dead, as with a killed process. ``kill`` removes the actors and the placement group. Ray is
imported here only, and only this backend imports this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ferryman.worker.tp_workers import RankSpec, worker_main

PLACEMENT_TIMEOUT_S = 120.0


class _Rank:
    """A Ray actor holding one worker rank."""

    def run(self, rank: int, spec: RankSpec) -> None:
        worker_main(rank, spec)


class RayWorkers:
    """Ranks 1..N-1 as actors in a placement group (``Workers`` of ``tp_workers``)."""

    def __init__(self, spec: RankSpec) -> None:
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=True)
        n = spec.world - 1
        self.group = placement_group([{"CPU": 1.0}] * n, strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.group)
            raise RuntimeError(
                f"the Ray cluster could not place {n} tensor-parallel rank(s) of 1 CPU each within "
                f"{PLACEMENT_TIMEOUT_S:g} s (its resources: {ray.cluster_resources()})"
            )
        # rank 0 hosts the rendezvous: at an address the other nodes reach, not loopback
        port = spec.init_method.rsplit(":", 1)[1]
        spec = dataclasses.replace(spec, init_method=f"tcp://{ray.util.get_node_ip_address()}:{port}")
        self.spec = spec
        self.actors: list[Any] = []
        try:  # the group's bundles and any actor made are given back if a later call raises
            actor = ray.remote(num_cpus=1)(_Rank)
            for i in range(n):
                bundle = {"placement_group": self.group, "placement_group_bundle_index": i}
                strategy = PlacementGroupSchedulingStrategy(**bundle)
                self.actors.append(actor.options(scheduling_strategy=strategy).remote())
            self.calls = [a.run.remote(i + 1, spec) for i, a in enumerate(self.actors)]
        except BaseException:
            self.kill()
            raise

    def dead(self) -> list[str]:
        done, _ = ray.wait(self.calls, num_returns=len(self.calls), timeout=0)
        return [f"rank {self.calls.index(ref) + 1} (a Ray actor)" for ref in done]

    def join(self, timeout: float) -> None:
        ray.wait(self.calls, num_returns=len(self.calls), timeout=timeout)

    def kill(self) -> None:
        if not ray.is_initialized():  # Ray already shut down took its actors with it
            return
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.group)
