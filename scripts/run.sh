#!/usr/bin/env bash
# Sets everything up (see setup.sh) and completes prompts with the embedded default model,
# SmolLM2-135M-Instruct, on CPU:  ./scripts/run.sh "The capital of France is"
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
ferryman_build
if [ "$#" -eq 0 ]; then
  set -- "The capital of France is"
fi
exec ferryman generate "$@"
