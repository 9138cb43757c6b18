#!/usr/bin/env bash
# What every GPU-machine run starts with: the project's pure-Python deps that the
# bare GPU host lacks (carried as wheels in .whl/), then the path to this checkout.
# Usage on the device: source scripts/gpu_check.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel-ext
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
