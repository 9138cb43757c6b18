#!/usr/bin/env bash
# Install the offline bundle on the air-gapped GPU host (shared/AIRGAP.md).
#
#   scripts/install_offline.sh STAGE_DIR [SITE_DIR]
#
# STAGE_DIR holds MANIFEST.json and every psa-bundle.part-NNN (scripts/device_stage.sh
# puts them there, one device call per part). SITE_DIR (default STAGE_DIR/site)
# receives the packages. Steps: verify every part's sha256 against MANIFEST.json
# (a missing or corrupt part is named), join the parts and untar them into
# STAGE_DIR/unpacked, `pip install --no-index --no-deps --no-compile --target SITE`
# the wheels, restore the xz-compressed kernel files (FA3) and copy the sglang-kernel
# folders into SITE, put each model's GGUF
# where sglang_psa.models finds it ($SGLANG_PSA_CACHE, default ~/.cache/sglang-psa),
# and write SITE/psa-env.sh. The last line printed is the `export PYTHONPATH=...`
# to use (or `source SITE/psa-env.sh`). Rerunning with the same bundle does
# nothing but print it again (PSA_FORCE=1 reinstalls).
#
# Environment: PYTHON (default python3), PSA_FORCE=1, PSA_PIP_FLAGS (extra pip
# flags, e.g. the output of `offline_bundle.py pip-flags` to dry-run the install
# from a host whose Python is not 3.12).
set -euo pipefail

die() { echo "install_offline: error: $*" >&2; exit 1; }

[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: $0 STAGE_DIR [SITE_DIR]"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
PY="${PYTHON:-python3}"
TOOL="$HERE/offline_bundle.py"
STAGE="$(mkdir -p "$1" && cd "$1" && pwd)"
SITE="${2:-$STAGE/site}"
mkdir -p "$SITE"
SITE="$(cd "$SITE" && pwd)"
UNPACKED="$STAGE/unpacked"
STAMP="$SITE/.psa-bundle.sha256"

[ -f "$STAGE/MANIFEST.json" ] || die "MANIFEST.json is missing from $STAGE (carry build/offline/parts/MANIFEST.json)"
total_sha="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["total_sha256"])' "$STAGE/MANIFEST.json")"

# The export line: the checkout's sources first (the live code wins over the bundled
# snapshot of sglang_psa / sgl_kernel_ext), then SITE, then whatever was set.
pypath="$SITE"
if [ -d "$REPO/python/sglang_psa" ] && [ -d "$REPO/sgl-kernel-ext/sgl_kernel_ext" ]; then
  pypath="$REPO/python:$REPO/sgl-kernel-ext:$SITE"
fi
# A wheel's .pth file (nvidia-cutlass-dsl's puts its dsl_packages/ on sys.path) is read
# only in a site directory, and SITE is a PYTHONPATH entry: the paths the .pth files add
# (found by letting `site` process SITE in a throwaway interpreter) follow SITE in it.
# Only their sys.path entries carry over, not other side effects of their import lines.
env_line() {
  local extra
  extra="$("$PY" -c '
import site, sys
before = set(sys.path) | {sys.argv[1]}
site.addsitedir(sys.argv[1])
print(":".join(p for p in sys.path if p not in before))' "$SITE")" ||
    die "processing the .pth files in $SITE failed"
  echo "export PYTHONPATH=$pypath${extra:+:$extra}\${PYTHONPATH:+:\$PYTHONPATH}"
}

# The checkout's entry points win too: SGLang finds the plugin through the installed
# sglang_psa dist-info, whose entry point names a module of the bundled snapshot (a
# module the checkout may have moved since: the plugin would then fail to load and
# every --psa flag be "unrecognized").
sync_entry_points() {
  [ -f "$REPO/pyproject.toml" ] || return 0
  "$PY" - "$REPO/pyproject.toml" "$SITE" <<'PYEOF' || die "could not sync the plugin's entry points"
import glob, sys, tomllib
eps = tomllib.load(open(sys.argv[1], "rb"))["project"].get("entry-points", {})
text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in e.items()) + "\n" for g, e in eps.items())
for d in glob.glob(f"{sys.argv[2]}/sglang_psa-*.dist-info"):
    open(f"{d}/entry_points.txt", "w").write(text)
    print(f"install_offline: entry points of {d} follow the checkout", file=sys.stderr)
PYEOF
}

if [ -z "${PSA_FORCE:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$total_sha" ]; then
  echo "install_offline: bundle ${total_sha:0:16} already installed in $SITE" >&2
  sync_entry_points
  env_line
  exit 0
fi

rm -f "$STAMP"  # written again only after a complete install
echo "install_offline: [${SECONDS}s] verifying parts in $STAGE" >&2
"$PY" "$TOOL" verify "$STAGE" >&2 || die "bundle verification failed (see above); re-stage the named part"

echo "install_offline: [${SECONDS}s] joining parts and unpacking into $UNPACKED" >&2
mapfile -t PARTS < <("$PY" "$TOOL" parts "$STAGE")
[ ${#PARTS[@]} -gt 0 ] || die "no parts listed in $STAGE/MANIFEST.json"
rm -rf "$UNPACKED"
mkdir -p "$UNPACKED"
cat "${PARTS[@]}" | tar -x -f - -C "$UNPACKED" || die "untar failed"
B="$UNPACKED/psa-bundle"
[ -f "$B/BUNDLE.json" ] || die "$B/BUNDLE.json missing after untar"

shopt -s nullglob
WHEELS=("$B"/wheels/*.whl)
if [ ${#WHEELS[@]} -gt 0 ]; then
  echo "install_offline: [${SECONDS}s] pip install ${#WHEELS[@]} wheels into $SITE" >&2
  # shellcheck disable=SC2086
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --disable-pip-version-check ${PSA_PIP_FLAGS:-} --target "$SITE" "${WHEELS[@]}" \
      || die "pip install failed"
fi

if [ -d "$B/kernel" ]; then
  # FA3's library travels xz-compressed; restored byte for byte (sha256 checked).
  "$PY" "$TOOL" unxz-kernel "$B" >&2 || die "restoring the compressed kernel files failed"
  echo "install_offline: [${SECONDS}s] copying the sglang-kernel folders into $SITE" >&2
  for d in "$B"/kernel/*; do
    rm -rf "$SITE/$(basename "$d")"
    cp -a "$d" "$SITE/"
  done
fi

if [ -n "$(ls "$B"/models/*.whl 2>/dev/null)" ]; then
  echo "install_offline: [${SECONDS}s] placing the model GGUFs in the sglang-psa cache" >&2
  # One path per line: a bundle may carry several models (offline_bundle.py --model a,b).
  ggufs="$("$PY" "$TOOL" place-model "$B")" || die "placing the models failed"
  while IFS= read -r gguf; do
    echo "install_offline: model GGUF at $gguf" >&2
  done <<< "$ggufs"
  echo "install_offline: convert with: python3 -m sglang_psa.models <key>" >&2
fi

sync_entry_points

line="$(env_line)"
cat > "$SITE/psa-env.sh" <<EOF
# written by scripts/install_offline.sh for bundle $total_sha
$line
EOF
echo "$total_sha" > "$STAMP"
echo "install_offline: [${SECONDS}s] done; \`source $SITE/psa-env.sh\` or:" >&2
echo "$line"
