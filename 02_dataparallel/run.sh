#!/usr/bin/env bash
# Step 02: one process drives all local GPUs through nn.DataParallel.
# Flags go to train.py; PYTHON picks the interpreter (default: python on PATH). For example:
#   bash 02_dataparallel/run.sh --epochs 3 --checkpoint ckpt02.pt
#   bash 02_dataparallel/run.sh --dataset synthetic --epochs 1
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/train.py" "$@"
