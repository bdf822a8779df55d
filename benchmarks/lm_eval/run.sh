#!/usr/bin/env bash
# lm-eval's local-completions multiple-choice run against `ferryman serve` on the embedded
# SmolLM2: a small local task (ferryman_mc.yaml, mc.jsonl: no dataset download), scored from
# the logprobs of each choice's tokens, which lm-eval asks for as token-id prompts with
# `echo`, `logprobs: 1` and `max_tokens: 1`. Needs lm-eval in the Python given as LMEVAL_PY
# (a separate venv: `python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm_eval[api]" transformers`).
#
#   LMEVAL_PY=/tmp/lmeval/bin/python bash benchmarks/lm_eval/run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
LMEVAL_PY="${LMEVAL_PY:-python}"
PORT="${PORT:-8765}"
tok="$(mktemp -d)"
python - "$tok" <<'PY'
import sys, torch
from ferryman.model_loader import load_model
_, tokenizer = load_model("smollm2", torch.float32, torch.device("cpu"))
tokenizer.save_pretrained(sys.argv[1])  # lm-eval tokenizes the prompts itself
PY
python -m ferryman serve --model smollm2 --port "$PORT" --no-calibrate --log-level warning &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$tok"' EXIT
for _ in $(seq 120); do
  curl -sf "localhost:$PORT/health" >/dev/null && break
  sleep 1
done
cd "$here"
"$LMEVAL_PY" -m lm_eval --model local-completions \
  --model_args "model=smollm2,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$tok,num_concurrent=4,max_retries=1" \
  --tasks ferryman_mc --include_path "$here" --batch_size 1
