"""Step 06: DDP submitted from Python with submitit, to Slurm or to processes on this machine.

Run:  python 06_ddp_submitit/train.py --nodes 2 --gpus-per-node 4 --cpus-per-task 8 --epochs 3
      python 06_ddp_submitit/train.py --local --dataset synthetic   (no cluster needed)

Changed since 05: no batch script of ours: this file submits itself through submitit, which
writes one (with 05's requeue), prints the job's log folder and waits for the job through its
requeues; run() runs in every task. Python 3.10 or later.
"""
import argparse
import importlib
import math
import multiprocessing.resource_tracker
import os
import signal
import socket
import sys
import time
from contextlib import nullcontext, suppress
from datetime import timedelta

# SLURM: a stop signal that comes during the imports below (seconds; more from a cold shared
# filesystem) waits, blocked, for catch_stop_signals(), instead of ending the task.
if "SUBMITIT_FOLDER" in os.environ:  # submitit: a task, which imports this file for run()
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGUSR2, signal.SIGTERM))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import submitit
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],  # names the step
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples per micro-batch in each process")
    parser.add_argument("--test-batch-size", type=int, default=1000,
                        help="samples per evaluation step in each process")
    parser.add_argument("--lr", type=float, default=0.01,
                        help="peak learning rate (make_optimizer: SGD, momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights, the data order and other randomness")
    parser.add_argument("--dataset", choices=["mnist", "synthetic"], default="mnist",
                        help="real MNIST, or MNIST-shaped data made in memory (no download)")
    parser.add_argument("--data-dir", default="data", help="folder that holds or receives MNIST")
    parser.add_argument("--workers", type=int,
                        help="data-loader worker processes per process "
                             "(None: half of the task's cores)")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="save after every epoch and at a stop; resume if PATH exists "
                             "(None: on Slurm checkpoints/ddp-submitit-JOBID.pt in the submit "
                             "folder; --local: none)")
    parser.add_argument("--log-interval", type=int, default=200,
                        help="steps between progress lines inside an epoch (0: none)")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches of --batch-size per optimizer step")
    parser.add_argument("--warmup", type=float, default=0,
                        help="fraction of the run in which the rate rises to --lr")
    parser.add_argument("--cosine", action="store_true",
                        help="then let the rate fall along a cosine to 0 at the end")
    parser.add_argument("--amp", action="store_true",
                        help="bf16 autocast (GPUs from Ampere on, real models)")
    parser.add_argument("--clip-grad", type=float, default=0, metavar="NORM",
                        help="scale the gradient down to this norm before each step (0: never)")
    parser.add_argument("--collective-timeout", type=float, default=600,
                        help="seconds a collective waits for a rank that stopped answering, "
                             "then ends the run")
    parser.add_argument("--save-every", type=float, default=30, metavar="MINUTES",
                        help="also save inside an epoch this often (0: never), for a job killed "
                             "without a warning")
    add_submission_flags(parser)  # submitit: the job's shape and the site's options
    args = parser.parse_args()
    minimums = dict(epochs=1, batch_size=1, test_batch_size=1, accumulate=1,  # --workers: below
                    log_interval=0, clip_grad=0, lr=0, collective_timeout=1, save_every=0)
    for flag, minimum in minimums.items():
        if not minimum <= getattr(args, flag) < math.inf:  # not NaN either
            parser.error(f"--{flag.replace('_', '-')} must be at least {minimum}, and finite")
    if not 0 <= args.warmup < 1:
        parser.error("--warmup must be at least 0 and below 1")
    check_submission_flags(parser, args)  # submitit
    return args


def add_submission_flags(parser):
    parser.add_argument("--local", action="store_true",
                        help="run the tasks as processes on this machine")
    parser.add_argument("--nodes", type=int, default=1, help="Slurm nodes")
    parser.add_argument("--gpus-per-node", type=int,
                        help="needed on Slurm (0: CPU, or GPUs that are not gres); --local: all")
    parser.add_argument("--tasks-per-node", type=int,
                        help="one per GPU (None: --gpus-per-node, or 2 without)")
    parser.add_argument("--cpus-per-task", type=int,
                        help="cores per process (None: as 05's submit.sh, those Slurm gives: "
                             "--sbatch cpus-per-gpu=N's, or the node's share; --local: 1)")
    parser.add_argument("--timeout-min", type=int, default=60,
                        help="time limit of the job in minutes")
    parser.add_argument("--sbatch", action="append", default=[], type=sbatch_option,
                        metavar="KEY[=VALUE]",
                        help="an sbatch option, as partition=P, account=A, qos=high, exclusive "
                             "(not one that a flag above sets)")
    parser.add_argument("--log-dir", default="submitit_logs",
                        help="every job gets a new log folder in here")


def sbatch_option(text):
    """submitit: --sbatch's KEY=VALUE as (key, value), KEY as (key, True); dashes as submitit's."""
    key, equals, value = text.lstrip("-").partition("=")
    return key.replace("_", "-"), value if equals else True


