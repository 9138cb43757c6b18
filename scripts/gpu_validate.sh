#!/usr/bin/env bash
# The GPU machine's share of the work, after the offline bundle is staged and installed
# (docs/offline-gpu.md). One step per device call, so each fits the 10-minute
# call limit; results go to $OUT (the device tool brings that folder back).
#
#   source /tmp/psa-site/psa-env.sh && bash scripts/gpu_validate.sh STEP
#
# STEP: gpu-tests  every test marked `gpu` (kernels, unit, reliability, end-to-end; ~20 min
#                  on the H200), over back-to-back calls: each runs what the last left
#                  (scripts/gpu_tests.py; $OUT/gpu_tests.json; exit 3 = run it again).
#                  A later session resumes by carrying the last call's
#                  $OUT/gpu_tests_state.json as build/gpu-tests-state.json (SGLang 0.5.17;
#                  build/gpu-tests-state-VERSION.json for another release; a test file
#                  runs again when it or the code under it changed); further arguments go
#                  to gpu_tests.py (`gpu-tests --rerun-failed`: the failures again, once).
#                  Needs both models in the bundle (--model smollm2-135m,qwen2.5-0.5b)
#       kernel-tests kernel, store and algorithm tests only: needs no bundle (the GPU image
#                  has torch, triton and pytest; set PYTHONPATH=python:sgl-kernel-ext)
#       interp     the kernel tests under Triton's interpreter (the CI path)
#       store      benchmark/store/bench_store.py  -> store_<gpu>.json
#       kernels    benchmark/kernels/run_all.py    -> kernels_<gpu>.json (no bundle needed)
#       e2e [RUNS] benchmark/e2e/run_e2e.py        -> e2e_<gpu>.json once all five engines
#                  have run; RUNS (e.g. plain,plain_splits,psa_1) spreads them over calls;
#                  E2E_MODEL / E2E_CONTEXT pick the model and context (qwen2.5-0.5b, 8192;
#                  the bundle must carry the model: --model smollm2-135m,qwen2.5-0.5b)
# <gpu> is the GPU's model (h100, h200, ...), so a run on another kind never lands under
# the H100's file name. Set GIT_COMMIT to this checkout's commit: the machine's copy of
# .git can be stale.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?run on the device machine (OUT is where results come back)}"
: "${GIT_COMMIT:?export GIT_COMMIT=<commit hash of this checkout>}"
export PYTHONUNBUFFERED=1
py() { python3 "$@"; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
  grep -oiE '[ABHL][0-9]{2,3}' | head -1 | tr '[:upper:]' '[:lower:]' || true)
gpu=${gpu:-gpu}
case "${1:-}" in
  gpu-tests)
    t0=$SECONDS  # BUDGET_S counts from here: a fresh machine converts the models first
    # their progress bars go to a log, not the call's short output tail (one setup log:
    # the device tool brings back at most 8 files)
    for m in smollm2-135m qwen2.5-0.5b; do
      py -m sglang_psa.models "$m" >>"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
    done
    # SGLang's engine must import before device time goes to tests that need it (a wheel
    # built for another torch fails here, named, instead of in every serving test), and
    # what a server imports only once it builds the model on CUDA: SGLang 0.5.23's Qwen2
    # and Llama MLPs import its CuTe DSL dual GEMM (`cutlass`), absent from 0.5.17
    py -c '
import importlib.util, sglang.srt.entrypoints.engine
if importlib.util.find_spec("sglang.srt.layers.dual_gemm"):
    import sglang.kernels.ops.gemm.cutedsl_dual_gemm' >>"$OUT/setup.log" 2>&1 ||
      { echo "gpu_validate: SGLang's engine or model layers do not import:"; tail -5 "$OUT/setup.log"; exit 1; }
    # carried: an earlier session's $OUT/gpu_tests_state.json; one file per SGLang release
    ver=$(py -c 'from importlib.metadata import version; print(version("sglang"))')
    seed=build/gpu-tests-state.json
    [ "$ver" = 0.5.17 ] || seed=build/gpu-tests-state-$ver.json
    # else the record landed on main (docs/gpu-tests/: a new checkout has no build/)
    [ -f "$seed" ] || seed=docs/gpu-tests/state-sglang-$ver.json
    py scripts/gpu_tests.py --budget-s "$(( ${BUDGET_S:-540} - (SECONDS - t0) ))" --out "$OUT" \
      ${seed:+--seed-state "$seed"} "${@:2}" 2>&1 | tee "$OUT/gpu-tests.log"
    rc=${PIPESTATUS[0]}
    # a server that died says why in its own log, which stays on the machine: the newest
    # ones' tails go into the log that comes back (the machine is gone 30 s later)
    if [ "$rc" = 1 ]; then
      for f in $(ls -t /tmp/pytest-of-*/pytest-*/*/server*.log 2>/dev/null | head -3); do
        echo "=== gpu_validate: the last lines of $f"
        grep -v '^[[:space:]]*$' "$f" | tail -25 | cut -c1-400
      done >>"$OUT/gpu-tests.log"
    fi
    exit "$rc"
    ;;
  kernel-tests)
    py -m pytest -q -p no:cacheprovider -rs test/kernels test/unit/store test/unit/algo 2>&1 |
      tee "$OUT/kernel-tests.log"
    ;;
  interp)
    TRITON_INTERPRET=1 py -m pytest -q -p no:cacheprovider -k cpu test/kernels 2>&1 | tee "$OUT/interp.log"
    ;;
  store) py benchmark/store/bench_store.py --out "$OUT" --name "store_$gpu" 2>&1 |
    tee "$OUT/store.log" ;;
  kernels) py benchmark/kernels/run_all.py --out "$OUT" --name "kernels_$gpu" 2>&1 |
    tee "$OUT/kernels.log" ;;
  e2e)
    py -m sglang_psa.models "${E2E_MODEL:-qwen2.5-0.5b}" >/dev/null
    py benchmark/e2e/run_e2e.py --model "${E2E_MODEL:-qwen2.5-0.5b}" \
      --context-tokens "${E2E_CONTEXT:-8192}" --out "$OUT" --name "e2e_$gpu" \
      ${2:+--runs "$2"} 2>&1 | tee "$OUT/e2e.log"
    ;;
  *) echo "usage: $0 gpu-tests|kernel-tests|interp|store|kernels|e2e [RUNS]" >&2; exit 2 ;;
esac
