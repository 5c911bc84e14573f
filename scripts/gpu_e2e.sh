#!/usr/bin/env bash
# The 8B model end to end on one GPU, a GPU run in steps of at most 10 minutes, resumable: benchmarks/e2e.py at
# Llama-3.1-8B's shapes (random bf16 weights made on the device, layers scanned), batch 1, kvjax's full and every
# method at 0.2 (the recall methods also at 2,048 tokens) beside transformers' LlamaForCausalLM and kvpress's
# SnapKVPress(0.8) on the same card.
#
#   KVJAX_COMMIT=<commit> bash scripts/gpu_e2e.sh    # CTX (default 32k,16k,64k), METHODS (default e2e.py's order),
#                                                    # LIMIT_S (default 540), SCAN (on: layers stacked, off)
#   JAX_PLATFORMS=cpu MODEL=tiny CTX=100 NEW_TOKENS=4 NAME=smoke.json OUT=/tmp/smoke bash scripts/gpu_e2e.sh
#                                                    # the same path on a CPU, in a minute (nvidia-smi may be absent)
#
# Rows run in priority order (32k, then 16k, then 64k; at each: full, transformers, kvpress, chelsea, clusterkv,
# pqcache, chunkkv, less, then the baselines) and each is written to $OUT/e2e_8b_b1_h200.json as it finishes. The run
# resumes: the JSON starts as benchmarks/results/e2e_8b_b1_h200.json (copy $OUT's back there between steps), and
# rows already in it at the same KVJAX_COMMIT are not measured again, so a step cut at LIMIT_S loses only the row it
# was in. KVJAX_COMMIT: the commit of the code (`git log -1 --format=%H -- kvjax kernels_pallas benchmarks/e2e.py
# benchmarks/e2e_torch.py`), not HEAD, so committing the JSON between steps does not restart the run.
#
# Memory: JAX allocates on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false) up to MEM_FRACTION (0.6: 84 GB of an H200's
# 141, the skip rule's limit); the torch side runs in its own process (benchmarks/e2e_torch.py) in the rest (8B bf16
# weights 16 GB + a 64k cache 8.6 GB + prefill activations) and returns its cache's blocks after every row.
# kvpress: its wheel (benchmarks/wheels/, no dependencies) installed with pip --no-deps; it needs transformers
# >=4.56,<5.3.
# Where the machine's transformers is newer, put transformers 5.2.0 and tokenizers 0.22.2 wheels in TORCH_WHEELS
# (default .whl, ignored by git): they are installed into their own folder that only the torch side's process sees,
# so the transformers and kvpress rows run on 5.2.0 and the JAX side is untouched. Without them, the torch side uses
# the machine's transformers (kvpress's hook adapted to its renamed arguments, said in the row).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-/tmp/e2e_out}
NAME=${NAME:-e2e_8b_b1_h200.json}
mkdir -p "$DEST" /tmp/e2e_site
python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/e2e_site \
  benchmarks/wheels/kvpress-0.5.5-py3-none-any.whl \
  || echo "kvpress wheel not installed: e2e_torch.py puts the wheel itself on sys.path"
TORCH_PY=python3 TORCH_WHEELS=${TORCH_WHEELS:-.whl}
if ls "$TORCH_WHEELS"/transformers-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /tmp/e2e_torch_site \
    "$TORCH_WHEELS"/*.whl \
    && printf '#!/bin/sh\nPYTHONPATH=/tmp/e2e_torch_site:$PYTHONPATH exec python3 "$@"\n' > /tmp/e2e_torch_python \
    && chmod +x /tmp/e2e_torch_python && TORCH_PY=/tmp/e2e_torch_python
fi
[ -f "$DEST/$NAME" ] || { [ -f "benchmarks/results/$NAME" ] && cp "benchmarks/results/$NAME" "$DEST/$NAME"; }
export PYTHONPATH="$PWD:/tmp/e2e_site" PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} \
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.6}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$TORCH_PY -c "import torch, transformers as t; print('torch side:', torch.__version__, 'transformers', t.__version__)"
timeout -k 10 "${LIMIT_S:-540}" python3 benchmarks/e2e.py --model "${MODEL:-llama-3.1-8b}" \
  --contexts "${CTX:-32k,16k,64k}" --batch 1 --new-tokens "${NEW_TOKENS:-256}" --budgets 0.2 --token-budgets 2048 \
  --chunkkv-reuse 1,2 --scan-layers "${SCAN:-on}" \
  --torch-python "$TORCH_PY" ${METHODS:+--methods "$METHODS"} --out "$DEST/$NAME" 2>&1 | tee "$DEST/e2e.log"
python3 benchmarks/e2e.py --report "$DEST/$NAME" > /dev/null  # the .txt, .md and .png, also after a cut run