def check_submission_flags(parser, args):
    for flag in ["nodes", "tasks_per_node", "cpus_per_task", "timeout_min"]:
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.workers is not None and args.workers < 0:  # None: half of the task's cores (run())
        parser.error("--workers must be at least 0")
    if args.local and args.nodes > 1:
        parser.error("--local runs on 1 node")
    if not args.local and submitit.SlurmExecutor.affinity() < 0:  # submitit's test: no srun
        parser.error("no Slurm here (srun is not on PATH): submit from a login node, or --local")
    # submitit: the launcher often runs on a login node, whose GPUs (none) say nothing of the
    # compute nodes'.
    if args.gpus_per_node is None and not args.local:
        parser.error("--gpus-per-node is needed on Slurm: the GPUs of each compute node "
                     "(0 for CPU nodes)")
    if args.gpus_per_node is None:
        args.gpus_per_node = torch.cuda.device_count()
    args.tasks_per_node = args.tasks_per_node or args.gpus_per_node or 2
    if args.gpus_per_node and args.tasks_per_node != args.gpus_per_node:  # GPUs idle or shared
        parser.error(f"--tasks-per-node {args.tasks_per_node} for --gpus-per-node "
                     f"{args.gpus_per_node}: one per GPU")


# Your task replaces these, down to get_lr: data, model, loss and metric, optimizer, schedule.
def load_datasets(args):
    """Returns (train, test): datasets of (image, label) by index, as torchvision's (01's page)."""
    if args.dataset == "synthetic":
        # Each class is a fixed random pattern under noise, the same on every machine.
        generator = torch.Generator().manual_seed(1234)
        patterns = 2 * torch.randn(10, 1, 28, 28, generator=generator)
        labels = torch.randint(0, 10, (4_000,), generator=generator)
        images = patterns[labels] + torch.randn(len(labels), 1, 28, 28, generator=generator)
        return (TensorDataset(images[:3_200], labels[:3_200]),
                TensorDataset(images[3_200:], labels[3_200:]))
    from torchvision import datasets  # imported only for MNIST: it takes a second or more
    try:  # downloads what --data-dir lacks (torchvision checks the files first)
        splits = [datasets.MNIST(args.data_dir, train=train, download=True)
                  for train in (True, False)]
    except (OSError, RuntimeError) as error:  # no internet, as on many compute nodes
        reason = " ".join(str(error).split())  # torchvision's message spans lines
        sys.exit(f"error: MNIST is not in {args.data_dir} and could not be downloaded ({reason}); "
                 "fetch it on a machine with internet (01's page)")
    return [TensorDataset((split.data.unsqueeze(1) / 255 - 0.1307) / 0.3081, split.targets)
            for split in splits]


class Net(nn.Module):
    """A small CNN, smooth (SiLU, average pooling), without dropout or BatchNorm: 01's page."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.avg_pool2d(F.silu(self.conv1(x)), 2)
        x = F.avg_pool2d(F.silu(self.conv2(x)), 2)
        return self.fc2(F.silu(self.fc1(x.flatten(1))))


METRIC = "accuracy"  # the epoch line's name for metric sum / count


def loss_and_metric(output, target):
    """Returns (loss sum, metric sum, count) of a batch: sums over what the loss is a mean of
    (samples; tokens for a sequence model) add up exactly over batches and ranks."""
    loss = F.cross_entropy(output, target, reduction="sum")
    return loss, (output.argmax(dim=1) == target).sum(), len(target)


def make_optimizer(model, args):
    # AdamW and parameter groups with rates of their own work too: get_lr scales each group's.
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def get_lr(step, total_steps, peak_lr, args):
    """The rate at optimizer step `step` (from 0) of a group with peak_lr in make_optimizer."""
    warmup_steps = args.warmup * total_steps  # 0 without --warmup
    if step < warmup_steps:  # rises linearly
        return peak_lr * ((step + 1) / (warmup_steps + 1))
    if not args.cosine:  # then stays
        return peak_lr
    decay_fraction = min(1, (step - warmup_steps) / (total_steps - warmup_steps))  # or to 0
    return peak_lr * ((1 + math.cos(math.pi * decay_fraction)) / 2)


# SLURM: Slurm signals every task: SIGUSR2 before the time limit (submit.sh's --signal), SIGTERM
# on a preemption or a scancel. The ranks vote after each step (StopVote) and stop at the same one;
# stop_run() saves it and exits with REQUEUE_EXIT_CODE, on which submit.sh (06: its slurm_teardown)
# requeues the job, which resumes there (ResumableSampler).
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
REQUEUE_EXIT_CODE = 144  # of tasks that stopped and saved: submit.sh requeues the job
MAX_STALLED_RUNS = 3  # time-limit stops in a row before any progress: then no requeue
noted_stop_signals = []  # by the handler


def catch_stop_signals():
    """SLURM: a stop signal is noted from here on. Slurm signals the data-loader workers too,
    which have no handler under spawn or forkserver: blocked, the signal stays pending there."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: noted_stop_signals.append(signum))
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # The resource tracker, started later by a worker, would unblock SIGTERM: start it, re-block.
    multiprocessing.resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def stop_signal_received():
    """SLURM: the stop signal this process received (SIGTERM where both), or 0: pending where it is
    blocked, noted by the handler where it reached a thread without the block."""
    if noted_stop_signals:
        return max(noted_stop_signals)
    return max(signal.sigpending() & set(STOP_SIGNALS), default=0)


