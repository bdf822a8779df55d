"""``ferryman serve``: the OpenAI-compatible HTTP server, every engine knob a flag."""

from __future__ import annotations

import argparse
from typing import Any

from ferryman.engine_args import EngineArgs, add_cli_args, from_cli


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_cli_args(p.add_argument_group("engine"), EngineArgs)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    s.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    s.add_argument("--max-waiting", type=int, default=None, help="answer 503 once this many requests wait")
    s.add_argument("--trace", default=None, help="write one JSON line per step and preemption to this file")
    s.add_argument("--log-level", default="info", help="uvicorn's log level (default: info)")
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds the running requests may take to finish before they are aborted "
        "(default: 30)",
    )
    p.set_defaults(run=run)


def run(a: argparse.Namespace) -> int:
    from ferryman.server.run import serve

    return serve(
        from_cli(EngineArgs, a),
        host=a.host,
        port=a.port,
        served_model_name=a.served_model_name,
        max_waiting=a.max_waiting,
        trace=a.trace,
        log_level=a.log_level,
        shutdown_timeout=a.shutdown_timeout,
    )
