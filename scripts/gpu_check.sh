#!/usr/bin/env bash
# The CUDA path checked on a GPU machine in one call (benchmarks/gpu_check.py says what and what must travel):
#   bash scripts/gpu_check.sh OUT_DIR
# Writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.md; takes a few minutes on an H100/H200.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 "${PYTHON:-python3}" benchmarks/gpu_check.py "$out" --device cuda
