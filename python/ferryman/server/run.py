"""Running the server: builds the Engine from ``EngineArgs`` and serves the app under uvicorn.

Shutdown (docs/faults.md): the first SIGTERM or SIGINT drains: new requests get 503 (and
``/health`` too), the running ones may finish for up to ``shutdown_timeout`` seconds, then the
rest are aborted (each open stream ends with finish_reason "abort" and ``[DONE]``) and the process
exits 0. A second signal stops at once. If the engine dies (``EngineDeadError``), the server stops
and the process exits 1, so a supervisor restarts it.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import uvicorn

from ferryman.engine import Engine
from ferryman.engine_args import EngineArgs
from ferryman.server.app import build_app
from ferryman.server.async_engine import AsyncEngine
from ferryman.server.metrics import Metrics
from ferryman.server.tools import pick_parser
from ferryman.trace import TraceWriter

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def serve(
    args: EngineArgs,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | Sequence[str] | None = None,
    max_waiting: int | None = None,
    trace: str | None = None,
    log_level: str = "info",
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    allowed_origins: Sequence[str] = ("*",),
    api_key: str | None = None,
    tool_call_parser: str | None = None,
    chat_template: str | None = None,
) -> int:
    """Serves until a signal (exit status 0 once drained) or the engine's death (1);
    ``served_model_name`` (one name, or several: requests may use any, answers carry the first)
    defaults to ``args.model``, ``max_waiting`` (>= 1) bounds the waiting
    queue (503 beyond it), ``trace`` is a JSON-lines step trace file, ``shutdown_timeout`` (>= 0)
    bounds the drain, ``allowed_origins`` are the origins browsers may call from (CORS), ``api_key``
    the bearer token ``/v1`` routes need; ``tool_call_parser``, if given, must be the format the
    model's chat template uses (``tools.pick_parser``); ``chat_template`` (a file, or the template
    itself, as vLLM's ``--chat-template``) replaces the model's."""

    def refuse(msg: str) -> int:
        print(f"ferryman serve: error: {msg}", file=sys.stderr)
        return 2

    if max_waiting is not None and max_waiting < 1:
        return refuse("--max-waiting must be >= 1")
    if not shutdown_timeout >= 0:  # NaN too: the drain's deadline never came
        return refuse(f"--shutdown-timeout must be >= 0, got {shutdown_timeout}")
    try:  # what needs no model first
        text = None if chat_template is None else template_text(chat_template)
        writer = TraceWriter(trace) if trace else None
    except (OSError, ValueError) as e:
        return refuse(str(e))
    engine = Engine.from_engine_args(args)
    if text is not None:
        if engine.tokenizer is None:
            return refuse("--chat-template: this model has no tokenizer")
        engine.tokenizer.chat_template = text
    template = getattr(engine.tokenizer, "chat_template", None)
    picked = pick_parser(template if isinstance(template, str) else None)  # as the chat route picks
    if tool_call_parser not in (None, picked):
        return refuse(
            f"--tool-call-parser {tool_call_parser}: this model's chat template calls tools as {picked}"
        )
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    name = names[0] if names else args.model
    cfg = engine.scheduler.config
    metrics = Metrics(cfg, name)
    died: list[BaseException] = []
    server: _DrainingServer | None = None

    def on_dead(e: BaseException) -> None:
        died.append(e)
        print(f"ferryman: the engine died, stopping: {e!r}", file=sys.stderr, flush=True)
        if server is not None:
            server.should_exit = True

    async_engine = AsyncEngine(
        engine, metrics=metrics, trace=writer, max_waiting=max_waiting, on_dead=on_dead
    )
    app = build_app(async_engine, name, allowed_origins, api_key, aliases=names[1:])
    print(
        f"ferryman: serving {name!r} on http://{host}:{port} ({cfg.num_device_blocks} device KV blocks, "
        f"{cfg.num_host_blocks} host, mode {cfg.preemption_mode})",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = _DrainingServer(config, async_engine, shutdown_timeout)
    server.run()
    return 1 if died else 0


def template_text(given: str) -> str:
    """``--chat-template``: the text of the file it names, else the template it is; a name that
    is no file and holds none of a template's ``{``, ``}`` or newlines is refused (vLLM's rule:
    a mistyped path served as the template dropped every message)."""
    path = Path(given)
    if len(given) < 4096 and "\n" not in given and path.is_file():
        return path.read_text()
    if not any(c in given for c in "{}\n"):
        raise ValueError(f"--chat-template {given!r}: no such file, and not a template")
    return given


class _DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM / SIGINT drains the engine before stopping (uvicorn's
    own handler stops at once, then re-raises the signal: the process ended with status -15)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.engine.draining or sig not in (signal.SIGTERM, signal.SIGINT):
            self.should_exit = self.force_exit = True  # a second signal: stop now
            return
        print(f"ferryman: draining (up to {self.shutdown_timeout:g} s)", file=sys.stderr, flush=True)
        self.engine.drain(self.shutdown_timeout, then=self._stop)

    def _stop(self) -> None:
        self.should_exit = True