class StopVote:
    """SLURM: after every step (and evaluation batch) the ranks vote, on a CPU tensor that never
    waits for the GPU, whether any had a stop signal or is due a --save-every save."""

    def __init__(self, save_every_minutes, timeout):
        self.save_every_seconds = 60 * save_every_minutes  # 0: never
        # Its own group, which fails after --collective-timeout too, not after an hour.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self.votes, self.sent, self.seen_at = torch.zeros(2), None, None
        self.clock_start = time.monotonic()

    def start(self):  # --save-every counts from here; a signal that came before stops step 0
        self.clock_start = time.monotonic()
        self.send()

    def send(self):
        since_start = time.monotonic() - self.clock_start
        save_due = self.save_every_seconds > 0 and since_start >= self.save_every_seconds
        self.votes = torch.tensor([stop_signal_received(), save_due], dtype=torch.float64)
        # MAX: SIGTERM (15) where any rank had it, over SIGUSR2 (12).
        self.sent = dist.all_reduce(self.votes, dist.ReduceOp.MAX, self.group, async_op=True)

    def result(self):
        """Returns the last vote: (the stop signal any rank had or 0, whether a save is due)."""
        if self.sent:
            self.sent.wait()
            self.sent = None
        stop_signal, save_due = self.votes.tolist()
        if stop_signal and not self.seen_at:
            self.seen_at = time.monotonic()  # for the stop line
        return int(stop_signal), save_due > 0


class ResumableSampler(DistributedSampler):
    """SLURM: a DistributedSampler that skips the first `skip` indices of this rank's share (the
    steps trained before a stop); its length stays the whole epoch's."""
    skip = 0

    def set_epoch(self, epoch, skip=0):
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])


def start_progress(args, checkpointed, train_samples, gloo_group):
    """SLURM: loads the checkpoint, checks it (the end of this file) and returns where this run
    starts, as the plain data that a save stores."""
    resumed, load_error = load_checkpoint(args.checkpoint, checkpointed)
    if args.checkpoint:  # a site check: rank 0 writes a probe beside it, every rank reads it
        write_error = write_probe(args.checkpoint) if dist.get_rank() == 0 else None
        dist.barrier(group=gloo_group)  # DDP: written before any rank reads it
        load_error = load_error or write_error or probe_error(args.checkpoint)
    check_same_checkpoint(args.checkpoint, resumed, load_error, gloo_group)  # DDP: a site check
    if args.checkpoint and dist.get_rank() == 0:
        with suppress(FileNotFoundError):  # every rank read it (or another run removed it)
            os.remove(f"{args.checkpoint}.probe")
    global_batch = dist.get_world_size() * args.batch_size * args.accumulate
    sample_order = f"global batch {global_batch}, seed {args.seed}, {train_samples} samples"
    progress = dict(epoch=0, step=0, loss_sum=0.0, count=0.0, stalled_runs=0) | (resumed or {})
    saved_order = progress.get("sample_order", "an older train.py")
    if progress["step"] and saved_order != sample_order:  # inside an epoch
        exit_with_error(f"{args.checkpoint} stopped inside epoch {progress['epoch'] + 1} with "
                        f"{saved_order}, now {sample_order}: resume with those")
    restarted = int(os.environ.get("SLURM_RESTART_COUNT", 0)) > 0  # a requeue, not a new job
    progress.update(sample_order=sample_order, resumed_at=[progress["epoch"], progress["step"]],
                    stalled_runs=progress["stalled_runs"] if restarted else 0)
    if resumed and dist.get_rank() == 0:
        print(f"resumed from {args.checkpoint} at epoch {progress['epoch'] + 1} "
              f"step {progress['step']}", flush=True)
    elif args.checkpoint and dist.get_rank() == 0:  # a mistyped path would start over unseen
        print(f"no checkpoint at {os.path.abspath(args.checkpoint)}: starting at epoch 1",
              flush=True)
    return progress


