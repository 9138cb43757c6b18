#!/usr/bin/env bash
# The GPU machine's share of the work, after the offline bundle is staged and installed
# (README, "Air-gapped GPU host"). One step per device call, so each fits the 10-minute
# call limit; results go to $OUT (the device tool brings that folder back).
#
#   source /tmp/psa-site/psa-env.sh && bash scripts/gpu_validate.sh STEP
#
# STEP: tests      kernel, unit and GPU end-to-end tests (compiled kernels, SGLang engines)
#       interp     the same kernel tests under Triton's interpreter (the CI path)
#       store      benchmark/store/bench_store.py  -> store_h100.json
#       kernels    benchmark/kernels/run_all.py    -> kernels_h100.json
#       e2e        benchmark/e2e/run_e2e.py        -> e2e_h100.json
# Set GIT_COMMIT to this checkout's commit: the machine's copy of .git can be stale.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?run on the device machine (OUT is where results come back)}"
: "${GIT_COMMIT:?export GIT_COMMIT=<commit hash of this checkout>}"
export PYTHONUNBUFFERED=1
py() { python3 "$@"; }
case "${1:-}" in
  tests)
    py -m sglang_psa.models smollm2-135m >/dev/null
    py -m pytest -q -p no:cacheprovider -rs test/kernels test/unit test/e2e 2>&1 | tee "$OUT/tests.log"
    ;;
  interp)
    TRITON_INTERPRET=1 py -m pytest -q -p no:cacheprovider -k cpu test/kernels 2>&1 | tee "$OUT/interp.log"
    ;;
  store) py benchmark/store/bench_store.py --out "$OUT" 2>&1 | tee "$OUT/store.log" ;;
  kernels) py benchmark/kernels/run_all.py --out "$OUT" 2>&1 | tee "$OUT/kernels.log" ;;
  e2e)
    py -m sglang_psa.models smollm2-135m >/dev/null
    py benchmark/e2e/run_e2e.py --model smollm2-135m --context-tokens 4096 --out "$OUT" 2>&1 |
      tee "$OUT/e2e.log"
    ;;
  *) echo "usage: $0 tests|interp|store|kernels|e2e" >&2; exit 2 ;;
esac
