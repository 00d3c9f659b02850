#!/usr/bin/env bash
# The tensor-core kernel's figures (runtime.models.tensor_core) in one device call, after
# MLX's CUDA build is staged (deploy/stage-device.sh; export PYTHONPATH=/tmp/site first):
#   bash benchmarks/gpu-tensor-core.sh [tests] [ops] [plans] [model]
# tests: its GPU tests; ops: 4-bit and bf16 projections at Qwen3-8B's shapes, MLX against the
# kernel (and bf16's default, the FMA kernel), 1 and 16 rows; plans: a sweep of plans at 4-bit, or
# BITS=0 at bf16, whose default route (the FMA kernel) trails MLX's matmul at 8B (PLANS:
# split,unroll,tiles,warps_n[,row_tiles] ...); model: a whole 4-bit random Qwen3-8B at oracle tau 6.5,
# plain and pipelined, MLX's quantized matmuls (=dense) against the kernel (=tc, the default there).
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-/tmp/site}:$(pwd)"
OUT=${OUT:-/tmp/gpu-tensor-core}
mkdir -p "$OUT"
for what in "$@"; do
  case $what in
    tests) timeout "${TEST_S:-400}" python3 -m pytest -q -x -p no:cacheprovider tests/test_tensor_core.py 2>&1 | tail -15 | tee "$OUT/tests.txt" ;;
    ops) python3 benchmarks/verify-ops.py --model qwen3-8b --rows 1 16 --bits 4 --impl mlx tc 2>&1 | tee "$OUT/ops.txt"
         python3 benchmarks/verify-ops.py --model qwen3-8b --rows 1 16 --bits 0 --impl mlx kernel tc 2>&1 | tee -a "$OUT/ops.txt" ;;
    plans) if [ "${BITS:-4}" = 0 ]; then default="8,1,1,1 8,1,2,1 4,1,1,2 4,1,2,2 2,1,1,4 1,1,1,4 8,1,1,1,2 4,1,1,2,2"
           else default="8,2,2,1 8,2,1,1 8,2,1,2 8,2,2,1,2 8,2,1,2,2 4,2,2,2 4,2,1,4 4,2,2,2,2 1,2,2,4 1,2,1,4 1,2,2,4,2 2,2,2,4"; fi
           # shellcheck disable=SC2086  # PLANS is a list
           python3 benchmarks/verify-ops.py --model qwen3-8b --rows 1 16 --bits "${BITS:-4}" --impl tc --plans ${PLANS:-$default} \
             2>&1 | tee "$OUT/plans.txt" ;;
    model) for setting in dense tc; do
             DFLASH_BATCH_INVARIANT=$setting python3 -m runtime.bench --model random:qwen3-8b-4bit --draft random:1 \
               --oracle-tau 6.5 --max-tokens "${TOKENS:-128}" --modes pipelined --json > "$OUT/model-$setting.json" \
               2> "$OUT/model-$setting.err"
             python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], 'plain tok/s', r['plain']['tokens_per_s'],
               'pipelined tok/s', r['dflash']['tokens_per_s'], 'tau', r['dflash'].get('tau'), 'round ms', r['dflash'].get('round_ms'),
               'reference parts ms', r['reference']['round_parts_ms'], 'equal', r['equal_outputs_per_mode'])" \
               "$OUT/model-$setting.json" "$setting" | tee -a "$OUT/model.txt"
           done ;;
  esac
done
