#!/usr/bin/env bash
# ferryman's whole test suite: sets up (or reuses) a virtual environment (setup.sh), builds the
# extension, and runs every gate of DEVELOPERS.md, cheapest first. Exits non-zero on the first
# failure.
#
#   FERRYMAN_RANDOM_OPS operations of the randomized core test (default here 500000)
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "python environment and dependencies"
source scripts/setup.sh

step "cargo fmt --check"
cargo fmt --all --check
step "ruff check / ruff format --check"
ruff check .
ruff format --check .
step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
export FERRYMAN_RANDOM_OPS=${FERRYMAN_RANDOM_OPS:-500000}
step "cargo test (core, randomized ops: $FERRYMAN_RANDOM_OPS)"
cargo test -p ferryman-core
step "criterion benches, once each in test mode"
cargo test -p ferryman-core --benches
step "maturin develop --release"
ferryman_build
step "mypy + stubtest"
mypy
python -m mypy.stubtest ferryman._core
step "pytest"
set +e
python -m pytest -q tests
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