def stop_run(args, checkpointed, progress, gloo_group, stop_signal, seen_at):
    """SLURM: rank 0 saves the step at which the ranks stopped and says what comes next. Returns
    the exit code: REQUEUE_EXIT_CODE, or 1 where a requeue cannot help."""
    # A time limit that start-up and the signal's lead use up would requeue the job for ever: its
    # stops where the run resumed are counted (a preemption's keep the count).
    if [progress["epoch"], progress["step"]] != progress["resumed_at"]:
        progress["stalled_runs"] = 0
    elif stop_signal == signal.SIGUSR2:
        progress["stalled_runs"] += 1
    began = time.monotonic()
    if args.checkpoint and dist.get_rank() == 0:
        save_checkpoint(args.checkpoint, checkpointed, progress)
    dist.barrier(group=gloo_group)  # DDP: the others wait until the checkpoint is complete
    saved = f"saved in {time.monotonic() - began:.1f} s"
    exit_code, outcome = REQUEUE_EXIT_CODE, "to be requeued"
    if not args.checkpoint:  # a requeue would start over
        saved, exit_code, outcome = "nothing saved", 1, "not requeued: no --checkpoint"
    elif progress["stalled_runs"] >= MAX_STALLED_RUNS:
        exit_code = 1
        outcome = (f"not requeued: {MAX_STALLED_RUNS} runs in a row made no step (raise the time "
                   "limit)")
    elif not os.environ.get("REQUEUE_ON_144"):  # set by submit.sh (06: by its launcher)
        outcome = "started without submit.sh: the same command resumes"
    if dist.get_rank() == 0:
        print(f"stopped at epoch {progress['epoch'] + 1} step {progress['step']} on "
              f"{signal.Signals(stop_signal).name} {time.monotonic() - seen_at:.1f} s after the "
              f"signal was seen, {saved}: exit code {exit_code}, {outcome}", flush=True)
    return exit_code


def periodic_save(args, checkpointed, progress, gloo_group):
    """SLURM: --save-every: rank 0 saves the step, for a job killed without a signal."""
    progress["stalled_runs"] = 0  # the run made progress
    if dist.get_rank() == 0:
        save_checkpoint(args.checkpoint, checkpointed, progress)
        print(f"saved at epoch {progress['epoch'] + 1} step {progress['step']} (--save-every "
              f"{args.save_every:g})", flush=True)
    dist.barrier(group=gloo_group)  # DDP: the others wait until it is complete


def make_loaders(args, rank, world_size, device, gloo_group):
    # Returns (train loader, test loader) of --dataset: this rank's share of each.
    if rank != 0:  # DDP: rank 0 loads the data first, downloading what is missing; the others next
        dist.barrier(group=gloo_group)
    train_set, test_set = load_datasets(args)
    if rank == 0:
        dist.barrier(group=gloo_group)
    # DDP: each rank takes every world_size-th index of the epoch's order, padded to equal steps.
    sampler = ResumableSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    # DDP: and every world_size-th test sample, not padded (exact sums), in equal batch counts.
    test_batches = min(math.ceil(len(test_set) / world_size / args.test_batch_size),
                       len(test_set) // world_size)  # no empty batch
    test_shard = torch.arange(rank, len(test_set), world_size).tensor_split(test_batches)
    loader_args = dict(num_workers=args.workers, pin_memory=device.type == "cuda",
                       persistent_workers=args.workers > 0)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, **loader_args)
    test_loader = DataLoader(test_set, batch_sampler=[batch.tolist() for batch in test_shard],
                             **loader_args)
    return train_loader, test_loader


