#!/usr/bin/env bash
# Run THERE (a GPU machine, through the device tool with `carry: [".whl"]`), after
# scripts/gpu_wheels.sh here. Installs the carried wheels, runs tests/gpu (FlashInfer vs the torch
# reference; greedy parity under forced preemption in every mode), then benchmarks/gpu_bench.py,
# and prints one JSON summary (also written to $OUT/gpu.json when OUT is set). Budget: < 9 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site MAX_JOBS=16
LOG=${OUT:-/tmp}
nvcc --version | tail -1 || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import ferryman, flashinfer, torch; print('ferryman', ferryman.__version__, 'flashinfer', flashinfer.__version__, 'torch', torch.__version__)"
start=$(date +%s)
# the first test JIT-compiles FlashInfer's kernels (minutes on a bare machine)
timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -W default -s --durations=0 tests/gpu 2>&1 \
  | tee "$LOG/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
echo "tests done after $(( $(date +%s) - start )) s"
timeout 240 python3 benchmarks/gpu_bench.py > /tmp/gpu_bench.json 2> "$LOG/gpu_bench.err"
bench_rc=$?
tail -20 "$LOG/gpu_bench.err"
python3 - "$tests_rc" "$bench_rc" "$start" <<'PY'
import json, os, sys, time
tests_rc, bench_rc, start = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
tail = open(os.path.join(os.environ.get("OUT") or "/tmp", "gpu_tests.log")).read().strip().splitlines()[-1:]
try:
    bench = json.load(open("/tmp/gpu_bench.json"))
except Exception as e:
    bench = {"error": repr(e)}
summary = {"tests_rc": tests_rc, "tests": tail, "bench_rc": bench_rc, "bench": bench, "seconds": int(time.time()) - start}
print(json.dumps(summary))
if os.environ.get("OUT"):
    open(os.path.join(os.environ["OUT"], "gpu.json"), "w").write(json.dumps(summary, indent=1))
PY
exit $(( tests_rc != 0 || bench_rc != 0 ))
