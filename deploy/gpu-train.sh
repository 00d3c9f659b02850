#!/usr/bin/env bash
# Train the bundled SmolLM2-135M drafter on the GPU machine (stage MLX first: gpu-measure.sh).
#   python -m runtime.evalsets ...; export prompts to runs/prompts/train.jsonl (see the issue note),
#   then in the device call: export PYTHONPATH=/tmp/site && bash deploy/gpu-train.sh [OUT_DIR]
# Stops itself after $LIMIT seconds; run it again to --resume. The drafter goes to $OUT/drafter.
set -euo pipefail
export PYTHONPATH="${PYTHONPATH:-/tmp/site}:$(pwd)"
DIR=${1:-runs/smollm2-dflash}
LIMIT=${LIMIT:-540}
RESUME=""
[ -d "$DIR/checkpoint" ] && RESUME=--resume
rc=0
timeout "$LIMIT" python3 -m runtime.train --out "$DIR" --data runs/prompts/train.jsonl --samples 8000 \
  --max-new-tokens 256 --max-seq-len 768 --gen-batch-size 128 --epochs "${EPOCHS:-6}" --batch-size 32 \
  --micro-batch 16 --layers 3 --block-size 16 --save-every 50 --no-compile --cache-dir runs/regen $RESUME || rc=$?
echo "training exit status $rc"
if [ -n "${OUT:-}" ] && [ -f "$DIR/model.safetensors" ]; then
  mkdir -p "$OUT/drafter" && cp "$DIR/config.json" "$DIR/model.safetensors" "$OUT/drafter/"
fi
