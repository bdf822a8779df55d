"""``ferryman serve``: the OpenAI-compatible HTTP server, every engine knob a flag; with ``--ray``,
``--data-parallel-size`` engines behind one endpoint on Ray Serve (Ray is imported only then)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ferryman.engine_args import DEFAULT_MODEL, EngineArgs, add_cli_args, from_cli

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def _port(text: str) -> int:
    """A TCP port; 0 asks the OS for a free one (70000 listened on 70000 - 65536 while saying 70000)."""
    n = int(text)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {n}")
    return n


def _origins(words: list[str]) -> list[str]:
    """``--allowed-origins`` as words, or as vLLM's one JSON list (``'["https://a.example"]'``)."""
    out: list[str] = []
    for w in words:
        items = json.loads(w) if w.lstrip().startswith("[") else [w]
        if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
            raise ValueError(f"--allowed-origins: {w!r} is not a JSON list of origins")
        out += items
    return out


def _vllm_spellings(p: argparse.ArgumentParser) -> None:
    """Flags of ``vllm serve`` command lines, accepted with the same meaning."""
    v = p.add_argument_group("vLLM's spellings")
    v.add_argument("model_tag", nargs="?", default=None, help="the model, as `vllm serve MODEL` (or --model)")
    for knob in ("prefix_caching", "chunked_prefill"):
        flag, dest = knob.replace("_", "-"), f"enable_{knob}"
        on, off = f"--enable-{flag}", f"--no-enable-{flag}"
        v.add_argument(on, dest=dest, action="store_true", default=argparse.SUPPRESS, help="on (the default)")
        v.add_argument(off, dest=dest, action="store_false", default=argparse.SUPPRESS, help=f"--no-{flag}")
    v.add_argument(
        "--enable-auto-tool-choice", action="store_true", help="accepted: tool calls are always read"
    )
    v.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        help="accepted when it names the format the model's chat template uses (picked from it)",
    )
    for flag in ("--disable-log-requests", "--disable-log-stats"):
        v.add_argument(flag, action="store_true", help="accepted: ferryman logs no requests or stats")


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_cli_args(p.add_argument_group("engine"), EngineArgs)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000)")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the names clients may ask for; answers carry the first (default: --model)",
    )
    s.add_argument("--max-waiting", type=int, default=None, help="answer 503 once this many requests wait")
    s.add_argument("--trace", default=None, help="write one JSON line per step and preemption to this file")
    s.add_argument(
        "--log-level", "--uvicorn-log-level", default="info", choices=LOG_LEVELS, help="uvicorn's log level"
    )
    s.add_argument(
        "--allowed-origins",
        nargs="*",
        default=["*"],
        metavar="ORIGIN",
        help="origins a browser may call the API from (CORS; words, or vLLM's JSON list; default: *, "
        "every origin, so any web page may call this server; none given: no CORS headers)",
    )
    s.add_argument(
        "--chat-template",
        default=None,
        help="a chat template file, or the template itself, in place of the model's (vLLM's flag)",
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("FERRYMAN_API_KEY") or os.environ.get("VLLM_API_KEY"),
        help="every /v1 route needs 'Authorization: Bearer KEY' (default: $FERRYMAN_API_KEY, else "
        "$VLLM_API_KEY, else none: open)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds the running requests may take to finish before they are aborted "
        "(default: 30)",
    )
    r = p.add_argument_group("data parallelism (Ray Serve)")
    r.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas behind the one endpoint, each with its own model and KV pool (needs --ray)",
    )
    r.add_argument(
        "--ray",
        action="store_true",
        help="serve through Ray Serve: each replica a Ray actor, each request routed by Serve's router "
        "(needs ray[serve])",
    )
    r.add_argument(
        "--routing",
        choices=("load", "prefix"),
        default="load",
        help="how Serve picks a replica (with --ray): load (power of two choices, the default) or "
        "prefix (Serve's prefix-aware router reads each prompt; one more hop per response message)",
    )
    r.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster to join (default: $RAY_ADDRESS, else a cluster `ray start` began on this "
        "machine, else a local one started here and stopped on exit)",
    )
    _vllm_spellings(p)
    p.set_defaults(run=run)


def _error(msg: str) -> int:
    print(f"ferryman serve: error: {msg}", file=sys.stderr)
    return 2


def run(a: argparse.Namespace) -> int:
    if a.model_tag is not None:
        if a.model not in (DEFAULT_MODEL, a.model_tag):
            return _error(f"two models given: {a.model_tag!r} and --model {a.model!r}")
        a.model = a.model_tag
    try:
        a.allowed_origins = _origins(a.allowed_origins)
    except ValueError as e:
        return _error(str(e))
    if a.data_parallel_size < 1:
        return _error("--data-parallel-size must be >= 1")
    if a.ray:
        return _run_ray(a)
    if a.data_parallel_size > 1:
        return _error("--data-parallel-size > 1 needs --ray")
    if a.routing != "load":
        return _error("--routing prefix needs --ray")
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
        allowed_origins=a.allowed_origins,
        api_key=a.api_key,
        tool_call_parser=a.tool_call_parser,
        chat_template=a.chat_template,
    )


def _run_ray(a: argparse.Namespace) -> int:
    if a.trace is not None:
        return _error("--trace is not supported with --ray")
    if a.served_model_name is not None and len(a.served_model_name) > 1:
        return _error("several --served-model-name are not supported with --ray")
    a.served_model_name = a.served_model_name and a.served_model_name[0]
    if a.api_key is not None or a.tool_call_parser is not None or a.chat_template is not None:
        return _error("--api-key, --tool-call-parser and --chat-template are not supported with --ray")
    if a.allowed_origins != ["*"]:
        return _error("--allowed-origins is not supported with --ray (replicas allow *)")
    try:
        from ferryman.server.ray_serve import serve_replicas
    except ImportError as e:
        return _error(f"--ray needs ray[serve] ({e})")
    return serve_replicas(
        from_cli(EngineArgs, a),
        num_replicas=a.data_parallel_size,
        host=a.host,
        port=a.port,
        served_model_name=a.served_model_name,
        max_waiting=a.max_waiting,
        shutdown_timeout=a.shutdown_timeout,
        ray_address=a.ray_address,
        routing=a.routing,
    )
