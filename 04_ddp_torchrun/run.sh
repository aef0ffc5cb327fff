#!/usr/bin/env bash
# Step 04: torchrun starts one process per GPU (2 on a CPU) and restarts them all if one fails.
# Flags go to train.py. One machine:
#   bash 04_ddp_torchrun/run.sh --epochs 3 --checkpoint ckpt04.pt
# Several machines: run the same command on every one of them, with the first one's address
# (rendezvous through torchrun's c10d backend; the checkpoint path must be on shared storage):
#   NNODES=2 RDZV_ENDPOINT=node1:29400 bash 04_ddp_torchrun/run.sh --checkpoint /shared/ckpt.pt
# Under Slurm, sbatch 04_ddp_torchrun/submit.sh does this: srun starts one torchrun on every node
# of the job. Environment: NPROC_PER_NODE (default: GPUs, or 2), MAX_RESTARTS (default 0: fail at
# once), RDZV_ID (a name the nodes of one run share), PYTHON (default: python on PATH).
set -euo pipefail
python=${PYTHON:-python}
nproc=${NPROC_PER_NODE:-$("$python" -c 'import torch; print(torch.cuda.device_count() or 2)')}
if [[ ${NNODES:-1} == 1 ]]; then
  rendezvous=(--standalone)  # one machine: torchrun picks a free local port
else
  rendezvous=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-id="${RDZV_ID:-ddp-ladder}"
              --rdzv-endpoint="${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the first node}")
fi
# After a restart, workers that share torchrun's own rendezvous store can read the previous round's
# addresses and fail or hang (pytorch/pytorch#135712; how often our test did: tests/RESULTS.md).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# python -m torch.distributed.run is torchrun, run by the chosen interpreter.
exec "$python" -m torch.distributed.run "${rendezvous[@]}" --nproc-per-node="$nproc" \
  --max-restarts="${MAX_RESTARTS:-0}" "$(dirname "$0")/train.py" "$@"
