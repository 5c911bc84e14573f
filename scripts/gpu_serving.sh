#!/usr/bin/env bash
# Serving at a fixed memory on one GPU: a GPU run in steps of at most 10 minutes, resumable. One step:
#
#   KVJAX_COMMIT=<commit> timeout 590 bash scripts/gpu_serving.sh
#
# <commit>: `git log -1 --format=%H -- kvjax 'benchmarks/*.py' scripts` here (the last commit that changed the code: the
# rows' resume key, so committing results between steps does not make the next step measure them again).
#
# Phases, in this order, each under `timeout` and within BUDGET_S (default 570 s) in all; each one's output goes to
# $OUT/gpu_serving.log as it comes, the JSON rows as they finish:
#   1. fit    benchmarks/serving.py --rows fit: Llama-3.1-8B shapes, random bf16 weights, 32k-token prompts, full and
#             every method at 0.2 (the recall methods at 2048 tokens): the largest batch that fits the card and its
#             decode tokens/s ($OUT/serving_h200.json); until GEMMA_S before the budget's end
#   2. gemma  benchmarks/roofline.py --shape gemma3, then gemma3-global: Gemma-3-12B's attention shapes (6 layers, one
#             period of five local layers and a global one), 32k, batch 8, bf16, full / SnapKV / Quest
#             ($OUT/roofline_gemma3{,_global}_h200_32k_b8.{json,txt}); skipped where $PREV already has its JSON
#   3. batch  benchmarks/serving.py --rows batch: batch 8 at 32k and 64k, TTFT, TPOT, tok/s (the same JSON), with
#             what is left
# Resumes: $PREV/serving_h200.json (default PREV=benchmarks/results: an earlier step's committed rows) is
# copied to $OUT first, and serving.py measures only the rows it lacks at the same commit and settings. docs/
# performance.md ("Serving at a fixed memory") says which rows one step gets through.
#
# TINY=1: the same phases on the CPU at tiny shapes (the 2-layer model, 64 tokens; Gemma's shapes at 64 tokens),
# what tests/benchmarks/test_serving.py runs; OUT defaults to benchmarks/results/device.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/device}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
GEMMA_S=${GEMMA_S:-200}
LOG="$OUT/gpu_serving.log"
R=$(mktemp -d)  # roofline writes a .png beside its JSON: the JSON and .txt are copied to $OUT (8 files come back)

if [ "${TINY:-0}" = 1 ]; then
  export JAX_PLATFORMS=cpu
  NAME=tiny_cpu PREV=${PREV:-}
  SERVING=(--model tiny --context 64 --new-tokens 3 --repeats 1 --dtype float32 --memory-gb 0.004
           --methods "${METHODS:-full,snapkv,quest}" --batch 2 --batch-contexts 40,64)
  LEN=64 GEMMA=(--steps 1 --rounds 1 --bandwidth-mib 8 --methods "${GEMMA_METHODS:-snapkv,quest}")
else
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
  NAME=h200 PREV=${PREV-benchmarks/results}
  SERVING=(--methods "${METHODS:-full,chelsea,clusterkv,pqcache,chunkkv,less,streaming_llm,h2o,snapkv,pyramidkv,quest}")
  LEN=32k GEMMA=(--steps 8 --rounds 3 --methods "${GEMMA_METHODS:-snapkv,quest}")
fi
JSON="$OUT/serving_$NAME.json"
[ -n "$PREV" ] && [ -f "$PREV/serving_$NAME.json" ] && [ ! -f "$JSON" ] && cp "$PREV/serving_$NAME.json" "$JSON"

left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
phase() {  # phase NAME LIMIT_S command...: under a time limit, its output appended to $LOG
  local name=$1 limit=$2 rc; shift 2
  if [ "$limit" -lt 20 ]; then echo "=== $name: not started, ${limit} s left" | tee -a "$LOG"; return; fi
  echo "=== $name (limit ${limit} s) starts at $(( $(date +%s) - T0 )) s" | tee -a "$LOG"
  timeout -k 5 "$limit" "$@" >> "$LOG" 2>&1; rc=$?
  echo "=== $name rc=$rc at $(( $(date +%s) - T0 )) s" | tee -a "$LOG"
}

L=$(( $(left) - GEMMA_S ))
phase fit "$L" "$PY" benchmarks/serving.py --rows fit "${SERVING[@]}" --stop-after-s $(( L - 45 )) --out "$JSON"

for shape in gemma3 gemma3-global; do  # each at most GEMMA_EACH_S (110 s; the H200's 2-layer, 4-variant roofline: 59 s)
  out="roofline_${shape/-/_}_${NAME}_${LEN}_b8"
  if [ -n "$PREV" ] && [ -f "$PREV/$out.json" ]; then echo "=== $shape: already in $PREV/$out.json" | tee -a "$LOG"; continue; fi
  g=$(left); [ "$g" -gt "${GEMMA_EACH_S:-110}" ] && g=${GEMMA_EACH_S:-110}
  phase "$shape" "$g" "$PY" benchmarks/roofline.py --shape "$shape" --layers 6 --first-layer 0 --lengths "$LEN" \
    --batch 8 --dtypes bfloat16 --budgets 0.2 --token-budgets 2048 --max-prefill-s inf --group-size 2 "${GEMMA[@]}" \
    --out "$R/$out.json"
  cp "$R/$out.json" "$R/$out.txt" "$OUT/" 2>/dev/null
done

L=$(left)
phase batch "$L" "$PY" benchmarks/serving.py --rows batch "${SERVING[@]}" --stop-after-s $(( L - 60 )) --out "$JSON"
"$PY" benchmarks/serving.py --report "$JSON" > /dev/null 2>&1  # the table of every row so far, $OUT/serving_*.txt
tail -n 40 "$OUT/serving_$NAME.txt" 2>/dev/null
rm -rf "$R"
