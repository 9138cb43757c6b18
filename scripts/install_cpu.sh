#!/usr/bin/env bash
# README's first command on a CPU-only machine (the install half; CI runs it as written):
# torch's CPU build, this project with its research, test and bench extras, and SGLang for
# the plugin tests (scripts/install_sglang_cpu.sh; SGLANG_VERSION=0.5.23 for that release).
# A torch already installed is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
# SGLANG_VERSION: the SGLang release the plugin tests run against (0.5.17, what CI tests,
# or 0.5.23), with the torch its wheel pins.
case "${SGLANG_VERSION:=0.5.17}" in
  0.5.17) TORCH="torch==2.13.0" ;;  # the build CI tests (SGLang 0.5.17 pins 2.11.0)
  0.5.23) TORCH="torch==2.14.1" ;;
  *) echo "install_cpu: SGLANG_VERSION is 0.5.17 or 0.5.23, not $SGLANG_VERSION" >&2; exit 2 ;;
esac
export SGLANG_VERSION
CPU_INDEX="https://download.pytorch.org/whl/cpu"
if python -c "import torch" 2>/dev/null; then
  echo "install_cpu: keeping torch $(python -c 'import torch; print(torch.__version__)')" >&2
elif python -c "import urllib.request as u; u.urlopen('$CPU_INDEX/', timeout=15)" 2>/dev/null; then
  python -m pip install -q "$TORCH" --index-url "$CPU_INDEX"
else
  # PyPI alone: on x86-64 Linux its torch is the CUDA build, which runs on a CPU too but
  # downloads about 2.5 GB more (NVIDIA libraries).
  echo "install_cpu: $CPU_INDEX is unreachable; torch from PyPI" >&2
  python -m pip install -q "$TORCH"
fi
# The project goes in the same pip resolution as the SGLang release's pins: installed apart,
# its unpinned `transformers` resolves to the newest release first, whose hard dependencies
# (e.g. transformers 5.25's `kernels` 0.19) stay behind when the pins then downgrade it and
# break the pinned release's import.
bash scripts/install_sglang_cpu.sh -e ./sgl-kernel-ext -e ".[research,test,bench]"
