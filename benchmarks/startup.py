"""Warm start-up of ``ferryman generate`` on the default model (SmolLM2, GGUF conversion cached):
each round runs ``python -m ferryman generate PROMPT --chat --stream --max-tokens 1
--no-calibrate`` as a fresh process and prints the time from its start to the first byte it
writes (the first token's text: the engine is built, the prompt prefilled and one token sampled)
and to its exit.

``--other DIR`` alternates, round by round, with the package found under ``DIR`` (put first on
``PYTHONPATH``), e.g. an older revision: ``git worktree add --detach /tmp/old REV`` and a copy of
the built ``_core.abi3.so`` in ``/tmp/old/python/ferryman``; then
``python benchmarks/startup.py --other /tmp/old/python``. One unmeasured run of each warms the
cache (and the page cache) first. The machine's other load shows in these figures: alternate,
repeat, and read the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from args import count

HERE = Path(__file__).resolve().parents[1] / "python"


def one_run(pythonpath: Path, prompt: str) -> tuple[float, float]:
    """Seconds to the first byte of output and to the exit of one ``generate``."""
    env = {**os.environ, "PYTHONPATH": f"{pythonpath}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "ferryman", "generate", prompt, "--chat", "--stream"]
    cmd += ["--max-tokens", "1", "--no-calibrate"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    to_first = time.perf_counter() - start
    _, err = proc.communicate()
    total = time.perf_counter() - start
    if proc.returncode != 0 or not first:
        raise SystemExit(f"generate failed ({proc.returncode}): {err.decode()[-2000:]}")
    return to_first, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=count, default=3)
    p.add_argument("--other", type=Path, default=None, help="another checkout's python/ folder")
    p.add_argument("--prompt", default="Write a haiku about rivers.")
    a = p.parse_args()
    trees = {"this": HERE} | ({"other": a.other.resolve()} if a.other else {})
    for path in trees.values():
        one_run(path, a.prompt)  # fills the conversion cache, warms the page cache
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    for r in range(a.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            first, total = one_run(trees[name], a.prompt)
            got[name].append((first, total))
            print(f"round {r + 1} {name:5s}: first token {first:6.2f} s, exit {total:6.2f} s", flush=True)
    for name, runs in got.items():
        med_first = statistics.median(f for f, _ in runs)
        med_total = statistics.median(t for _, t in runs)
        print(f"{name:5s} ({trees[name]}): median first token {med_first:.2f} s, exit {med_total:.2f} s")


if __name__ == "__main__":
    main()
