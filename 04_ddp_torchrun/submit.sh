#!/bin/bash
# Step 04 under Slurm: srun starts one torchrun per node, and each torchrun one process per GPU of
# its node. Submit from the repository root; flags after the script go to train.py:
#   sbatch 04_ddp_torchrun/submit.sh --epochs 3
# For your cluster change the #SBATCH lines (add --partition/--account if your site needs them) and
# the environment line. sbatch's own options override them, e.g. a CPU run, 2 processes a node:
#   sbatch --gpus-per-node=0 --cpus-per-task=2 04_ddp_torchrun/submit.sh --dataset synthetic
# Environment: NPROC_PER_NODE, MAX_RESTARTS (3), RDZV_PORT, PYTHON, TRAIN_PY (04's page).
#SBATCH --job-name=ddp-torchrun     # shown by squeue; the %x in the log name
#SBATCH --nodes=2                   # machines
#SBATCH --ntasks-per-node=1         # one task per machine: torchrun, which starts the processes
#SBATCH --gpus-per-node=4           # GPUs per machine: torchrun starts one process for each
#SBATCH --cpus-per-task=32          # cores per machine, for all its processes (or --cpus-per-gpu)
#SBATCH --time=01:00:00             # wall-clock limit; no --signal: this train.py has no handler
#SBATCH --requeue                   # a preempted job goes back to the queue
#SBATCH --open-mode=append          # a requeued job appends to its log
#SBATCH --output=%x-%j.out          # one log per job (stdout and stderr): job name and job id
set -euo pipefail

# Environment: activate yours here if the job does not inherit it (module load, a venv).
PYTHON=${PYTHON:-python}
TRAIN_PY=${TRAIN_PY:-04_ddp_torchrun/train.py}  # relative to the folder sbatch was called from

if [[ ${SLURM_NTASKS:-$SLURM_NNODES} != "$SLURM_NNODES" ]]; then
  echo "error: $SLURM_NTASKS tasks on $SLURM_NNODES nodes: one per node (--ntasks-per-node=1)" >&2
  exit 1
fi
# Each node's GPUs as a job step sees them: Slurm's count where the job asked about GPUs, else the
# device files (no gres); none under CUDA_VISIBLE_DEVICES=. The most of any node.
export GPU_DEVICES=${GPU_DEVICES-/dev/nvidia}  # the tests' stand-ins
GPUS=$(srun --ntasks-per-node=1 bash -c 'shopt -s nullglob
  devices=(${GPU_DEVICES:+$GPU_DEVICES[0-9]*})
  [[ ${CUDA_VISIBLE_DEVICES-unset} == "" ]] && devices=()
  compgen -v SLURM_GPUS >/dev/null && echo "${SLURM_GPUS_ON_NODE:-0}" || echo "${#devices[@]}"' |
  sort -n | sed -n '$p')
NPROC_PER_NODE=${NPROC_PER_NODE:-$((GPUS > 0 ? GPUS : 2))}
# The node's cores (as 05's submit.sh finds a task's), split among its processes, each share into
# data-loader workers (half, or --workers N) and threads (the rest, at least one).
CPUS=${SLURM_CPUS_PER_TASK:-$((${SLURM_CPUS_PER_GPU:-0} * GPUS))}
((CPUS > 0)) || CPUS=$SLURM_CPUS_ON_NODE
CORES=$((CPUS / NPROC_PER_NODE > 0 ? CPUS / NPROC_PER_NODE : 1))
WORKERS=$((CORES / 2))
previous=""
for arg in "$@"; do
  [[ $previous == --workers ]] && WORKERS=$arg
  [[ $arg == --workers=* ]] && WORKERS=${arg#*=}
  previous=$arg
done
export OMP_NUM_THREADS=$((CORES > WORKERS ? CORES - WORKERS : 1))
# Rendezvous on the job's first node, at the first port from 20000 + job id mod 12000 that nothing
# listens on there (04's page). In bash: the host may have no Python. sed, not head: pipefail.
RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
port_taken() { (: </dev/tcp/127.0.0.1/"$1") 2>/dev/null; }
RDZV_PORT=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 12000))}
while port_taken "$RDZV_PORT"; do RDZV_PORT=$((RDZV_PORT + 1)); done
# One process per GPU that CUDA finds on every node: a dead driver would train on the CPU.
if ((GPUS > 0)); then
  srun --ntasks-per-node=1 "$PYTHON" -c "import socket, sys, torch
found = torch.cuda.device_count() if torch.cuda.is_available() else 0
sys.exit(found != $NPROC_PER_NODE and f'error: {socket.gethostname()}: CUDA finds {found} of its'
         ' $GPUS GPUs for $NPROC_PER_NODE processes: one process per working GPU (nvidia-smi)')"
fi
# Restarted workers can read the last round's addresses and hang (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
mkdir -p "$SLURM_SUBMIT_DIR/checkpoints"  # on the host: a container may lack the mount

echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: nodes $SLURM_JOB_NODELIST," \
  "$NPROC_PER_NODE processes per node ($GPUS GPUs, $CPUS cores), rendezvous $RDZV_HOST:$RDZV_PORT"
# A stop resumes from the last epoch's end (04's page). -c: Slurm 22.05-23.02 do not pass it on.
# --kill-on-bad-exit: one torchrun failed for good ends the others. A container: its flags here.
srun --kill-on-bad-exit=1 --cpus-per-task="$CPUS" \
  "$PYTHON" -m torch.distributed.run --nnodes="$SLURM_NNODES" --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \
  --max-restarts="${MAX_RESTARTS:-3}" "$TRAIN_PY" --workers "$WORKERS" \
  --checkpoint "checkpoints/$SLURM_JOB_NAME-$SLURM_JOB_ID.pt" "$@"
