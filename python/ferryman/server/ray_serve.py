"""Data-parallel replicas on Ray Serve: N ferryman engines behind one OpenAI-compatible endpoint.

Each replica of the Serve deployment (a Ray actor) owns one ``Engine``, its ``AsyncEngine``
thread and the app ``ferryman serve`` runs (``build_app``), mounted as the deployment's ASGI
ingress, so every route, error body, stream and disconnect rule is the single-server one. Ray
Serve's HTTP proxy takes the requests and its default request router picks a replica for each:
power of two choices (two random replicas, the one with fewer requests in flight). Serve's
prefix-aware router (``PrefixCacheAffinityRouter``) reads the prompt from the arguments of a
deployment-handle call; an HTTP request reaches the router as opaque ASGI bytes, so it cannot
apply here.

Invariants: every response carries ``x-ferryman-replica``, the Serve replica's id; a replica
whose engine died answers 503 and fails Serve's health check, so Serve replaces it; a client
that disconnects has its replica's handler cancelled, which aborts its request.

Ray is imported here only, and nothing in ferryman imports this module unless asked to (``ferryman
serve --ray``, or ``build_application`` from Python), so ferryman runs without Ray installed.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ray import serve

from ferryman.engine import Engine
from ferryman.engine_args import EngineArgs
from ferryman.engine_setup import resolve_device
from ferryman.server.app import build_app
from ferryman.server.async_engine import AsyncEngine
from ferryman.server.metrics import Metrics

REPLICA_HEADER = "x-ferryman-replica"
DEFAULT_NAME = "ferryman"
HEALTH_CHECK_PERIOD_S = 2.0  # Serve replaces a replica after a few failed checks in a row

_Scope = MutableMapping[str, Any]
_Message = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[_Message]]
_Send = Callable[[_Message], Awaitable[None]]


class _ReplicaHeader:
    """ASGI middleware: adds ``x-ferryman-replica`` to every HTTP response."""

    def __init__(self, app: Callable[[_Scope, _Receive, _Send], Awaitable[None]], replica: str) -> None:
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: _Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.value)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, tagged)


class FerrymanReplica:
    """One replica: an engine built from ``args`` and the OpenAI routes over it."""

    def __init__(self, args: EngineArgs, served_model_name: str, max_waiting: int | None) -> None:
        engine = Engine.from_engine_args(args)
        metrics = Metrics(engine.scheduler.config, served_model_name)
        self.engine = AsyncEngine(engine, metrics=metrics, max_waiting=max_waiting)
        self.served_model_name = served_model_name
        self.replica: str = serve.get_replica_context().replica_tag

    def __serve_build_asgi_app__(self) -> Any:
        app = build_app(self.engine, self.served_model_name)  # its lifespan starts the engine thread
        app.add_middleware(_ReplicaHeader, replica=self.replica)
        return app

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy (it is replaced)."""
        if self.engine.error is not None:
            raise RuntimeError(f"the engine died: {self.engine.error!r}")


def _cpus(args: EngineArgs) -> float:
    """A replica's CPUs: one per tensor-parallel rank in its own processes (``mp``); one with the
    ``ray`` backend, whose rank actors reserve their own."""
    return float(args.tensor_parallel_size if args.distributed_executor_backend == "mp" else 1)


def build_application(
    args: EngineArgs,
    *,
    num_replicas: int = 2,
    served_model_name: str | None = None,
    max_waiting: int | None = None,
    max_ongoing_requests: int | None = None,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    shutdown_timeout: float = 30.0,
) -> Any:
    """The Serve application (``serve.run(build_application(EngineArgs(model=...)))``):
    ``num_replicas`` engines built from ``args``. ``max_ongoing_requests`` caps the requests one
    replica holds (default: ``args.max_num_seqs``; more wait in Serve's queue for the first free
    replica); ``num_cpus`` (default: ``_cpus``) and ``num_gpus`` (default: 1 when
    ``args.device`` resolves to CUDA, ``auto`` included on a machine with one, else 0) are each
    replica's Ray resources; ``shutdown_timeout`` is how long a stopping replica lets its
    requests finish."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if max_waiting is not None and max_waiting < 1:
        raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
    if num_gpus is None:  # "auto" resolves here as each replica will resolve it (CUDA if there is one)
        num_gpus = 1.0 if resolve_device(args.device).type == "cuda" else 0.0
    deployment = serve.deployment(
        serve.ingress()(FerrymanReplica),
        name=DEFAULT_NAME,
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests or args.max_num_seqs,
        ray_actor_options={"num_cpus": num_cpus or _cpus(args), "num_gpus": num_gpus},
        graceful_shutdown_timeout_s=shutdown_timeout,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    )
    return deployment.bind(args, served_model_name or args.model, max_waiting)


def serve_replicas(
    args: EngineArgs,
    *,
    num_replicas: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    max_waiting: int | None = None,
    shutdown_timeout: float = 30.0,
    ray_address: str | None = None,
) -> int:
    """``ferryman serve --ray``: joins the Ray cluster at ``ray_address`` (default: Ray's rule:
    $RAY_ADDRESS, else a cluster ``ray start`` began on this machine, else a new local one), runs
    the application under Serve on ``host:port`` until SIGTERM or SIGINT, then shuts Serve down
    (each replica lets its requests finish for up to ``shutdown_timeout`` seconds). Exit status 0,
    or 1 if the application failed to deploy."""
    import ray

    app = build_application(
        args,
        num_replicas=num_replicas,
        served_model_name=served_model_name,
        max_waiting=max_waiting,
        shutdown_timeout=shutdown_timeout,
    )
    ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
    stop = threading.Event()
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(app, name=DEFAULT_NAME, route_prefix="/")
        except Exception as e:  # a replica that cannot build its engine fails the deployment
            print(f"ferryman: the Ray Serve application failed to deploy: {e}", file=sys.stderr, flush=True)
            return 1
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        print(
            f"ferryman: serving {served_model_name or args.model!r} on http://{host}:{port} "
            f"({num_replicas} Ray Serve replicas)",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(1.0):
            pass
        print("ferryman: shutting the replicas down", file=sys.stderr, flush=True)
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()
