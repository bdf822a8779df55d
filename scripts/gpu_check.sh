#!/usr/bin/env bash
# Run THERE (a GPU machine, through the device tool with `carry: [".whl"]`), after
# scripts/gpu_wheels.sh here. Installs the carried wheels, runs tests/gpu (FlashInfer vs the torch
# reference; greedy parity under forced preemption in every mode; overlap on/off parity), then
# benchmarks/gpu_ceilings.py (copy bandwidth, cuBLAS on the model's projections),
# benchmarks/gpu_bench.py, benchmarks/gpu_profile.py and benchmarks/gpu_overlap.py (device idle
# between decode steps, async scheduling on and off), and prints one JSON summary (also written to $OUT/gpu.json when OUT is
# set, with every stage's own output in $OUT/gpu_logs.tgz). Budget: DEADLINE_S (default 490; device
# tool timeout 540): each stage gets what is left of it, keeping room for the ones after it.
# FI_AOT_OUT=dir saves FlashInfer's compiled kernels there (split in 15 MB parts, if under 45 MB);
# FI_AOT_IN=dir loads such parts, so a fresh machine skips compiling them.
# Stages run in this order: tests, overlap, ceilings, bench, profile.
# STAGES (default all five) runs a subset, e.g. STAGES=tests in one device
# call and STAGES="bench profile overlap" in the next (FlashInfer's JIT cache stays on a warm
# machine); a stage not run reports rc -1.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site MAX_JOBS=16
# FlashInfer's kernels compiled by an earlier call (FI_AOT_OUT there): loaded as its AOT modules
if [ -n "${FI_AOT_IN:-}" ] && compgen -G "$FI_AOT_IN/fi_aot.tgz.*" > /dev/null; then
  mkdir -p /tmp/site/flashinfer/data/aot && cat "$FI_AOT_IN"/fi_aot.tgz.* | tar xz -C /tmp/site/flashinfer/data/aot \
    && echo "FlashInfer AOT modules: $(ls /tmp/site/flashinfer/data/aot | wc -l)"
fi
LOG=/tmp/gpu_logs  # each stage's output; packed into $OUT/gpu_logs.tgz at the end
rm -rf "$LOG" && mkdir -p "$LOG"
nvcc --version | tail -1 || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import ferryman, flashinfer, torch; print('ferryman', ferryman.__version__, 'flashinfer', flashinfer.__version__, 'torch', torch.__version__)"
start=$(date +%s)
deadline=$(( start + ${DEADLINE_S:-490} ))
left() { local l=$(( deadline - $(date +%s) - $1 )); (( l > $2 )) && echo "$l" || echo "$2"; }
STAGES=${STAGES:-tests ceilings bench profile overlap}
rm -f /tmp/gpu_ceilings.json /tmp/gpu_bench.json /tmp/gpu_profile.json /tmp/gpu_overlap.json  # no figures of an earlier call
want() { [[ " $STAGES " == *" $1 "* ]]; }
for s in $STAGES; do  # a typo would otherwise run nothing and pass
  case $s in tests|ceilings|bench|profile|overlap) ;; *) echo "unknown stage '$s' in STAGES"; exit 2 ;; esac
done
tests_rc=-1 ceilings_rc=-1 bench_rc=-1 profile_rc=-1 overlap_rc=-1
: > "$LOG/gpu_tests.log"
if want tests; then
# the first test JIT-compiles FlashInfer's kernels (minutes on a bare machine; none with FI_AOT_IN);
# 222 s in all on 2026-11-30, with fewer tests than now; keeps 150 s for the stages after it
t=$(left 150 120); t=$(( t < 340 ? t : 340 ))
timeout "$t" python3 -m pytest -q -p no:cacheprovider -o addopts="" -W default -s --durations=0 tests/gpu 2>&1 \
  | tee "$LOG/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
