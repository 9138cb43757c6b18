#!/usr/bin/env bash
# README's first command on a CPU-only machine (the install half; CI runs it as written):
# torch's CPU build, this project with its research, test and bench extras, and SGLang for the
# plugin tests (scripts/install_sglang_cpu.sh). A torch already installed is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="torch==2.13.0"  # the build CI tests
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
python -m pip install -q -e ./sgl-kernel-ext -e ".[research,test,bench]"
bash scripts/install_sglang_cpu.sh
