"""``ferryman serve``: builds the Engine from the CLI flags and runs the app under uvicorn."""

from __future__ import annotations

import argparse
import sys

from ferryman.engine import Engine
from ferryman.server.app import build_app
from ferryman.server.async_engine import AsyncEngine
from ferryman.server.metrics import Metrics
from ferryman.trace import TraceWriter


def serve(a: argparse.Namespace) -> int:
    import uvicorn

    from ferryman.cli import engine_kwargs

    if a.max_waiting is not None and a.max_waiting < 1:
        print("--max-waiting must be >= 1", file=sys.stderr)
        return 2
    engine = Engine(a.model, **engine_kwargs(a))
    name = a.served_model_name or a.model
    metrics = Metrics(engine.scheduler.config, name)
    trace = TraceWriter(a.trace) if a.trace else None
    app = build_app(AsyncEngine(engine, metrics=metrics, trace=trace, max_waiting=a.max_waiting), name)
    print(
        f"ferryman: serving {name!r} on http://{a.host}:{a.port} "
        f"({engine.scheduler.config.num_device_blocks} device KV blocks, "
        f"{engine.scheduler.config.num_host_blocks} host, mode {engine.scheduler.config.preemption_mode})",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=5)
    return 0