def train_step(args, model, batches, micro_batches, optimizer, device, sums):
    """One optimizer step over the next micro_batches batches; adds to sums what they trained."""
    for micro_batch in range(micro_batches):
        inputs, targets = (tensor.to(device, non_blocking=True) for tensor in next(batches))
        # bf16 where autocast finds it safe (--amp). DDP: no_sync() skips the gradients'
        # all-reduce, which the last micro-batch's backward does.
        with (model.no_sync() if micro_batch < micro_batches - 1 else nullcontext(),
              torch.autocast(device.type, torch.bfloat16, enabled=args.amp)):
            loss_sum, _, count = loss_and_metric(model(inputs), targets)
        # The gradients add up to those of the mean of the micro-batches' mean losses.
        (loss_sum / count / micro_batches).backward()
        sums[0] += loss_sum.detach()  # stays on the device: no GPU sync per step
        sums[1] += count
        sums[2] += len(inputs)
    if args.clip_grad:  # the whole step's gradient, after its last backward (DDP: all-reduced)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_one_epoch(args, model, loader, optimizer, peak_lrs, device, progress, vote):
    """Trains progress["epoch"] from progress["step"] (SLURM) to its end or to the vote's stop;
    adds to progress what it trained. Returns the samples it trained."""
    model.train()
    epoch = progress["epoch"]
    # DDP: else each epoch repeats the first's order. SLURM: less the samples trained already.
    loader.sampler.set_epoch(epoch, skip=progress["step"] * args.batch_size * args.accumulate)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # [loss sum, count, samples]
    logged_sums, logged_at = sums.clone(), time.perf_counter()  # at the last progress line
    batches = iter(loader)  # draws the workers' seeds: from train()'s seeding, not a step's
    steps_per_epoch = math.ceil(len(loader) / args.accumulate)  # optimizer steps
    for step in range(progress["step"], steps_per_epoch):
        stop_signal, save_due = vote.result()  # SLURM: the vote after the step before
        if stop_signal or save_due:
            break
        # Dropout and other draws as if the run was never stopped: seeded by the step (01's page).
        # Not torch.manual_seed, which seeds every kind of device: 0.1 ms a call.
        seed = hash((args.seed, dist.get_rank(), epoch, step))  # DDP: and by the rank
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)  # DDP: this process's GPU
        for group, peak_lr in zip(optimizer.param_groups, peak_lrs):
            group["lr"] = get_lr(epoch * steps_per_epoch + step, args.epochs * steps_per_epoch,
                                 peak_lr, args)
        # The epoch's last step may have fewer micro-batches.
        micro_batches = min(args.accumulate, len(loader) - step * args.accumulate)
        train_step(args, model, batches, micro_batches, optimizer, device, sums)
        progress["step"] = step + 1
        vote.send()  # SLURM: read before the next step, while the GPU works through this one
        # DDP: rank 0 prints its own loss (an average over ranks would take a collective).
        if dist.get_rank() == 0 and args.log_interval and (step + 1) % args.log_interval == 0:
            # One GPU sync per progress line, none between.
            loss_sum, count, samples = (sums - logged_sums).tolist()
            now = time.perf_counter()
            # DDP: every rank trains as many samples.
            print(f"epoch {epoch + 1} step {step + 1}/{steps_per_epoch} | "
                  f"loss {loss_sum / count:.4f} (rank 0) | "
                  f"{samples * dist.get_world_size() / (now - logged_at):.0f} samples/s",
                  flush=True)
            logged_sums, logged_at = sums.clone(), now
    dist.all_reduce(sums)  # DDP: sum over ranks, so that rank 0 reports the global mean loss
    loss_sum, count, samples = sums.tolist()  # one GPU sync
    progress["loss_sum"] += loss_sum
    progress["count"] += count
    return int(samples)


@torch.no_grad()
def evaluate(model, loader, device, seed, vote):
    """Returns [loss sum, metric sum, count] over loader (SLURM: a part, where the vote stops)."""
    model.eval()
    torch.manual_seed(seed)  # a model that samples (a VAE) gives the same figures after a resume
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in loader:
        if vote.result()[0]:  # SLURM: a stop signal: train() then stops
            break
        inputs, targets = (tensor.to(device, non_blocking=True) for tensor in batch)
        for i, value in enumerate(loss_and_metric(model(inputs), targets)):
            sums[i] += value  # on the device: no GPU sync per batch
        vote.send()  # SLURM: as after a step, read before the next batch
    dist.all_reduce(sums)  # DDP: add up the ranks' disjoint shards
    return sums.tolist()