echo "tests done after $(( $(date +%s) - start )) s"
fi
if want overlap; then
echo "gpu_overlap.py (timeout 90 s)"
(cd benchmarks && timeout 90 python3 gpu_overlap.py) > /tmp/gpu_overlap.json 2> "$LOG/gpu_overlap.err"
overlap_rc=$?
cp /tmp/gpu_overlap.json "$LOG/gpu_overlap.json" 2>/dev/null || true
tail -5 "$LOG/gpu_overlap.err"
echo "overlap done after $(( $(date +%s) - start )) s"
fi
if want ceilings; then
echo "gpu_ceilings.py (timeout 45 s; the report is saved after each shape)"
timeout 45 python3 benchmarks/gpu_ceilings.py --out /tmp/gpu_ceilings.json > /dev/null 2> "$LOG/gpu_ceilings.err"
ceilings_rc=$?
tail -5 "$LOG/gpu_ceilings.err"
echo "ceilings done after $(( $(date +%s) - start )) s"
fi
if want bench; then
t=$(left 50 60); t=$(( t < 240 ? t : 240 ))  # keep 50 s for the profile
echo "gpu_bench.py (timeout ${t} s; the report is saved after each section)"
timeout "$t" python3 benchmarks/gpu_bench.py --out /tmp/gpu_bench.json > /dev/null 2> "$LOG/gpu_bench.err"
bench_rc=$?
cp /tmp/gpu_bench.json "$LOG/gpu_bench.json" 2>/dev/null || true
tail -20 "$LOG/gpu_bench.err"
echo "bench done after $(( $(date +%s) - start )) s"
fi
if want profile; then
t=$(left 0 45); t=$(( t < 120 ? t : 120 ))
echo "gpu_profile.py (timeout ${t} s)"
timeout "$t" python3 benchmarks/gpu_profile.py > /tmp/gpu_profile.json 2> "$LOG/gpu_profile.err"
profile_rc=$?
cp /tmp/gpu_profile.json "$LOG/gpu_profile.json" 2>/dev/null || true
tail -20 "$LOG/gpu_profile.err"
echo "profile done after $(( $(date +%s) - start )) s"
fi
python3 - "$tests_rc" "$bench_rc" "$start" "$profile_rc" "$overlap_rc" "$ceilings_rc" <<'PY'
import json, os, sys, time
tests_rc, bench_rc, start, profile_rc, overlap_rc, ceilings_rc = (int(a) for a in sys.argv[1:7])
tail = open("/tmp/gpu_logs/gpu_tests.log").read().strip().splitlines()[-1:] or ["not run"]
try:
    ceilings = json.load(open("/tmp/gpu_ceilings.json"))
except Exception as e:
    ceilings = {"error": repr(e)}
try:
    bench = json.load(open("/tmp/gpu_bench.json"))
except Exception as e:
    bench = {"error": repr(e)}
try:
    profile = json.load(open("/tmp/gpu_profile.json"))
except Exception as e:
    profile = {"error": repr(e)}
try:
    # one JSON line after the sync and async runs, another with the in-graph LM head: the last
    overlap = json.loads(open("/tmp/gpu_overlap.json").read().strip().splitlines()[-1])
except Exception as e:
    overlap = {"error": repr(e)}
summary = {"tests_rc": tests_rc, "tests": tail, "ceilings_rc": ceilings_rc, "ceilings": ceilings, "bench_rc": bench_rc, "bench": bench,
           "profile_rc": profile_rc, "profile": profile, "overlap_rc": overlap_rc, "overlap": overlap,
           "seconds": int(time.time()) - start}
print(json.dumps(summary))
if os.environ.get("OUT"):
    open(os.path.join(os.environ["OUT"], "gpu.json"), "w").write(json.dumps(summary, indent=1))
PY
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/gpu_logs.tgz" -C "$LOG" .
  # FlashInfer's compiled kernels, for FI_AOT_IN of a later call (a fresh machine compiles them again)
  if [ -n "${FI_AOT_OUT:-}" ]; then
    (cd "$HOME"/.cache/flashinfer/*/*/cached_ops 2>/dev/null && tar cz ./*/*.so) > /tmp/fi_aot.tgz
    size=$(stat -c %s /tmp/fi_aot.tgz)
    echo "FlashInfer's compiled kernels: $size bytes compressed"
    (( size < 45000000 )) && split -b 15M /tmp/fi_aot.tgz "$FI_AOT_OUT/fi_aot.tgz."
  fi
fi
# a stage not run (-1) does not fail the check
exit $(( (tests_rc > 0) || (ceilings_rc > 0) || (bench_rc > 0) || (profile_rc > 0) || (overlap_rc > 0) ))
