#!/bin/bash
# Step 05: DDP under Slurm. Submit from the repository root; flags after the script go to train.py:
#   sbatch 05_ddp_slurm/submit.sh --epochs 3
# For your cluster change the #SBATCH lines (add --partition/--account if your site needs them) and
# the environment line. sbatch's own options override them, e.g. a CPU run on two nodes:
#   sbatch --gpus-per-node=0 --nodes=2 --ntasks-per-node=1 --cpus-per-task=2 \
#     05_ddp_slurm/submit.sh --dataset synthetic
#SBATCH --job-name=ddp-slurm        # shown by squeue; the %x in the log name
#SBATCH --nodes=2                   # machines
#SBATCH --ntasks-per-node=4         # processes per machine: one per GPU
#SBATCH --gpus-per-node=4           # GPUs per machine; task N of a machine takes its GPU N
#SBATCH --cpus-per-task=8           # cores per process (or delete it for --cpus-per-gpu)
##SBATCH --mem-per-gpu=32G          # memory per GPU: delete one '#' if the default is too small
#SBATCH --time=01:00:00             # wall-clock limit
#SBATCH --signal=USR2@120           # SIGUSR2 to every task 120 s before the limit: save, requeue.
#                                   # Not B:USR2: that signals only this script, which dies of it
#SBATCH --requeue                   # the job may go back to the queue
#SBATCH --open-mode=append          # a requeued job appends to its log
#SBATCH --output=%x-%j.out          # one log per job (stdout and stderr): job name and job id
set -euo pipefail

# Environment: activate yours here if the job does not inherit it (module load, a venv).
PYTHON=${PYTHON:-python}
TRAIN_PY=${TRAIN_PY:-05_ddp_slurm/train.py}  # relative to the folder sbatch was called from

# Rendezvous on the job's first node, where this script runs, at the first port from 20000 + job id
# mod 12000 that nothing listens on (other jobs' there: 04's page, Under Slurm). In bash: the host
# may have no Python. sed, not head: under pipefail, head's early exit could kill scontrol.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
port_taken() { (: </dev/tcp/127.0.0.1/"$1") 2>/dev/null; }
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 12000))}  # export MASTER_PORT to choose
while port_taken "$MASTER_PORT"; do MASTER_PORT=$((MASTER_PORT + 1)); done
export MASTER_ADDR MASTER_PORT
export REQUEUE_ON_144=1  # for train.py's stop line: this script requeues on 144
# The task's cores: half for data-loader workers (or --workers N), the rest for its threads. Slurm
# sets --cpus-per-task's, else --cpus-per-gpu's, else the node's share.
TASKS=${SLURM_TASKS_PER_NODE%%[(,]*}  # this node's: "4(x2),2" gives 4
CPUS=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_PER_GPU:-$((SLURM_CPUS_ON_NODE / TASKS))}}
WORKERS=$((CPUS / 2))
previous=""
for arg in "$@"; do
  [[ $previous == --workers ]] && WORKERS=$arg
  [[ $arg == --workers=* ]] && WORKERS=${arg#*=}
  previous=$arg
done
export OMP_NUM_THREADS=$((CPUS > WORKERS ? CPUS - WORKERS : 1))
# Checkpoints by absolute path in a folder made here, on the host: a container without this mount
# would save into its throwaway files. Data: stage it on node-local disk here if you need to, once
# per node: srun --ntasks-per-node=1 --ntasks="$SLURM_NNODES" cp -r data "${TMPDIR:-/tmp}/"
CHECKPOINT_DIR=${CHECKPOINT_DIR:-$SLURM_SUBMIT_DIR/checkpoints}
mkdir -p "$CHECKPOINT_DIR"

echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: nodes $SLURM_JOB_NODELIST," \
  "$SLURM_NTASKS tasks of $CPUS cores, master $MASTER_ADDR:$MASTER_PORT"
# -c: Slurm 22.05 to 23.02 do not pass sbatch's --cpus-per-task on. --wait=30 ends the others 30 s
# after the first task ends; --kill-on-bad-exit=0: a site's KillOnBadExit=1 would kill them at the
# first 144. A container: its flags on this line, PYTHON its python (05's page).
status=0
srun --kill-on-bad-exit=0 --wait=30 --cpus-per-task="$CPUS" \
  "$PYTHON" -u "$TRAIN_PY" --workers "$WORKERS" \
  --checkpoint "$CHECKPOINT_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID.pt" "$@" || status=$?
# 144: the tasks stopped on a signal and rank 0 saved (train.py's stop path). This script, on the
# host, requeues the job (a container may have no scontrol), which resumes under the same id. A
# scancel ends this script at once: the tasks save, and the job stays cancelled.
if ((status == 144)); then
  echo "job $SLURM_JOB_ID: its tasks stopped and saved: requeueing it"
  exec scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