def save_checkpoint(path, checkpointed, progress):
    """Saves each object's state_dict() by name, and the progress; a crash leaves the old file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        torch.save({name: obj.state_dict() for name, obj in checkpointed.items()} | progress, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
    os.replace(path + ".tmp", path)  # atomic on POSIX filesystems


def load_checkpoint(path, checkpointed):
    """Restores each object of checkpointed from path. Returns (progress, error): the progress
    saved with them ({"epoch": ...}, None without a file), and why the file cannot be used (or
    None). Mapped, not read: one copy of a tensor."""
    if not path or not os.path.exists(path):
        return None, None
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        for name, obj in checkpointed.items():
            obj.load_state_dict(state.pop(name))  # onto this process's device, from any saver's
    except Exception as error:  # a copy cut short, another script's file: one line, no traceback
        # DDP: check_same_checkpoint() has rank 0 say why, for whichever rank it was.
        return None, f"{type(error).__name__}: {' '.join(str(error).split())}"
    return state, None  # what is left: the progress


def exit_with_error(message):
    # DDP: every rank exits with code 1, and rank 0 alone prints why: one line, not one a rank.
    if dist.get_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def setup(rank, local_rank, world_size, timeout):
    """DDP: picks this process's device and joins the process group at MASTER_ADDR:MASTER_PORT;
    returns the device and a Gloo group for waiting on rank 0."""
    if torch.cuda.is_available():
        # SLURM: its local rank's GPU, or where the site binds one GPU to each task, cuda:0.
        device = torch.device("cuda", local_rank if torch.cuda.device_count() > 1 else 0)
        backend = "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    # DDP: a collective fails after timeout seconds without every rank; the launcher ends the rest.
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    print(f"rank {rank}/{world_size} local_rank {local_rank} host {socket.gethostname()} "
          f"pid {os.getpid()} device {device} backend {backend} "
          f"cores {len(os.sched_getaffinity(0))} "  # SLURM: the task's, so a log shows its binding
          f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}\n",
          end="", flush=True)  # one write, so that the ranks' lines do not interleave
    # DDP: a Gloo group (no GPU memory) to wait in, an hour, while rank 0 downloads or saves.
    gloo_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(3600, timeout)))
    if device.type == "cuda":  # SLURM: a site check (the end of this file)
        check_gpus_not_shared(device, gloo_group)
    return device, gloo_group


def train(args, rank, world_size, device, gloo_group):
    """Returns the exit code: 0, or SLURM: a stop's, from stop_run()."""
    is_main = rank == 0  # DDP: only global rank 0 prints and saves
    train_loader, test_loader = make_loaders(args, rank, world_size, device, gloo_group)
    torch.manual_seed(args.seed)  # the same initial weights for the same seed
    model = Net().to(device)
    optimizer = make_optimizer(model, args)
    peak_lrs = [group["lr"] for group in optimizer.param_groups]  # this run's, not a checkpoint's
    # What a checkpoint holds and a resume restores, by name: add yours (01's page: an EMA).
    checkpointed = {"model": model, "optimizer": optimizer}
    progress = start_progress(args, checkpointed, len(train_loader.dataset), gloo_group)  # SLURM
    vote = StopVote(args.save_every if args.checkpoint else 0, args.collective_timeout)  # SLURM
    # DDP: copies rank 0's weights to every rank, then averages gradients during backward.
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    steps_per_epoch = math.ceil(len(train_loader) / args.accumulate)
    for epoch in range(progress["epoch"], args.epochs):
        # The data-loader workers' seeds (persistent workers': once per run). DDP: and by rank.
        torch.manual_seed(hash((args.seed, rank, epoch)))
        start, samples = time.perf_counter(), 0
        while progress["step"] < steps_per_epoch:  # SLURM: in parts, ending at a save or a stop
            vote.start()
            samples += train_one_epoch(args, ddp_model, train_loader, optimizer, peak_lrs, device,
                                       progress, vote)
            stop_signal, save_due = vote.result()
            if stop_signal:  # SLURM: all ranks stopped at this step: save it, and end
                return stop_run(args, checkpointed, progress, gloo_group, stop_signal,
                                vote.seen_at)
            if save_due:  # SLURM: --save-every
                periodic_save(args, checkpointed, progress, gloo_group)
        train_time = time.perf_counter() - start
        # -1: the seed of no training step, so that evaluation draws numbers of its own.
        test_loss, metric, count = evaluate(model, test_loader, device,
                                            hash((args.seed, rank, epoch, -1)), vote)
        stop_signal, _ = vote.result()
        if stop_signal:  # SLURM: during evaluate(): the next run evaluates again
            return stop_run(args, checkpointed, progress, gloo_group, stop_signal, vote.seen_at)
        loss = progress["loss_sum"] / progress["count"]
        progress.update(epoch=epoch + 1, step=0, loss_sum=0.0, count=0.0, stalled_runs=0)  # SLURM
        if args.checkpoint and is_main:
            save_checkpoint(args.checkpoint, checkpointed, progress)  # SLURM: a requeue's progress
        dist.barrier(group=gloo_group)  # DDP: the others wait until the checkpoint is complete
        if is_main:
            print(f"epoch {epoch + 1}/{args.epochs} | train loss {loss:.4f} | "
                  f"test loss {test_loss / count:.4f} | test {METRIC} {metric / count:.4f} "
                  f"of {count:.0f} | {samples / train_time:.0f} samples/s | "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    return 0


def run(args):
    """One task, as submitit starts it on each node. 05's stop handlers, not submitit's (which call
    scontrol, which containers lack)."""
    catch_stop_signals()
    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False,
                                                                overwrite=True)
    rank, local_rank, world_size = env.rank, env.local_rank, env.world_size
    if args.workers is None:  # submitit: half of the task's cores; the other half for the threads
        args.workers = (args.cpus_per_task or int(os.environ.get("SRUN_CPUS_PER_TASK", 1))) // 2
    # SLURM: a relative --checkpoint is the submit folder's, not the working folder's (in a
    # container, one that is thrown away); here in the job, as the launcher's shell is none.
    if "SLURM_SUBMIT_DIR" in os.environ:
        # SLURM: one per job, as 05's: a requeue resumes it.
        default = f"checkpoints/ddp-submitit-{os.environ['SLURM_JOB_ID']}.pt"
        args.checkpoint = os.path.join(os.environ["SLURM_SUBMIT_DIR"], args.checkpoint or default)
    if not args.local:  # SLURM: a Slurm job's layout, before setup() (the end of this file)
        check_launch(rank)
    device, gloo_group = setup(rank, local_rank, world_size, args.collective_timeout)
    exit_code = train(args, rank, world_size, device, gloo_group)  # SLURM: a stop's, or 0
    # DDP: not after an error, where NCCL's clean-up can hang: the launcher ends all.
    dist.destroy_process_group()
    if exit_code:
        sys.exit(exit_code)  # submitit: no result yet; the requeued job writes it


