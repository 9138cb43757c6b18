#!/usr/bin/env bash
# Keep the GPU machine's compiled kernels from one session to the next.
#
#   scripts/device_jit_cache.sh save OUT_DIR [MAX_PARTS]
#   scripts/device_jit_cache.sh restore DIR
#
# A fresh device machine compiles every Triton kernel on first use (plain SGLang's
# first start on Triton: ~125 s against ~60 s once compiled; the GPU kernel tests
# mostly compile) and FlashInfer JIT-builds its kernels at its first start (~100 s).
# `save`, at the end of a call, packs the Triton cache (${TRITON_CACHE_DIR:-~/.triton/cache})
# and FlashInfer's JIT folder (~/.cache/flashinfer) into OUT_DIR/jit-cache.part-NN,
# 15 MiB each (what a file back from the device may weigh), at most MAX_PARTS (default 3:
# the call's other files need room among the 8 that come back); when the whole does not
# fit, the Triton cache alone, else nothing (and it says so). `restore`, in a later
# session's first call that carries those parts (build/device-cache/, ignored by git),
# unpacks them where they came from. Entries of kernels whose source changed are just
# not hit; the compilers check the rest (Triton keys an entry by its source, its version
# and the GPU), so a stale part costs nothing but its transfer.
set -euo pipefail

die() { echo "device_jit_cache: error: $*" >&2; exit 1; }

TRITON_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
FI_DIR="$HOME/.cache/flashinfer"
PART_BYTES=$((15 * 1024 * 1024))

pack() {  # pack DEST_PREFIX DIR...: tar.gz of the given folders, split; prints the part count
  local dest="$1"; shift
  local tmp; tmp="$(mktemp)"
  tar -czf "$tmp" -P "$@"
  local size; size=$(stat -c %s "$tmp")
  local parts=$(( (size + PART_BYTES - 1) / PART_BYTES ))
  if [ "$parts" -le "$MAX_PARTS" ]; then
    split -b "$PART_BYTES" -d -a 2 "$tmp" "$dest"
  fi
  rm -f "$tmp"
  echo "$parts"
}

case "${1:-}" in
  save)
    [ $# -ge 2 ] && [ $# -le 3 ] || die "usage: $0 save OUT_DIR [MAX_PARTS]"
    OUT_DIR="$2"; MAX_PARTS="${3:-3}"
    mkdir -p "$OUT_DIR"
    dirs=()
    [ -d "$TRITON_DIR" ] && dirs+=("$TRITON_DIR")
    [ -d "$FI_DIR" ] && dirs+=("$FI_DIR")
    [ ${#dirs[@]} -gt 0 ] || { echo "device_jit_cache: no compiled kernels to save"; exit 0; }
    n=$(pack "$OUT_DIR/jit-cache.part-" "${dirs[@]}")
    if [ "$n" -gt "$MAX_PARTS" ] && [ -d "$TRITON_DIR" ] && [ ${#dirs[@]} -gt 1 ]; then
      echo "device_jit_cache: Triton and FlashInfer take $n parts (> $MAX_PARTS): Triton alone"
      n=$(pack "$OUT_DIR/jit-cache.part-" "$TRITON_DIR")
    fi
    if [ "$n" -gt "$MAX_PARTS" ]; then
      echo "device_jit_cache: the Triton cache alone takes $n parts (> $MAX_PARTS): nothing saved"
      exit 0
    fi
    echo "device_jit_cache: saved $n part(s) to $OUT_DIR"
    ;;
  restore)
    [ $# -eq 2 ] || die "usage: $0 restore DIR"
    shopt -s nullglob
    parts=("$2"/jit-cache.part-*)
    [ ${#parts[@]} -gt 0 ] || die "no jit-cache.part-* in $2 (were they carried?)"
    cat "${parts[@]}" | tar -xzf - -P
    echo "device_jit_cache: restored ${#parts[@]} part(s) from $2"
    ;;
  *) die "usage: $0 save OUT_DIR [MAX_PARTS] | restore DIR" ;;
esac
