"""Data-parallel replicas on Ray Serve: N ferryman engines behind one OpenAI-compatible endpoint.

Each replica of the engine deployment (a Ray actor) owns one ``Engine``, its ``AsyncEngine``
thread and its own copy of the app ``ferryman serve`` runs (``build_app``), so every route,
error body, stream and disconnect rule is the single server's. How Serve picks a replica for a
request (``routing``):

- ``load`` (the default): the replicas are the HTTP ingress themselves, and Serve's default
  router picks one per request: power of two choices (two random replicas, the one with fewer
  requests in flight). One hop from Serve's proxy to the engine.
- ``prefix``: Serve's prefix-aware router (``PrefixCacheAffinityRouter``) picks from the prompt.
  It reads the arguments of a deployment-handle call, never an HTTP body, so an ingress of its
  own (no engine) hands each request to a replica through a handle (``server/ray_relay.py``):
  while the replicas' loads differ by at most ``PREFIX_IMBALANCE`` requests, a prompt goes to
  the replica that served the longest prefix of it (its prefix cache likely holds that KV), or,
  below a 10% match, to the replica that has seen the least text; past that difference, by load
  as above. Requests without a prompt (GETs) route by load alone. The price is a second hop for
  every response message (measured in docs/scale-out.md). Ray publishes the router as
  ``ray.serve.llm.request_router.PrefixCacheAffinityRouter``, but importing that name needs vLLM
  or SGLang; ferryman names the class's own module, which Ray marks internal (checked with Ray
  2.60).

Invariants: every response carries ``x-ferryman-replica``, the Serve replica's id; a replica
whose engine died answers 503 and fails Serve's health check, so Serve replaces it; a client
that disconnects has its replica's handler cancelled, which aborts its request.

Ray is imported here only, and nothing in ferryman imports this module unless asked to (``ferryman
serve --ray``, or ``build_application`` from Python), so ferryman runs without Ray installed.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from ferryman.engine import Engine
from ferryman.engine_args import EngineArgs
from ferryman.engine_setup import resolve_device
from ferryman.server.app import build_app
from ferryman.server.async_engine import AsyncEngine
from ferryman.server.metrics import Metrics
from ferryman.server.ray_relay import Forwarded, relay_app, run_asgi

REPLICA_HEADER = "x-ferryman-replica"
DEFAULT_NAME = "ferryman"
HEALTH_CHECK_PERIOD_S = 2.0  # Serve replaces a replica after a few failed checks in a row
PREFIX_ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
)
PREFIX_IMBALANCE = 4  # requests in flight by which two replicas may differ before load decides
ROUTINGS = ("load", "prefix")

_Scope = MutableMapping[str, Any]
_Message = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[_Message]]
_Send = Callable[[_Message], Awaitable[None]]


class _ReplicaHeader:
    """ASGI middleware: adds ``x-ferryman-replica`` to every HTTP response, and answers the
    lifespan events itself (the replica starts and stops its engine, whatever routes to it)."""

    def __init__(self, app: Callable[[_Scope, _Receive, _Send], Awaitable[None]], replica: str) -> None:
        self.inner, self.value = app, replica.encode()

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] == "lifespan":  # the replica starts and stops its engine itself
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return

        async def tagged(message: _Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.value)]
                message = {**message, "headers": headers}
            await send(message)

        await self.inner(scope, receive, tagged)


class FerrymanReplica:
    """One replica: an engine built from ``args`` and the OpenAI routes over it, which requests
    reach through ``forward`` (from the ingress)."""

    def __init__(self, args: EngineArgs, served_model_name: str, max_waiting: int | None) -> None:
        engine = Engine.from_engine_args(args)
        metrics = Metrics(engine.scheduler.config, served_model_name)
        self.engine = AsyncEngine(engine, metrics=metrics, max_waiting=max_waiting)
        # Serve's proxy puts x-request-id on every answer itself (the client's, else its own)
        self.openai_app = build_app(self.engine, served_model_name, request_ids=False)
        self.openai_app.add_middleware(_ReplicaHeader, replica=serve.get_replica_context().replica_tag)
        self.engine.start()  # what the app's lifespan does under a plain server

    async def forward(self, req: Forwarded) -> AsyncIterator[Any]:
        """The ASGI messages of ``req``'s response, as the app sends them (``routing="prefix"``)."""
        async with contextlib.aclosing(run_asgi(self.openai_app, req)) as messages:
            async for message in messages:
                yield message

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy (it is replaced)."""
        if self.engine.error is not None:
            raise RuntimeError(f"the engine died: {self.engine.error!r}")

    def __del__(self) -> None:  # Serve calls it once the replica's requests are done
        engine = getattr(self, "engine", None)  # None: __init__ failed before building it
        if engine is not None:
            engine.shutdown()


class FerrymanHttpReplica(FerrymanReplica):
    """A replica that is the HTTP ingress itself (``routing="load"``)."""

    def __serve_build_asgi_app__(self) -> Any:
        return self.openai_app


class FerrymanIngress:
    """The HTTP ingress of ``routing="prefix"``: every request goes on to a replica
    (``ray_relay``), by its prompt where it has one (positional: the prefix router reads it),
    else by load."""

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas.options(stream=True)

    def _call(self, req: Forwarded, by_prompt: bool) -> Any:
        return self.replicas.forward.remote(req) if by_prompt else self.replicas.forward.remote(req=req)

    def __serve_build_asgi_app__(self) -> Any:
        return relay_app(self._call)


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
    routing: str = "load",
) -> Any:
    """The Serve application (``serve.run(build_application(EngineArgs(model=...)))``):
    ``num_replicas`` engines built from ``args``. ``max_ongoing_requests`` caps the requests one
    replica holds (default: ``args.max_num_seqs``; more wait in Serve's queue for the first free
    replica); ``num_cpus`` (default: ``_cpus``) and ``num_gpus`` (default: 1 when
    ``args.device`` resolves to CUDA, ``auto`` included on a machine with one, else 0) are each
    replica's Ray resources; ``shutdown_timeout`` is how long a stopping replica lets its
    requests finish; ``routing`` is ``load`` or ``prefix`` (above)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if max_waiting is not None and max_waiting < 1:
        raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
    if num_gpus is None:  # "auto" resolves here as each replica will resolve it (CUDA if there is one)
        num_gpus = 1.0 if resolve_device(args.device).type == "cuda" else 0.0
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    per_replica = max_ongoing_requests or args.max_num_seqs
    options: dict[str, Any] = {
        "num_replicas": num_replicas,
        "max_ongoing_requests": per_replica,
        "ray_actor_options": {"num_cpus": num_cpus or _cpus(args), "num_gpus": num_gpus},
        "graceful_shutdown_timeout_s": shutdown_timeout,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
    }
    bound = (args, served_model_name or args.model, max_waiting)
    if routing == "load":
        http = serve.ingress()(FerrymanHttpReplica)
        return serve.deployment(http, name=DEFAULT_NAME, **options).bind(*bound)
    router = RequestRouterConfig(
        request_router_class=PREFIX_ROUTER,
        # the tree of prompts seen is trimmed every 10 s once past 400,000 characters
        request_router_kwargs={"imbalanced_threshold": PREFIX_IMBALANCE, "do_eviction": True},
    )
    engines = serve.deployment(FerrymanReplica, name=DEFAULT_NAME, request_router_config=router, **options)
    ingress = serve.deployment(
        serve.ingress()(FerrymanIngress),
        name=f"{DEFAULT_NAME}-ingress",
        num_replicas=1,
        # holds every request the replicas hold, and those Serve queues for them
        max_ongoing_requests=2 * num_replicas * per_replica,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=shutdown_timeout,
    )
    return ingress.bind(engines.bind(*bound))


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
    routing: str = "load",
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
        routing=routing,
    )
    ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
    stop, deployed = threading.Event(), threading.Event()

    def on_signal(*_: Any) -> None:
        stop.set()
        if not deployed.is_set():  # out of serve.run's wait (it may never end: no room for a replica)
            raise KeyboardInterrupt

    # from here, not once deployed: Serve's proxy answers while serve.run still waits, and Ray's
    # own handler aborts the driver, leaving the cluster's processes behind
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        try:
            serve.start(http_options={"host": host, "port": port})
            serve.run(app, name=DEFAULT_NAME, route_prefix="/")
            deployed.set()
        except KeyboardInterrupt:
            print("ferryman: stopped while deploying", file=sys.stderr, flush=True)
            return 0
        except Exception as e:  # a replica that cannot build its engine fails the deployment
            print(f"ferryman: the Ray Serve application failed to deploy: {e}", file=sys.stderr, flush=True)
            return 1
        print(
            f"ferryman: serving {served_model_name or args.model!r} on http://{host}:{port} "
            f"({num_replicas} Ray Serve replicas, routed by {routing})",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(1.0):
            pass
        print("ferryman: shutting the replicas down", file=sys.stderr, flush=True)
        # the application first, while Serve's proxy still carries the answers: each replica
        # finishes its requests (graceful_shutdown_timeout_s); serve.shutdown kills the proxy
        serve.delete(DEFAULT_NAME)
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()
