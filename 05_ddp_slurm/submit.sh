#!/bin/bash
# Step 05: DDP under Slurm. Submit from the repository root; flags after the script go to train.py:
#   sbatch 05_ddp_slurm/submit.sh --epochs 3
# For your cluster change the #SBATCH lines below (nodes, GPUs per node and the tasks that match
# them, cores, time; add --partition/--account if your site needs them) and the environment line.
# Options on the sbatch command line override these lines, e.g. a CPU-only run on two nodes:
#   sbatch --gpus-per-node=0 --nodes=2 --ntasks-per-node=1 --cpus-per-task=2 \
#     05_ddp_slurm/submit.sh --dataset synthetic
#SBATCH --job-name=ddp-slurm        # shown by squeue; the %x in the log name
#SBATCH --nodes=2                   # machines
#SBATCH --ntasks-per-node=4         # processes per machine: one per GPU, so equal to
#                                   # --gpus-per-node
#SBATCH --gpus-per-node=4           # GPUs per machine; task N of a machine takes its GPU N
#SBATCH --cpus-per-task=8           # cores per process: its threads and its data-loader workers
#                                   # For --cpus-per-gpu instead, delete this line (sbatch
#                                   # refuses both)
##SBATCH --mem-per-gpu=32G          # memory per GPU, so per task: delete one '#' where the default
#                                   # per core is too small
#SBATCH --time=01:00:00             # wall-clock limit
#SBATCH --signal=USR2@120           # SIGUSR2 to every task 120 s before the limit: save, and
#                                   # requeue (below).
#                                   # Not B:USR2 (a site template's): that signals only this
#                                   # script, which dies of it. The lead must exceed an optimizer
#                                   # step (all --accumulate micro-batches) and a save
#SBATCH --requeue                   # the job may go back to the queue (after a stop, when
#                                   # preempted, a node fails)
#SBATCH --open-mode=append          # a requeued job appends to its log instead of overwriting it
#SBATCH --output=%x-%j.out          # one log per job (stdout and stderr): job name and job id
set -euo pipefail

# Environment: activate yours here if the job does not inherit it (module load ..., source
# .venv/bin/activate).
PYTHON=${PYTHON:-python}
TRAIN_PY=${TRAIN_PY:-05_ddp_slurm/train.py}  # relative to the folder sbatch was called from

# Rendezvous on the job's first node, where sbatch runs this script, at the first port from 20000 +
# job id mod 12000 that no process holds here now (04's search: 04_ddp_torchrun/README.md, Under
# Slurm). Export MASTER_PORT to choose one. In bash, not Python: the host may have none (Python
# only in the container). A port that no process listens on is free, one that an earlier job left
# in TIME_WAIT (a requeue) too. sed, not head, reads all the node names: under pipefail, head's
# early exit could kill scontrol with SIGPIPE on a long list, and this script.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
MASTER_PORT=${MASTER_PORT:-$(for ((i = 0; i < 12000; i++)); do
  port=$((20000 + (SLURM_JOB_ID + i) % 12000))
  (: </dev/tcp/127.0.0.1/$port) 2>/dev/null || { echo $port; break; }; done)}
export MASTER_ADDR MASTER_PORT
export REQUEUE_ON_144=1  # for train.py's stop line: this script requeues on 144 (srun by hand: no)
# The task's cores, split so that nothing runs on top of anything else: data-loader workers (one
# core each) and the main process's threads. Half are workers (8 cores: 4 workers, 4 threads; 1:
# none), or as many as --workers N after the script says, and the threads get the rest (at least
# one). The cores: whichever Slurm set, --cpus-per-task, --cpus-per-gpu (a task has one GPU), or
# else the node's share (all of it under --exclusive).
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
# Checkpoints by absolute path, in a folder made here on the host: tasks in a container whose
# working folder is another, or where this folder is not mounted, would write into the image's
# throwaway files (train.py refuses a missing folder). Export CHECKPOINT_DIR to choose another.
# Data: copy it to node-local disk here if you need to, once per node (then --data-dir
# "${TMPDIR:-/tmp}/data"):
#   srun --ntasks-per-node=1 --ntasks="$SLURM_NNODES" cp -r data "${TMPDIR:-/tmp}/"
CHECKPOINT_DIR=${CHECKPOINT_DIR:-$SLURM_SUBMIT_DIR/checkpoints}
mkdir -p "$CHECKPOINT_DIR"

echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: nodes $SLURM_JOB_NODELIST," \
  "$SLURM_NTASKS tasks of $CPUS cores, master $MASTER_ADDR:$MASTER_PORT"
# srun -c: Slurm 22.05 to 23.02 do not pass sbatch's --cpus-per-task on to srun. --wait=30 ends
# the other tasks 30 s after the first one ends, instead of leaving them in a collective;
# --kill-on-bad-exit=0 keeps a site's KillOnBadExit=1 from killing them at the first 144 before
# they leave (05_ddp_slurm/README.md says more).
# The checkpoint path is fixed per job, so a requeued job (same id) resumes; pass --checkpoint to
# choose it.
# A container: its flags (pyxis: --container-image=..., --container-mounts=...) on this srun line
# alone, with PYTHON set to its python; mount the submit folder at the same path. Start python
# itself (or exec it), not under a wrapper (bash -c, time, numactl) that dies of the signal.
# Every task sees all of its node's GPUs here. A site that binds GPUs per task fences them off
# from each other, and NCCL cannot use NVLink between tasks: on Slurm 23.11.4 or later add
# --gres-flags=allow-task-sharing to this srun line (untested here; 05's page, GPU binding).
status=0
srun --kill-on-bad-exit=0 --wait=30 --cpus-per-task="$CPUS" \
  "$PYTHON" -u "$TRAIN_PY" --workers "$WORKERS" \
  --checkpoint "$CHECKPOINT_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID.pt" "$@" || status=$?
# The last step of a stop (train.py's "stopping inside an epoch" lists them all): the tasks
# stopped on a signal and rank 0 saved where, so they exit with 144 (REQUEUE_EXIT_CODE). SIGUSR2
# comes before the time limit; SIGTERM from a preemption, which Slurm sends to the tasks alone and
# which ends the job for good once it leaves by itself. So this script, on the host, puts the job
# back in the queue (train.py runs no Slurm command: a container may have none), and it starts
# again under the same id and resumes. A scancel sends SIGTERM to this script too, which ends it
# at once: a cancelled job stays cancelled, its tasks still save, and a new job resumes with
# --checkpoint checkpoints/ddp-slurm-JOBID.pt (under the submit folder).
if ((status == 144)); then
  echo "job $SLURM_JOB_ID: its tasks stopped and saved: requeueing it"
  exec scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
