#!/usr/bin/env bash
# Stage one carried part of the offline bundle on the device machine.
#
#   scripts/device_stage.sh PART_PATH STAGE_DIR
#
# Copies PART_PATH into STAGE_DIR (mkdir -p), together with the MANIFEST.json
# lying beside it when that was carried too, checks the part's sha256 against
# the manifest (a corrupt copy is removed and the script fails naming it) and
# prints how many of the bundle's parts are now staged (by size: the others were
# checked when they were staged).
#
# How the lead uses it. The device tool carries at most 64 MiB per call (working
# tree included) and a machine is forgotten ~30 s after a call, so the bundle
# (built here by `python scripts/offline_bundle.py --model smollm2-135m,qwen2.5-0.5b` into
# build/offline/parts/) travels one part per call, the calls back to back:
#
#   call 1:   carry ["build/offline/parts/psa-bundle.part-000", "build/offline/parts/MANIFEST.json"]
#             command: bash scripts/device_stage.sh build/offline/parts/psa-bundle.part-000 /tmp/psa-stage
#   call K:   the same with psa-bundle.part-00K (K = 1 .. N-2)
#   call N:   carry the last part and the manifest; command:
#             bash scripts/device_stage.sh build/offline/parts/psa-bundle.part-00N /tmp/psa-stage &&
#             bash scripts/install_offline.sh /tmp/psa-stage /tmp/psa-site &&
#             source /tmp/psa-site/psa-env.sh && <the work>
#
# STAGE_DIR must lie outside the working tree (/tmp/psa-stage): the tree is
# replaced on every call. If a call lands on a fresh machine (the status line
# shows fewer staged parts than expected), stage the missing parts again.
set -euo pipefail

die() { echo "device_stage: error: $*" >&2; exit 1; }

[ $# -eq 2 ] || die "usage: $0 PART_PATH STAGE_DIR"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
PART="$1"
STAGE="$2"
NAME="$(basename "$PART")"

[ -f "$PART" ] || die "$PART not found (was it carried?)"
mkdir -p "$STAGE"
if [ -f "$(dirname "$PART")/MANIFEST.json" ]; then
  cp -f "$(dirname "$PART")/MANIFEST.json" "$STAGE/MANIFEST.json"
fi
cp -f "$PART" "$STAGE/$NAME.tmp"
mv -f "$STAGE/$NAME.tmp" "$STAGE/$NAME"

if [ -f "$STAGE/MANIFEST.json" ]; then
  if ! "$PY" "$HERE/offline_bundle.py" verify "$STAGE" --part "$NAME"; then
    rm -f "$STAGE/$NAME"
    die "part $NAME failed verification and was removed from $STAGE; carry it again"
  fi
  # (the other parts by size: each was checked when it was staged, and install_offline.sh
  # checks every one again)
  "$PY" "$HERE/offline_bundle.py" status "$STAGE" --sizes-only
else
  n=$(find "$STAGE" -maxdepth 1 -name 'psa-bundle.part-*' ! -name '*.tmp' | wc -l)
  echo "staged $n part(s) in $STAGE (no MANIFEST.json carried: not verified, total unknown)"
fi
