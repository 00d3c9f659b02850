#!/usr/bin/env bash
# The training prompts of the bundled drafter, exported on a machine with the corpus packages
# (pip install -e ".[train]" && pip install --no-deps gensim), for deploy/gpu-train.sh's DATA.
#   bash deploy/export-prompts.sh [OUT.jsonl]        (default runs/prompts/train-v12.jsonl)
# Each step adds only prompts the file does not hold yet (runtime.training.export --base), so the
# order below is part of the recipe: steps 1-7 are train-v10b (session 17, g11's data), 8-12 were
# added for g12 (session 18). Code prompts to continue are kept HumanEval-shaped (short, or with
# a >>> example); held-out prompts, evaluation prompts and HumanEval look-alikes are never written.
set -euo pipefail
OUT=${1:-runs/prompts/train-v12.jsonl}
PY=${PYTHON:-python3}
mkdir -p "$(dirname "$OUT")"
tmp=$OUT.partial
rm -f "$tmp"
step() {  # samples, then sources and export options
  local samples=$1; shift
  local base=()
  [ -f "$tmp" ] && base=(--base "$tmp")
  "$PY" -m runtime.training.export --out "$tmp.next" --samples "$samples" "${base[@]}" --data "$@"
  mv "$tmp.next" "$tmp"
}
short_code=(--max-chars 1500 --doctest-or-under 600)
step 12000 tasks
step 9000 rg
step 10000 gsm code
step 8000 code-def ask-code "${short_code[@]}"
step 3000 stdlib "${short_code[@]}"
step 8000 chat ask-python
step 4500 pkg:sympy pkg:numpy pkg:anyio "${short_code[@]}"
step 24000 tasks                      # the next 12k requests over wonderwords' nouns
step 18000 rg                         # twice as many per reasoning-gym training family
step 6000 ask-world                   # places, currencies, words, news summaries (gensim)
step 6000 pkg:scipy pkg:httpx pkg:pydantic pkg:jinja2 pkg:click pkg:starlette "${short_code[@]}"
step 12000 gsm code                   # about a thousand more gsm_symbolic seeds (CodeIO is spent)
mv "$tmp" "$OUT"
echo "$OUT: $(wc -l < "$OUT") prompts"
