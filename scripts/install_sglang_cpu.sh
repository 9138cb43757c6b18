#!/usr/bin/env bash
# SGLang on a CPU-only machine, for the plugin tests (flags, --help, hook targets,
# admission): SGLANG_VERSION picks the release, 0.5.17 (the default) or
# 0.5.23 (CI installs it over 0.5.17 for the `sglang`-marked tests); the plugin supports
# both (python/sglang_psa/plugin/hooks.py). Its wheel pins a
# CUDA torch, so it goes in without dependencies and the pure-Python packages its modules
# import come from test/requirements-sglang-$SGLANG_VERSION-cpu.txt.
# Arguments are more pip requirements, resolved in the same pip call as those pins
# (install_cpu.sh passes the project: see why there).
# test/conftest.py supplies a stub for torchvision, which SGLang imports at load time
# and which has no CPU wheel matching torch 2.13.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION="${SGLANG_VERSION:-0.5.17}"
REQS="test/requirements-sglang-$SGLANG_VERSION-cpu.txt"
[ -f "$REQS" ] || { echo "install_sglang_cpu: SGLang $SGLANG_VERSION is not supported (no $REQS)" >&2; exit 2; }
python -m pip install -q -r "$REQS" "$@"
python -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
