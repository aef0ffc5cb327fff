#!/usr/bin/env bash
# Step 03: the script spawns one process per GPU (2 on a CPU; --world-size N to choose).
# Flags go to train.py; PYTHON picks the interpreter (default: python on PATH). For example:
#   bash 03_ddp_mpspawn/run.sh --epochs 3 --checkpoint ckpt03.pt
#   bash 03_ddp_mpspawn/run.sh --dataset synthetic --epochs 1
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/train.py" "$@"
