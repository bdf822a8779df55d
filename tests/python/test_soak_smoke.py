"""``benchmarks/soak.py --smoke`` end to end (a real server, 120 requests, a tenth of them cancelled
mid-stream, a pool tight enough to preempt): no errors, both KV pools all free afterwards, some
preemption. RSS is not judged here: so few requests still meet padded row counts the CPU
projections have not run at yet, each of which builds its oneDNN primitives once
(``models/cpu_linear.py``); the soak's full 10,000-request run is where the 5% check means
something, so the tolerance is set out of the way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_soak_smoke_returns_every_block_and_fails_nothing() -> None:
    args = ["--smoke", "--requests", "120", "--rss-after", "60", "--rss-tolerance", "10"]
    args += ["--concurrency", "32"]
    r = subprocess.run([sys.executable, str(SOAK), *args], capture_output=True, text=True, timeout=240)
    assert r.stdout.strip(), r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and report["ok"], report
    assert report["errors"] == 0 and report["completed"] + report["cancelled"] == 120
    assert report["cancelled"] > 0
    assert report["device_blocks_free"] == report["device_blocks_total"] == 64
    assert report["host_blocks_free"] == report["host_blocks_total"] == 128
    assert sum(report["preemptions"].values()) > 0
    assert report["server_finished_by_reason"].get("abort", 0) >= 1
