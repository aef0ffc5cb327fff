#!/usr/bin/env bash
# Step 01: one process on one device (the GPU if there is one, else the CPU).
# Flags go to train.py; PYTHON picks the interpreter (default: python on PATH). For example:
#   bash 01_single_gpu/run.sh --epochs 3 --checkpoint ckpt01.pt
#   bash 01_single_gpu/run.sh --dataset synthetic --epochs 1
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/train.py" "$@"
