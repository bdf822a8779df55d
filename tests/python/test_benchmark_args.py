"""The benchmark scripts refuse input they cannot run with one line and exit status 2 (argparse's)
instead of a traceback halfway through: counts below 1, a trace that is empty, not JSON or holds
two requests with one id, a rate of 0, a GPU script without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("script", "args", "said"),
    [
        ("sched_overhead.py", ["--generate", "0"], "--generate: must be >= 1, got 0"),
        ("sched_overhead.py", ["--trace", "{empty}"], "a non-empty JSON list"),
        ("sched_overhead.py", ["--trace", "{dup}"], "two requests share an id"),
        ("sched_overhead.py", ["--trace", "{bad}"], "Expecting value"),
        ("block_table.py", ["--steps", "0"], "--steps: must be >= 1"),
        ("preemption_study.py", ["--num-requests", "1"], "--num-requests must be >= 2"),
        ("serve_matrix.py", ["--rates", "0"], "--rates must be > 0"),
        ("soak.py", ["--concurrency", "0"], "--concurrency: must be >= 1"),
        pytest.param(
            "gpu_ceilings.py",
            [],
            "needs a CUDA GPU (--smoke runs the same code on CPU)",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there: it would run"),
        ),
    ],
)
def test_a_script_refuses_what_it_cannot_run(tmp_path: Path, script: str, args: list[str], said: str) -> None:
    req = {"id": 0, "arrival_step": 0, "prompt_len": 4, "output_len": 2}
    files = {"empty": [], "dup": [req, req]}
    paths = {name: tmp_path / f"{name}.json" for name in (*files, "bad")}
    for name, rows in files.items():
        paths[name].write_text(json.dumps(rows))
    paths["bad"].write_text("not json")
    argv = [a.format(**{k: str(v) for k, v in paths.items()}) for a in args]
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, p.stderr