def make_executor(args):
    """submitit: the job as 05's submit.sh writes it, from the flags."""
    folder = os.path.join(args.log_dir, time.strftime("%Y%m%d-%H%M%S"))  # one per launch
    executor = submitit.AutoExecutor(folder=folder, cluster="local" if args.local else "slurm")
    # submitit: as 05's submit.sh, which says why: the task's cores (--cpus-per-task, else what
    # Slurm set), its threads, and the requeue on REQUEUE_EXIT_CODE. srun takes its cores from
    # SRUN_CPUS_PER_TASK (Slurm 22.05 on). The port: submitit's, drawn from the job id.
    cores = ("TASKS=${SLURM_TASKS_PER_NODE%%[(,]*}; export SRUN_CPUS_PER_TASK="
             "${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_PER_GPU:-$((SLURM_CPUS_ON_NODE / TASKS))}}")
    workers = "$((SRUN_CPUS_PER_TASK / 2))" if args.workers is None else args.workers
    threads = (f"export OMP_NUM_THREADS=$((SRUN_CPUS_PER_TASK > {workers} ? "
               f"SRUN_CPUS_PER_TASK - {workers} : 1))")
    report = ('echo "job $SLURM_JOB_ID: $SLURM_NTASKS tasks of $SRUN_CPUS_PER_TASK cores, '
              'OMP_NUM_THREADS=$OMP_NUM_THREADS"')
    requeue = (f'status=$?; if [ $status = {REQUEUE_EXIT_CODE} ]; then scontrol requeue '
               '"$SLURM_JOB_ID"; fi; exit $status')
    # A container, or another python: the executor's slurm_srun_args and slurm_python (06's page).
    executor.update_parameters(
        name="ddp-submitit", nodes=args.nodes, tasks_per_node=args.tasks_per_node,
        gpus_per_node=args.gpus_per_node or None, cpus_per_task=args.cpus_per_task,
        timeout_min=args.timeout_min,
        slurm_additional_parameters=dict(args.sbatch, requeue=True, signal="USR2@120"),
        slurm_srun_args=["--kill-on-bad-exit=0", "--wait=30"],
        slurm_setup=[cores, threads, report], slurm_teardown=[requeue])
    if executor.cluster == "slurm":
        # submitit: None drops its --wckey=submitit, which sites that enforce wckeys reject
        # (AutoExecutor's own update_parameters ignores a None); --sbatch wckey=K sets one.
        executor._executor.update_parameters(wckey=None)
    return executor


def main():
    args = parse_args()
    # submitit: inherited from an allocation or torchrun, they would mislead
    # TorchDistributedEnvironment and check_launch(); --local drops SLURM_* too.
    stale = ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]
    if args.local:
        stale += [name for name in os.environ if name.startswith("SLURM_")]
    for name in stale:
        os.environ.pop(name, None)
    executor = make_executor(args)
    os.environ["REQUEUE_ON_144"] = "1"  # submitit: its batch script (local: its runner) requeues
    # SLURM: the checkpoint folder, made on the host (a container's may be thrown away).
    if executor.cluster == "slurm":
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint or "checkpoints/x")),
                    exist_ok=True)
    # submitit: the job imports this file as a module, found through the PYTHONPATH it inherits
    # (not __main__, pickled by value), so that data-loader workers started by spawn or forkserver
    # find its classes by name.
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    name = os.path.splitext(os.path.basename(__file__))[0]  # train, as the job imports it
    job = executor.submit(importlib.import_module(name).run, args)
    checkpoint = args.checkpoint or "none"
    if not args.checkpoint and executor.cluster == "slurm":
        checkpoint = f"checkpoints/ddp-submitit-{job.job_id}.pt"
    print(f"submitted job {job.job_id}; logs in {job.paths.folder}; checkpoint {checkpoint}",
          flush=True)
    job.results()  # waits for the job, through requeues, and raises its error if it failed
    print(f"job {job.job_id} finished", flush=True)


# Site checks: what a real cluster can get wrong, set apart from the lesson above.


def check_same_checkpoint(path, resumed, load_error, group):
    """DDP: every rank loads the checkpoint itself. If one could not use it, or found no file or
    another (a node's view of shared storage lags), all end with one line, not different states."""
    every_rank = [None] * dist.get_world_size()  # (host, progress, error) of each rank
    dist.all_gather_object(every_rank, (socket.gethostname(), resumed, load_error), group=group)
    positions = [f"epoch {found['epoch'] + 1} step {found.get('step', 0)}" if found else "no file"
                 for _, found, _ in every_rank]
    for rank, (host, found, error) in enumerate(every_rank):
        if not error and repr(found) != repr(every_rank[0][1]):  # as text: a NaN is not itself
            error = (f"it finds {positions[rank]}, rank 0 on {every_rank[0][0]} "
                     f"{positions[0]}: start again once every node sees the same file")
        if error:
            exit_with_error(f"cannot use the checkpoint {path} (rank {rank} on {host}): {error}")


