#!/usr/bin/env bash
# The suite as N processes on one GPU (`run.py --shard K/N`, each with its own result file
# that a later call resumes), stopped after SECONDS, then joined (`run.py --combine`).
#
#   bash benchmark/adaptive/shards.sh MODEL NAME N SECONDS [run.py arguments ...]
#
# Shard K writes $AB_DIR/NAME_sK.json (AB_DIR: /tmp/ab) and its log NAME_sK.log; the join
# is $AB_DIR/NAME.json. Extra arguments go to every shard (--policies, --budgets: give the
# join's --budgets the same way, BUDGETS="1024,2048"). The sparse rows are launch-bound, so
# the shards fill each other's gaps; on the H100 four 1.5B shards beside two 0.5B ones took
# ~36 s a task each (79 GiB at the peak: one shard ran out of memory once and resumed).
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,11p "$0" >&2; exit 2; }
model=$1 name=$2 n=$3 seconds=$4
shift 4
dir=${AB_DIR:-/tmp/ab}
mkdir -p "$dir"
cd "$(dirname "$0")/../.."
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
pids=()
for ((k = 0; k < n; k++)); do
  timeout "$seconds" python3 benchmark/adaptive/run.py --model "$model" --shard "$k/$n" \
    --name "${name}_s$k" --out "$dir" --resume "$dir/${name}_s$k.json" "$@" \
    > "$dir/${name}_s$k.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || echo "shards: a shard stopped ($?): see its log" >&2; done
files=()
for ((k = 0; k < n; k++)); do
  [ -f "$dir/${name}_s$k.json" ] && files+=("$dir/${name}_s$k.json")
  tail -n 1 "$dir/${name}_s$k.log" >&2
done
[ ${#files[@]} -gt 0 ] || { echo "shards: no shard wrote a result" >&2; exit 1; }
python3 benchmark/adaptive/run.py --combine "${files[@]}" --name "$name" --out "$dir" \
  ${BUDGETS:+--budgets "$BUDGETS"}
