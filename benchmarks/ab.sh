#!/usr/bin/env bash
# Side by side, alternating: the Rust core's overhead at git revision REV against the working tree.
# Each round runs, for REV and the working tree (REV first in odd rounds, second in even ones,
# so use an even ROUNDS), benchmarks/sched_overhead.py on one
# 1024-request trace (ample pool, then --pool-fraction 0.25) and the criterion benches; at the end
# it prints the median of each figure per side and their ratio (working tree / REV).
#
#   bash benchmarks/ab.sh REV [ROUNDS]        (after scripts/setup.sh has made the venv; ROUNDS=4)
#
# Builds REV in a temporary git worktree, each side in a cargo target folder of its own under the
# work folder (a shared one let cargo take one side's artifacts as the other's: the comparison ran
# the same build twice). Both sides run with this tree's benchmark scripts, so REV must offer the
# same Python API to sched_overhead.py.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:?usage: benchmarks/ab.sh REV [ROUNDS]}
ROUNDS=${2:-4}
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "ab.sh: ROUNDS must be a whole number >= 1, got '$ROUNDS'" >&2; exit 2; }
git rev-parse --verify -q "$REV^{commit}" >/dev/null || { echo "ab.sh: no such revision: $REV" >&2; exit 2; }
source scripts/setup.sh >/dev/null
WORK=$(mktemp -d /tmp/ferryman-ab.XXXXXX)
trap 'git worktree remove --force "$WORK/old" >/dev/null 2>&1 || true' EXIT
git worktree add --detach -q "$WORK/old" "$REV"

# each side: its own copy of python/ with its own extension, imported through PYTHONPATH
side() {  # side NAME TREE
  # a target folder per side: in a shared one cargo can take the other side's artifacts as fresh
  (cd "$2" && CARGO_TARGET_DIR="$WORK/target-$1" maturin build --release -q -o "$WORK/wheels-$1" >/dev/null 2>&1)
  cp -r "$2/python" "$WORK/py-$1"
  python - "$WORK/wheels-$1" "$WORK/py-$1/ferryman" <<'PY'
import glob, sys, zipfile
whl = max(glob.glob(sys.argv[1] + "/*.whl"))
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith("ferryman/_core") and n.endswith(".so"):
            open(sys.argv[2] + "/" + n.split("/")[-1], "wb").write(z.read(n))
PY
}
side old "$WORK/old"
side new .
python benchmarks/sched_overhead.py --generate 1024 --out "$WORK/trace.json"

results="$WORK/results.jsonl"
for round in $(seq "$ROUNDS"); do
  order="old new"
  [ $((round % 2)) = 0 ] && order="new old"  # alternate who goes first, so order cancels out
  for s in $order; do
    tree=$([ "$s" = old ] && echo "$WORK/old" || echo .)
    for pool in ample tight; do
      extra=$([ "$pool" = tight ] && echo "--pool-fraction 0.25" || true)
      # shellcheck disable=SC2086
      ns=$(PYTHONPATH="$WORK/py-$s" python benchmarks/sched_overhead.py --trace "$WORK/trace.json" $extra |
        python -c 'import json,sys; print(json.load(sys.stdin)["ns_per_output_token"])')
      echo "{\"side\": \"$s\", \"what\": \"sched_overhead $pool ns/token\", \"value\": $ns}" >>"$results"
    done
    (cd "$tree" && CARGO_TARGET_DIR="$WORK/target-$s" cargo bench -q -p ferryman-core --bench schedule_step -- --noplot 2>/dev/null) |
      python -c '
import json, re, sys
units = {"ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}
name = None
for line in sys.stdin:
    m = re.match(r"^(\S+)\s*(time:.*)?$", line.rstrip())
    if m and not line.startswith(" "):
        name = m.group(1)
    t = re.search(r"time:\s+\[\S+ \S+ (\S+) (\S+) \S+ \S+\]", line)
    if t and name:
        print(json.dumps({"side": sys.argv[1], "what": "criterion " + name + " us", "value": float(t.group(1)) * units[t.group(2)]}))
' "$s" >>"$results"
  done
  echo "round $round done" >&2
done
python - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
whats = list(dict.fromkeys(r["what"] for r in rows))
print(f"{'what':45} {'old':>10} {'new':>10} {'new/old':>8}")
for w in whats:
    old = [r["value"] for r in rows if r["what"] == w and r["side"] == "old"]
    new = [r["value"] for r in rows if r["what"] == w and r["side"] == "new"]
    if old and new:
        o, n = statistics.median(old), statistics.median(new)
        print(f"{w:45} {o:10.2f} {n:10.2f} {n / o:8.3f}")
PY