def gpus_on_node():
    """SLURM: the job's GPUs on this node: Slurm's count where the job asked for GPUs (any
    SLURM_GPUS* variable), else its GPU device files (a site without gres)."""
    if any(name.startswith("SLURM_GPUS") for name in os.environ):
        return int(os.environ.get("SLURM_GPUS_ON_NODE", 0))
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":  # a CPU job on GPU nodes
        return 0
    device_file_prefix = os.environ.get("GPU_DEVICES", "/dev/nvidia")  # the tests' stand-ins
    device_files = sum(os.path.exists(f"{device_file_prefix}{index}") for index in range(64))
    return max(device_files, torch.cuda.device_count())  # a dead driver's files, or CUDA's count


def check_launch(rank):
    """SLURM: a wrong launch ends here with one line, before any rank waits for another."""
    error_prefix = f"error: task {rank} on {socket.gethostname()}"
    gpus, visible = gpus_on_node(), torch.cuda.device_count()
    # This step's tasks on each node: "4(x2),2" says 4 on nodes 0 and 1, 2 on node 2.
    tasks_per_node = []
    for part in os.environ.get("SLURM_STEP_TASKS_PER_NODE", str(gpus)).split(","):
        tasks, _, nodes = part.rstrip(")").partition("(x")
        tasks_per_node += [int(tasks)] * int(nodes or 1)
    tasks = tasks_per_node[int(os.environ.get("SLURM_NODEID", 0))]
    if (gpus or visible) and not (tasks == gpus and visible in (1, gpus)):
        sys.exit(f"{error_prefix}: {tasks} tasks, {gpus} GPUs, and CUDA sees {visible}: run one "
                 "task per working GPU (--ntasks-per-node as --gpus-per-node; nvidia-smi)")
    if int(os.environ.get("SLURM_NNODES", 1)) == 1 or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    # On several nodes, Gloo binds the address that the hostname resolves to: on a loopback one
    # (Debian's /etc/hosts: 127.0.1.1) the others retry until the timeout (an hour on NCCL runs).
    try:
        address = socket.getaddrinfo(socket.gethostname(), None)[0][4][0]  # as Gloo looks it up
    except OSError:
        address = "no address"
    if address in ("no address", "::1") or address.startswith("127."):
        sys.exit(f"{error_prefix}: its hostname resolves to {address}, which the other nodes "
                 "cannot reach: export GLOO_SOCKET_IFNAME=<the nodes' interface> (ip -br addr)")


def run_id():
    """SLURM: the same on every rank of this run, and another in the next."""
    names = ["SLURM_JOB_ID", "SLURM_RESTART_COUNT", "MASTER_PORT"]
    return " ".join(os.environ.get(name, "") for name in names)


def write_probe(checkpoint):
    """SLURM: rank 0 writes run_id() beside the checkpoint, and every rank reads it back: a folder
    on node-local storage ($TMPDIR) would lose the checkpoint to a requeue on other nodes. Returns
    why it cannot write there, or None."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(checkpoint)), exist_ok=True)  # as a save
        with open(f"{checkpoint}.probe", "w") as probe:
            probe.write(run_id())
    except OSError as error:  # a read-only mount, a full disk, a file in the path
        return f"cannot write beside it: {error}"
    return None


def probe_error(checkpoint):
    """SLURM: why this rank cannot read rank 0's probe, or None."""
    try:
        with open(f"{checkpoint}.probe") as probe:
            if probe.read() == run_id():
                return None
    except (OSError, ValueError):  # no file (another folder than rank 0's), or not text
        pass
    return (f"rank 0's files in {os.path.dirname(os.path.abspath(checkpoint))} are not here: "
            "put it on storage that every node mounts (a requeue would start over)")


def check_gpus_not_shared(device, group):
    """SLURM: tasks that share a GPU fail in NCCL, whose message invites setting
    NCCL_MULTI_RANK_GPU_ENABLE=1: don't. Compared by host and PCI address (not CUDA index, 0 under
    ConstrainDevices, nor UUID, one per MIG slice)."""
    every_gpu = [None] * dist.get_world_size()
    gpu = torch.cuda.get_device_properties(device)
    this_gpu = (socket.gethostname(), gpu.pci_domain_id, gpu.pci_bus_id, gpu.pci_device_id)
    dist.all_gather_object(every_gpu, this_gpu, group=group)  # over Gloo, before NCCL's first
    shared = [rank for rank, gpu in enumerate(every_gpu) if every_gpu.count(gpu) > 1]
    if shared:
        exit_with_error(f"tasks {shared} share a GPU: give each task its own")


if __name__ == "__main__":
    main()
