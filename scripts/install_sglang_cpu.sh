#!/usr/bin/env bash
# SGLang 0.5.17 on a CPU-only machine, for the plugin tests (flags, --help, hook targets,
# admission): its wheel pins a CUDA torch, so it goes in without dependencies and the
# pure-Python packages its modules import come from test/requirements-sglang-cpu.txt.
# test/conftest.py supplies a stub for torchvision, which SGLang imports at load time
# and which has no CPU wheel matching torch 2.13.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r test/requirements-sglang-cpu.txt
python -m pip install -q --no-deps "sglang==0.5.17"
