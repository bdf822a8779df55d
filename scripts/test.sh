#!/usr/bin/env bash
# ferryman's whole test suite: sets up (or reuses) a virtual environment, builds the extension,
# and runs every gate of DEVELOPERS.md, cheapest first. Exits non-zero on the first failure.
#
#   FERRYMAN_VENV       virtual environment to use/create (default ~/.cache/ferryman/venv)
#   CARGO_TARGET_DIR    cargo build folder (default ~/.cache/ferryman/target, a cache only)
#   FERRYMAN_RANDOM_OPS operations of the randomized core test (default here 500000)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${FERRYMAN_VENV:-$HOME/.cache/ferryman/venv}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/ferryman/target}
step() { printf '\n==> %s\n' "$*"; }

step "python environment ($VENV)"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
export PYO3_PYTHON="$VENV/bin/python"

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
maturin develop --release --quiet
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
