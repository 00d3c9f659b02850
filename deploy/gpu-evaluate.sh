#!/usr/bin/env bash
# Choose a drafter on the validation split, then report it on the test split (docs/evaluation.md).
#   python -m runtime.evalsets --out runs/eval ...   (here; carry runs/eval), then on the GPU machine:
#   export PYTHONPATH=/tmp/site && bash deploy/gpu-evaluate.sh DRAFTER...
# STAGE=choose: every DRAFTER's tau on the validation sets (runtime.training.compare), the one with
#   the highest mean chosen ($OUT/chosen); STAGE=test: the chosen one (or CHOSEN=DIR) through
#   runtime.bench on each test set (plain decoding and pipelined DFlash in one run: tau, speedup),
#   and the other DRAFTERs' test tau (compare); STAGE=both (default) does both.
# EVAL (runs/eval), VALIDATION / TEST (set names, default "code code-ask math chat"), TOKENS (256),
# DTYPE (native: the target as shipped, 4-bit), PYTHON (python3).
set -euo pipefail
export PYTHONPATH="${PYTHONPATH:-/tmp/site}:$(pwd)"
OUT=${OUT:-/tmp/gpu-evaluate}
mkdir -p "$OUT"
EVAL=${EVAL:-runs/eval}
TOKENS=${TOKENS:-256}
DTYPE=${DTYPE:-native}
STAGE=${STAGE:-both}
PY=${PYTHON:-python3}
val=() tst=()
for s in ${VALIDATION:-code code-ask math chat}; do val+=("$EVAL/validation/$s.jsonl"); done
for s in ${TEST:-code code-ask math chat}; do tst+=("$EVAL/test/$s.jsonl"); done
compare() {  # output name, then compare's --drafts and --prompts
  local name=$1; shift
  "$PY" -m runtime.training.compare --dtype "$DTYPE" --max-tokens "$TOKENS" --block-size 16 --json "$@" > "$OUT/$name.json"
  "$PY" - "$OUT/$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for drafter, sets in r["drafters"].items():
    cells = ", ".join(f"{name} ({r['splits'][name]}) {row['tau']:.3f} [{row['equal']}/{row['prompts']}]" for name, row in sets.items())
    print(f"tau {drafter}: {cells}; mean {sum(row['tau'] for row in sets.values()) / len(sets):.3f}")
PY
}
if [ "$STAGE" != test ]; then
  compare validation --drafts "$@" --prompts "${val[@]}"
  "$PY" -c 'import json, sys; r = json.load(open(sys.argv[1]))["drafters"]; print(max(r, key=lambda d: sum(s["tau"] for s in r[d].values())))' \
    "$OUT/validation.json" > "$OUT/chosen"
  echo "chosen on validation: $(cat "$OUT/chosen")"
fi
if [ "$STAGE" != choose ]; then
  chosen=${CHOSEN:-$(cat "$OUT/chosen")}
  for set in "${tst[@]}"; do
    "$PY" -m runtime.bench --draft "$chosen" --prompts "$set" --modes pipelined --block-size 16 --max-tokens "$TOKENS" \
      --dtype "$DTYPE" --json > "$OUT/test-$(basename "$set" .jsonl).json"
    "$PY" - "$OUT/test-$(basename "$set" .jsonl).json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['prompt_set']} ({r['split']} split): plain {r['plain']['tokens_per_s']:.1f} tok/s, pipelined "
      f"{r['dflash']['tokens_per_s']:.1f} ({r['speedup']:.2f}x), tau {r['reference']['tau']:.3f}, "
      f"equal to plain greedy {r['equal_outputs_per_mode']} of {r['prompts']}")
PY
  done
  others=()
  for d in "$@"; do [ "$d" = "$chosen" ] || others+=("$d"); done
  [ ${#others[@]} -eq 0 ] || compare test-others --drafts "${others[@]}" --prompts "${tst[@]}"
fi
