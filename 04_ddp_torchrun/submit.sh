#!/bin/bash
# Step 04 under Slurm: srun starts one torchrun per node, and each torchrun one process per GPU of
# its node. Submit from the repository root; flags after the script go to train.py:
#   sbatch 04_ddp_torchrun/submit.sh --epochs 3
# For your cluster change the #SBATCH lines below (nodes, GPUs per node, cores, time; add
# --partition/--account if your site needs them) and the environment line. Options on the sbatch
# command line override these lines, e.g. a CPU-only run on two nodes, two processes on each:
#   sbatch --gpus-per-node=0 --cpus-per-task=2 04_ddp_torchrun/submit.sh --dataset synthetic
# Environment: NPROC_PER_NODE (default: the node's GPUs, or 2), GPU_DEVICES (see below),
# MAX_RESTARTS (default 3), RDZV_PORT (default: see below), PYTHON (default: python on PATH),
# TRAIN_PY.
#SBATCH --job-name=ddp-torchrun     # shown by squeue; the %x in the log name
#SBATCH --nodes=2                   # machines
#SBATCH --ntasks-per-node=1         # one task per machine: torchrun, which starts the processes
#                                   # (05: one per GPU)
#SBATCH --gpus-per-node=4           # GPUs per machine: torchrun starts one process for each
#SBATCH --cpus-per-task=32          # cores per machine, shared by its processes' threads and
#                                   # data-loader workers
#                                   # For --cpus-per-gpu instead, delete this line (sbatch
#                                   # refuses both)
#SBATCH --time=01:00:00             # wall-clock limit; no --signal: this train.py has no handler
#                                   # (see below)
#SBATCH --requeue                   # a preempted (or `scontrol requeue`d) job goes back to the
#                                   # queue
#SBATCH --open-mode=append          # a requeued job appends to its log instead of overwriting it
#SBATCH --output=%x-%j.out          # one log per job (stdout and stderr): job name and job id
set -euo pipefail

# Environment: activate yours here if the job does not inherit it (module load ..., source
# .venv/bin/activate).
PYTHON=${PYTHON:-python}
TRAIN_PY=${TRAIN_PY:-04_ddp_torchrun/train.py}  # relative to the folder sbatch was called from

# torchrun starts the processes, so Slurm must start exactly one torchrun per node.
if [[ ${SLURM_NTASKS:-$SLURM_NNODES} != "$SLURM_NNODES" ]]; then
  echo "error: $SLURM_NTASKS tasks on $SLURM_NNODES nodes: this script wants one task per node" \
    "(--ntasks-per-node=1); torchrun starts one process per GPU (05_ddp_slurm/submit.sh wants" \
    "a task per GPU)" >&2
  exit 1
fi
# One process per GPU of a node as a job step sees them, not this script: under --exclusive it may
# see all of the node's while a step has those asked for. A step on every node says:
# SLURM_GPUS_ON_NODE (unset: 0) if the job asked about GPUs (any SLURM_GPUS* variable), else its
# GPU device files (no gres; GPU_DEVICES and a number; empty: none). The most of any node (a node
# with fewer fails the check below); 2 processes on nodes without GPUs.
export GPU_DEVICES=${GPU_DEVICES-/dev/nvidia}
GPUS=$(srun --ntasks-per-node=1 bash -c 'shopt -s nullglob
  devices=(${GPU_DEVICES:+$GPU_DEVICES[0-9]*})
  compgen -v SLURM_GPUS >/dev/null && echo "${SLURM_GPUS_ON_NODE:-0}" || echo "${#devices[@]}"' |
  sort -n | sed -n '$p')
NPROC_PER_NODE=${NPROC_PER_NODE:-$((GPUS > 0 ? GPUS : 2))}
# The task's cores are shared by its processes, and each process's share is split so that nothing
# runs on top of anything else: data-loader workers (one core each) and its threads. Half are
# workers (32 cores and 4 processes: 4 workers and 4 threads each; fewer cores than processes:
# none), or as many as --workers N after the script says, and the threads get the rest (at least
# one). The cores: whichever Slurm set, --cpus-per-task, --cpus-per-gpu (times the GPUs), or else
# the node's share (all of it under --exclusive).
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

# c10d rendezvous: the torchrun on the job's first node hosts it, the others connect, and it gives
# out the node ranks, so every node runs the same command line and nothing is expanded per node.
# sed, not head, reads all the names: under pipefail, head's early exit could kill scontrol with
# SIGPIPE.
RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
# Its port: the first from 20000 + job id mod 12000 that no process listens on now on that node,
# where sbatch runs this script (why so, and its one race: 04_ddp_torchrun/README.md, Under Slurm),
# probed in bash, as the host may have no Python (it may live in the container only). Export
# RDZV_PORT to choose.
RDZV_PORT=${RDZV_PORT:-$(for ((i = 0; i < 12000; i++)); do
  port=$((20000 + (SLURM_JOB_ID + i) % 12000))
  (: </dev/tcp/127.0.0.1/$port) 2>/dev/null || { echo $port; break; }; done)}
# One process per GPU that CUDA finds on every node, checked there in seconds before torchrun
# starts: a node whose driver is down would train on the CPU, NPROC_PER_NODE other than its GPUs
# leave some idle or shared. (In a container, add its flags to this srun line too.)
if ((GPUS > 0)); then
  srun --ntasks-per-node=1 "$PYTHON" -c "import socket, sys, torch
found = torch.cuda.device_count() if torch.cuda.is_available() else 0
sys.exit(found != $NPROC_PER_NODE and f'error: {socket.gethostname()}: CUDA finds {found} of its'
         ' $GPUS GPUs for $NPROC_PER_NODE processes: one process per working GPU (nvidia-smi)')"
fi
# After a restart, workers that share torchrun's own rendezvous store can read the previous round's
# addresses and fail or hang (pytorch/pytorch#135712; README.md says how often our restart test
# did).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# Checkpoints in checkpoints/ of the submit folder (train.py takes a relative --checkpoint as the
# submit folder's), made here on the host: a container that lacks its mount would make it in the
# image's throwaway files.
mkdir -p "$SLURM_SUBMIT_DIR/checkpoints"

echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: nodes $SLURM_JOB_NODELIST," \
  "$NPROC_PER_NODE processes per node ($GPUS GPUs, $CPUS cores), rendezvous $RDZV_HOST:$RDZV_PORT"
# Preemption, `scontrol requeue` and the time limit stop the processes where they are (torchrun
# forwards SIGTERM and dies of SIGUSR2; this train.py handles neither): a requeued job resumes
# after the last epoch that ended, one at its time limit ends (04_ddp_torchrun/README.md, A Slurm
# stop). 05 saves inside an epoch. srun -c: Slurm 22.05 to 23.02 do not pass sbatch's
# --cpus-per-task on to srun. --kill-on-bad-exit: when one torchrun fails (its restarts used up),
# srun ends the others instead of leaving them waiting. --max-restarts: when a process fails,
# torchrun restarts them all on every node; they resume from --checkpoint, fixed per job. Pass
# --checkpoint to choose it.
srun --kill-on-bad-exit=1 --cpus-per-task="$CPUS" \
  "$PYTHON" -m torch.distributed.run --nnodes="$SLURM_NNODES" --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \
  --max-restarts="${MAX_RESTARTS:-3}" "$TRAIN_PY" --workers "$WORKERS" \
  --checkpoint "checkpoints/$SLURM_JOB_NAME-$SLURM_JOB_ID.pt" "$@"
