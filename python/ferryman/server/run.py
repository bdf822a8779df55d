"""Running the server: builds the Engine from ``EngineArgs`` and serves the app under uvicorn."""

from __future__ import annotations

import sys

from ferryman.engine import Engine
from ferryman.engine_args import EngineArgs
from ferryman.server.app import build_app
from ferryman.server.async_engine import AsyncEngine
from ferryman.server.metrics import Metrics
from ferryman.trace import TraceWriter


def serve(
    args: EngineArgs,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    max_waiting: int | None = None,
    trace: str | None = None,
    log_level: str = "info",
) -> int:
    """Serves until interrupted; ``served_model_name`` defaults to ``args.model``,
    ``max_waiting`` (>= 1) bounds the waiting queue (503 beyond it), ``trace`` is a JSON-lines
    step trace file."""
    import uvicorn

    if max_waiting is not None and max_waiting < 1:
        print("--max-waiting must be >= 1", file=sys.stderr)
        return 2
    engine = Engine.from_engine_args(args)
    name = served_model_name or args.model
    cfg = engine.scheduler.config
    metrics = Metrics(cfg, name)
    writer = TraceWriter(trace) if trace else None
    app = build_app(AsyncEngine(engine, metrics=metrics, trace=writer, max_waiting=max_waiting), name)
    print(
        f"ferryman: serving {name!r} on http://{host}:{port} ({cfg.num_device_blocks} device KV blocks, "
        f"{cfg.num_host_blocks} host, mode {cfg.preemption_mode})",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    return 0
