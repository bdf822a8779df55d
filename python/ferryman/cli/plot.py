"""``ferryman plot``: draws a ``--trace`` file (KV use, token budget, queues, preemptions)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("plot", help="draw a --trace file: KV use, token budget, queues, preemptions")
    p.add_argument("trace", help="a JSON-lines trace written by `serve --trace` or `sim --trace`")
    p.add_argument("-o", "--out", default="trace.png", help="the PNG to write (default: trace.png)")
    p.set_defaults(run=run)


def run(a: argparse.Namespace) -> int:
    from ferryman.plot import plot_trace

    print(plot_trace(a.trace, a.out))
    return 0
