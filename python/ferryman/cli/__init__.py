"""The ``ferryman`` command: ``serve``, ``generate``, ``chat``, ``bench throughput``, ``bench serve``,
``sim`` and ``plot``, one module per command. Each module's ``register`` adds its sub-parser and
sets ``run``, the function that takes the parsed flags and returns the exit status. Engine knobs
are flags generated from ``EngineArgs`` (``ferryman.engine_args``); nothing outside this package
imports it, so the command modules may import anything else."""

from __future__ import annotations

import argparse
import sys

from ferryman.cli import bench, generate, plot, serve, sim


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferryman", description="ferryman LLM serving engine")
    sub = p.add_subparsers(dest="cmd")
    for command in (serve, generate, bench, sim, plot):
        command.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a, extra = p.parse_known_args(argv)
    if extra:  # said before a missing command, so `ferryman --bogus` names --bogus
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if a.cmd is None:
        p.error("a command is required: serve, generate, chat, bench, sim or plot")
    try:
        status: int = a.run(a)
    except ValueError as e:  # bad input (sampling values, a grammar, a model path): said, not a traceback
        print(f"ferryman {a.cmd}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file to read or write that cannot be (a trace, a workload, a plot)
        print(f"ferryman {a.cmd}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what ran was aborted on the way out; no traceback
        print(f"\nferryman {a.cmd}: interrupted", file=sys.stderr)
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
