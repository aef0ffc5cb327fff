"""Step 05: DDP under Slurm: srun starts the processes, and a stopped job goes back to the queue.

Run:  sbatch 05_ddp_slurm/submit.sh --epochs 3
      (from the repository root; submit.sh shows a CPU run; Python 3.10 or later)

Changed since 04: srun starts one task per GPU, each reading its place from SLURM_*. A stop signal
(SIGUSR2 before the time limit, SIGTERM) stops all ranks at one step; rank 0 saves it, and
submit.sh requeues the job, which resumes there. The site checks are at the end.
"""
import argparse
import math
import multiprocessing.resource_tracker
import os
import signal
import socket
import sys
import time
from contextlib import nullcontext
from datetime import timedelta

# SLURM: a stop signal that comes during the imports below (seconds; more from a cold shared
# filesystem) waits, blocked, for catch_stop_signals(), instead of ending the task.
if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGUSR2, signal.SIGTERM))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset


def parse_args():
    class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
        # --help shows each flag's default, but no "(default: None)".
        def _get_help_string(self, action):
            return action.help if action.default is None else super()._get_help_string(action)

    # The first line of the docstring names the step.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=HelpWithDefaults)
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
    parser.add_argument("--workers", type=int, default=0,
                        help="data-loader worker processes per process "
                             "(0: none, for data in memory; more for files)")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="save after every epoch and at a stop; resume if PATH exists")
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
    parser.add_argument("--check", action="store_true",
                        help="a job of a minute that says whether this one would run: the launch "
                             "checks, a few steps, an all-reduce and a save, timed; saves nothing")
    args = parser.parse_args()
    minimums = dict(epochs=1, batch_size=1, test_batch_size=1, accumulate=1, workers=0,
                    log_interval=0, clip_grad=0, save_every=0)
    for flag, minimum in minimums.items():
        if getattr(args, flag) < minimum:
            parser.error(f"--{flag.replace('_', '-')} must be at least {minimum}")
    if not args.lr > 0:
        parser.error("--lr must be above 0")
    if not 0 <= args.warmup < 1:
        parser.error("--warmup must be at least 0 and below 1")
    if not args.collective_timeout > 0:
        parser.error("--collective-timeout must be above 0 seconds")
    if args.check:  # SLURM: NCCL logs the transport it takes, if set before its first call
        os.environ.setdefault("NCCL_DEBUG", "INFO")
        os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    # SLURM: a relative --checkpoint is the submit folder's, not the working folder's (in a
    # container, one that is thrown away). The folder must be there: else the file is lost too.
    if args.checkpoint and "SLURM_SUBMIT_DIR" in os.environ:
        args.checkpoint = os.path.join(os.environ["SLURM_SUBMIT_DIR"], args.checkpoint)
        if not os.path.isdir(os.path.dirname(args.checkpoint)):
            parser.error(f"no checkpoint folder {os.path.dirname(args.checkpoint)} on "
                         f"{socket.gethostname()}: make it before the job (submit.sh does), and "
                         "mount it there in a container")
    return args


# Your task replaces these, down to get_lr: the data, the model, the loss and metric, the optimizer
# and its schedule.
def load_datasets(args):
    """Returns (train, test): datasets that take one index and return one (image, label), as
    torchvision's do. These two are decoded into memory once; yours may read each sample from disk.
    Their images are not in 0..1 (as a BCE loss needs): MNIST is normalised to mean 0 and standard
    deviation 1 (-0.42 to 2.82), the synthetic set is Gaussian."""
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
        fetch = f"from torchvision.datasets import MNIST; MNIST('{args.data_dir}', download=True)"
        sys.exit(f"error: MNIST is not in {args.data_dir} and could not be downloaded "
                 f"({reason}); fetch it where there is internet: python -c \"{fetch}\", "
                 "then copy the folder (or use --dataset synthetic)")
    return [TensorDataset((split.data.unsqueeze(1) / 255 - 0.1307) / 0.3081, split.targets)
            for split in splits]


class Net(nn.Module):
    """A small CNN without dropout or BatchNorm (01's page says why). SiLU and average pooling, not
    ReLU and max pooling: smooth, so that the rounding differences between steps (DDP adds in
    another order) stay near 1e-6."""

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
    """Returns (loss sum, metric sum, count) of a batch. Sums over what the loss is a mean of
    (samples here; tokens, say, for a sequence model) add up exactly over batches and ranks.
    Training minimises loss sum / count."""
    loss = F.cross_entropy(output, target, reduction="sum")
    return loss, (output.argmax(dim=1) == target).sum(), len(target)


def make_optimizer(model, args):
    # Parameter groups with rates of their own, and AdamW, work too: get_lr scales each group's.
    # A resume keeps the checkpoint's other settings (momentum, weight decay): load_state_dict.
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def get_lr(step, total_steps, peak_lr, args):
    """The learning rate of optimizer step `step` (from 0) of the run's `total_steps`, for a
    parameter group whose rate in make_optimizer is peak_lr."""
    warmup_steps = args.warmup * total_steps  # 0 without --warmup
    if step < warmup_steps:  # rises linearly
        return peak_lr * ((step + 1) / (warmup_steps + 1))
    if not args.cosine:  # then stays
        return peak_lr
    decay_fraction = min(1, (step - warmup_steps) / (total_steps - warmup_steps))  # or to 0
    return peak_lr * ((1 + math.cos(math.pi * decay_fraction)) / 2)


# SLURM: stopping inside an epoch, and resuming there. A stop takes this path:
# 1. Slurm signals every task: SIGUSR2 before the time limit (submit.sh's --signal), SIGTERM on a
#    preemption or a scancel. catch_stop_signals() makes it a note instead of the end.
# 2. StopCheck, before an optimizer step every STOP_CHECK_SECONDS or so, has the ranks agree
#    whether any had one (max_over_ranks), so that all stop at the same step.
# 3. stop_run() has rank 0 save that step with the epoch's loss so far (save_inside_epoch(), which
#    also saves every --save-every minutes) and picks the exit code: REQUEUE_EXIT_CODE.
# 4. submit.sh (06: its slurm_teardown) requeues the job on that code, from the host. The job
#    starts again under the same id, and train() resumes the step: ResumableSampler skips the
#    samples trained before it.
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
REQUEUE_EXIT_CODE = 144  # of tasks that stopped and saved: submit.sh requeues the job
STOP_CHECK_SECONDS = 2  # how often the ranks agree: each time, a collective waits for the GPU
MAX_STALLED_RUNS = 3  # time-limit stops in a row before any progress: then no requeue
SIGNAL_LEAD_SECONDS = 120  # submit.sh's --signal=USR2@120 (06 writes it); --check times a stop
noted_stop_signals = []  # by the handler


def catch_stop_signals():
    """SLURM: a stop signal is noted from here on. Slurm signals the data-loader workers too,
    which have no handler under spawn or forkserver: blocked, the signal stays pending there."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: noted_stop_signals.append(signum))
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # The resource tracker, started later by a data-loader worker, would unblock SIGTERM unseen:
    # started here, it is blocked again after it.
    multiprocessing.resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def stop_signal_received():
    """SLURM: the stop signal this process received (SIGTERM where both), or 0. Blocked, as in
    the main thread and what it starts, a signal waits in sigpending(); one that reaches a thread
    without the block is noted by the handler."""
    if noted_stop_signals:
        return max(noted_stop_signals)
    return max(signal.sigpending() & set(STOP_SIGNALS), default=0)


def max_over_ranks(values, device):
    """SLURM: a collective that returns each value's largest over the ranks: the same list on
    every rank, so that all decide alike."""
    values = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


class StopCheck:
    """SLURM: asks the ranks, from first_step on, whether any had a stop signal and whether a
    --save-every save is due (--save-every minutes after this StopCheck was made: at the epoch's
    start or its last save). Not at every step, as each check is a collective that waits for the
    GPU: as many steps apart as take STOP_CHECK_SECONDS, the spacing at most doubling each time."""

    def __init__(self, first_step, save_every_minutes, device):
        self.next_step, self.steps_apart, self.device = first_step, 1, device
        self.save_every_seconds = 60 * save_every_minutes  # 0: never
        self.started = self.last_check = time.monotonic()

    def poll(self, step):
        """Returns (the stop signal any rank had or 0, whether a save is due), the same on every
        rank; (0, False) between two checks."""
        if step != self.next_step:
            return 0, False
        now = time.monotonic()
        # The largest over the ranks: SIGTERM (15) where any had it, over SIGUSR2 (12).
        stop_signal, since_last_check, since_start = max_over_ranks(
            [stop_signal_received(), now - self.last_check, now - self.started], self.device)
        steps_per_second = self.steps_apart / max(since_last_check, 1e-6)
        self.steps_apart = min(2 * self.steps_apart,
                               max(1, int(STOP_CHECK_SECONDS * steps_per_second)))
        self.next_step, self.last_check = step + self.steps_apart, time.monotonic()
        return int(stop_signal), 0 < self.save_every_seconds <= since_start


class ResumableSampler(DistributedSampler):
    """SLURM: a DistributedSampler that skips the first `skip` indices of this rank's share (the
    steps trained before a stop); its length stays the whole epoch's."""
    skip = 0

    def set_epoch(self, epoch, skip=0):
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])


def start_progress(args, resumed, train_samples, gloo_group):
    """SLURM: where this run starts, as the plain data that a save stores: the epoch and its steps
    trained, their loss sums, what decides each step's samples, how many runs in a row stopped
    where they resumed (in a requeued job; a new job starts at 0) and the flags. Every rank calls
    it: the folder check is a collective."""
    if args.checkpoint:  # a site check (the end of this file), once every rank has resumed
        check_checkpoint_folder_shared(args.checkpoint, gloo_group)
    world_size = dist.get_world_size()
    sample_order = dict(global_batch=world_size * args.batch_size * args.accumulate,
                        seed=args.seed, train_samples=train_samples)
    progress = dict(epoch=0, step=0, loss_sum=0.0, count=0.0, stalled_runs=0,
                    world_size=world_size, batch_size=args.batch_size, accumulate=args.accumulate,
                    sample_order=sample_order,
                    flags={flag: str(value) for flag, value in vars(args).items()})  # as text
    if resumed and resumed.get("step"):  # saved inside an epoch: it goes on there
        check_sample_order(args.checkpoint, resumed, progress)  # a site check (the end)
        progress.update(step=resumed["step"], loss_sum=resumed["loss_sum"],
                        count=resumed["count"])
    if resumed:  # 01-04's checkpoints have no stall count
        progress.update(epoch=resumed["epoch"], stalled_runs=resumed.get("stalled_runs", 0))
    if not int(os.environ.get("SLURM_RESTART_COUNT", 0)):
        progress["stalled_runs"] = 0
    progress["resumed_at"] = [progress["epoch"], progress["step"]]
    if resumed and dist.get_rank() == 0:  # a new job may resume with other flags: they apply
        # As text: 05 saved them with their types until 2026-11-28.
        saved_flags = {flag: str(value) for flag, value in resumed.get("flags", {}).items()}
        changed_flags = ", ".join(f"--{flag.replace('_', '-')} {saved_flags[flag]} -> {value}"
                                  for flag, value in progress["flags"].items()
                                  if saved_flags.get(flag, value) != value and flag != "check")
        line = (f"resumed from {args.checkpoint} at epoch {progress['epoch'] + 1} "
                f"step {progress['step']}")
        if changed_flags:
            line += f"; flags that differ from the checkpoint's: {changed_flags}"
        print(line, flush=True)
    elif args.checkpoint and dist.get_rank() == 0:  # a mistyped path would start over unseen
        requeued = "requeued, but " if int(os.environ.get("SLURM_RESTART_COUNT", 0)) else ""
        print(f"{requeued}no checkpoint at {os.path.abspath(args.checkpoint)}: starting at "
              "epoch 1", flush=True)
    return progress


def save_inside_epoch(args, checkpointed, progress, gloo_group, stop_signal=0):
    """SLURM: rank 0 saves the model after progress["step"] steps of progress["epoch"]: at a stop
    (stop_run()) or, without a stop_signal, every --save-every minutes. It first updates
    progress["stalled_runs"], which stop_run() reads. Returns the seconds it took."""
    # Counts the runs in a row, this one included, that SIGUSR2 (the time limit) stopped where they
    # resumed. A SIGTERM (a preemption) there keeps the count: a later start may get further.
    if [progress["epoch"], progress["step"]] != progress["resumed_at"]:
        progress["stalled_runs"] = 0
    elif stop_signal == signal.SIGUSR2:
        progress["stalled_runs"] += 1
    began = time.perf_counter()
    if args.checkpoint and dist.get_rank() == 0:
        save_checkpoint(args.checkpoint, checkpointed, progress)
    dist.barrier(group=gloo_group)  # DDP: the others wait until the checkpoint is complete
    if not stop_signal and args.checkpoint and dist.get_rank() == 0:
        print(f"saved at epoch {progress['epoch'] + 1} step {progress['step']} (--save-every "
              f"{args.save_every:g})", flush=True)
    return time.perf_counter() - began


def stop_run(args, checkpointed, progress, gloo_group, stop_signal):
    """SLURM: the end of a run whose ranks agreed to stop: rank 0 saves the step and says what
    comes next. Returns the exit code: REQUEUE_EXIT_CODE (on which submit.sh requeues the job), or
    1 where a requeue cannot help."""
    save_seconds = save_inside_epoch(args, checkpointed, progress, gloo_group, stop_signal)
    saved = f"saved in {save_seconds:.1f} s"
    if not args.checkpoint:  # a run cut short, with nothing to resume: it ends as failed
        exit_code = 1
        outcome = ("no --checkpoint, so nothing is saved; exit code 1, not requeued (it would "
                   "start over)")
    # A time limit that start-up and the signal's lead use up would requeue the job for ever,
    # whichever script requeues it.
    elif progress["stalled_runs"] >= MAX_STALLED_RUNS:
        exit_code = 1
        outcome = (f"{saved}, exit code 1, not requeued: {progress['stalled_runs']} runs in a row "
                   "made no step or evaluation before the time limit's signal (a time limit "
                   "below start-up + the signal's lead)")
    elif not os.environ.get("REQUEUE_ON_144"):  # torchrun (05's page), or srun by hand
        exit_code = REQUEUE_EXIT_CODE
        outcome = (f"{saved}, exit code {REQUEUE_EXIT_CODE}: nothing requeues on it here (started "
                   "without submit.sh), the same command resumes")
    else:  # submit.sh requeues the job on this code
        exit_code = REQUEUE_EXIT_CODE
        outcome = f"{saved}, exit code {REQUEUE_EXIT_CODE} to be requeued"
        if stop_signal == signal.SIGTERM:  # a preemption's, or a scancel's (ends the batch script)
            outcome += ("; after a scancel it is not: resume in a new job with --checkpoint "
                        f"{args.checkpoint}")
    if dist.get_rank() == 0:
        print(f"stopped at epoch {progress['epoch'] + 1} step {progress['step']} on "
              f"{signal.Signals(stop_signal).name}: {outcome}", flush=True)
    return exit_code


def make_loaders(args, rank, world_size, device, gloo_group):
    # Returns (train loader, test loader) of --dataset: this rank's share of each.
    if rank != 0:  # DDP: rank 0 loads the data first, downloading what is missing; the others next
        dist.barrier(group=gloo_group)
    train_set, test_set = load_datasets(args)
    if rank == 0:
        dist.barrier(group=gloo_group)
    # DDP: each rank takes every world_size-th index of the epoch's order (set each epoch by
    # train_one_epoch()), padded to the same number of steps; and a disjoint slice of the test set,
    # not padded, so that the sums over ranks are exact.
    sampler = ResumableSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    test_set = Subset(test_set, range(rank, len(test_set), world_size))
    loader_args = dict(num_workers=args.workers, pin_memory=device.type == "cuda",
                       persistent_workers=args.workers > 0)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, **loader_args)
    test_loader = DataLoader(test_set, args.test_batch_size, **loader_args)
    return train_loader, test_loader


def train_step(args, model, batches, micro_batches, optimizer, device, sums):
    """One optimizer step over the next micro_batches batches; adds their [loss sum, count,
    samples] to sums."""
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


def train_one_epoch(args, model, loader, optimizer, peak_lrs, device, progress):
    """Trains progress["epoch"] from step progress["step"] to its end (SLURM: the sampler, a
    ResumableSampler, skips the steps before), or until the ranks stop together (SLURM: a stop
    signal, or --save-every minutes); adds to progress what it trained.
    Returns (samples trained, the stop signal a rank had or 0, whether a --save-every save is
    due)."""
    model.train()
    epoch, stop_signal, save_due = progress["epoch"], 0, False
    # DDP: else each epoch repeats the first's order. SLURM: less the samples trained already.
    loader.sampler.set_epoch(epoch, skip=progress["step"] * args.batch_size * args.accumulate)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # [loss sum, count, samples]
    logged_sums, logged_at = sums.clone(), time.perf_counter()  # at the last progress line
    batches = iter(loader)  # draws the workers' seeds: from train()'s seeding, not a step's
    steps_per_epoch = math.ceil(len(loader) / args.accumulate)  # optimizer steps
    stop_check = StopCheck(progress["step"], args.save_every, device)  # SLURM
    for step in range(progress["step"], steps_per_epoch):
        stop_signal, save_due = stop_check.poll(step)  # SLURM: the ranks agree
        if stop_signal or save_due:
            break
        # Dropout and other draws here as if the run was never stopped: seeded by the step (the
        # data-loader workers' draws are not: 01's page).
        # Not torch.manual_seed, which seeds every kind of device: 0.1 ms a call.
        seed = hash((args.seed, dist.get_rank(), epoch, step))  # DDP: and by the rank
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed_all(seed)  # every GPU's generator (02's replicas use them all)
        for group, peak_lr in zip(optimizer.param_groups, peak_lrs):
            group["lr"] = get_lr(epoch * steps_per_epoch + step, args.epochs * steps_per_epoch,
                                 peak_lr, args)
        # The epoch's last step may have fewer micro-batches.
        micro_batches = min(args.accumulate, len(loader) - step * args.accumulate)
        train_step(args, model, batches, micro_batches, optimizer, device, sums)
        progress["step"] = step + 1
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
    return int(samples), stop_signal, save_due


@torch.no_grad()
def evaluate(model, loader, device, seed):
    """Returns [loss sum, metric sum, count] over loader."""
    model.eval()
    torch.manual_seed(seed)  # a model that samples (a VAE) gives the same figures after a resume
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in loader:
        # SLURM: train() then stops. No collective here: ranks may have one batch more than others.
        if stop_signal_received():
            break
        inputs, targets = (tensor.to(device, non_blocking=True) for tensor in batch)
        for i, value in enumerate(loss_and_metric(model(inputs), targets)):
            sums[i] += value  # on the device: no GPU sync per batch
    dist.all_reduce(sums)  # DDP: add up the ranks' disjoint shards
    return sums.tolist()


def save_checkpoint(path, checkpointed, progress):
    """Saves each object's state_dict() by name, and the progress (plain data). A crash while
    writing leaves the previous file whole."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        torch.save({name: obj.state_dict() for name, obj in checkpointed.items()} | progress, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
    os.replace(path + ".tmp", path)  # atomic on POSIX filesystems


def load_checkpoint(path, checkpointed):
    """Restores each object of checkpointed from path. Returns (progress, error): the progress
    saved with them ({"epoch": ...}, None where there is no path or no file), and why the file
    cannot be used (or None). The file is mapped, not read: a tensor is copied at most once, onto
    this process's device (on a CPU, the optimizer keeps some mapped)."""
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
        # SLURM: its local rank's GPU of the node's, or where the site binds one GPU to each
        # task, its own, as cuda:0.
        device = torch.device("cuda", local_rank if torch.cuda.device_count() > 1 else 0)
        backend = "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    # DDP: a collective fails after timeout seconds without every rank; the launcher then ends
    # the others.
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    print(f"rank {rank}/{world_size} local_rank {local_rank} host {socket.gethostname()} "
          f"pid {os.getpid()} device {device} backend {backend} "
          f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}\n",
          end="", flush=True)  # one write, so that the ranks' lines do not interleave
    # DDP: a second group, in which the others wait while rank 0 alone downloads or saves: at least
    # an hour. Gloo, so that it takes no GPU memory.
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
    resumed, load_error = load_checkpoint(args.checkpoint, checkpointed)
    check_same_checkpoint(args.checkpoint, resumed, load_error, gloo_group)  # DDP: a site check
    progress = start_progress(args, resumed, len(train_loader.dataset), gloo_group)  # SLURM
    # DDP: copies rank 0's weights to every rank, then averages gradients during backward.
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    if args.check:  # SLURM: the rest of a --check job (the end of this file)
        return check_job(args, ddp_model, train_loader, optimizer, checkpointed, device,
                         gloo_group)
    steps_per_epoch = math.ceil(len(train_loader) / args.accumulate)
    for epoch in range(progress["epoch"], args.epochs):
        # The data-loader workers' seeds (persistent workers': once per run). DDP: and by rank.
        torch.manual_seed(hash((args.seed, rank, epoch)))
        start, samples = time.perf_counter(), 0
        while progress["step"] < steps_per_epoch:  # SLURM: in parts, ending at a save or a stop
            trained, stop_signal, save_due = train_one_epoch(args, ddp_model, train_loader,
                                                             optimizer, peak_lrs, device, progress)
            samples += trained
            if stop_signal:  # SLURM: all ranks stopped at this step: save it, and end
                return stop_run(args, checkpointed, progress, gloo_group, stop_signal)
            if save_due:  # SLURM: --save-every: save, and go on
                save_inside_epoch(args, checkpointed, progress, gloo_group)
        train_time = time.perf_counter() - start
        # -1: the seed of no training step, so that evaluation draws numbers of its own.
        test_loss, metric, count = evaluate(model, test_loader, device,
                                            hash((args.seed, rank, epoch, -1)))
        stop_signal = int(max_over_ranks([stop_signal_received()], device)[0])
        if stop_signal:  # SLURM: during evaluate(): the next run evaluates again
            return stop_run(args, checkpointed, progress, gloo_group, stop_signal)
        loss = progress["loss_sum"] / progress["count"]
        progress.update(epoch=epoch + 1, step=0, loss_sum=0.0, count=0.0, stalled_runs=0)  # SLURM
        if args.checkpoint and is_main:
            save_checkpoint(args.checkpoint, checkpointed, progress)  # SLURM: all of progress
        dist.barrier(group=gloo_group)  # DDP: the others wait until the checkpoint is complete
        if is_main:
            print(f"epoch {epoch + 1}/{args.epochs} | train loss {loss:.4f} | "
                  f"test loss {test_loss / count:.4f} | test {METRIC} {metric / count:.4f} "
                  f"of {count:.0f} | {samples / train_time:.0f} samples/s | "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    return 0


def main():
    catch_stop_signals()  # SLURM: first thing, before any other thread or process starts
    args = parse_args()
    # SLURM: srun's tasks, or torchrun's (05's page): its agent alone sets TORCHELASTIC_RUN_ID.
    if "TORCHELASTIC_RUN_ID" in os.environ:
        names = ["RANK", "LOCAL_RANK", "WORLD_SIZE"]
    else:
        names = ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"]
        if "SLURM_STEP_ID" not in os.environ or "MASTER_ADDR" not in os.environ:
            sys.exit("error: start this script with srun in a job of submit.sh (sbatch "
                     "05_ddp_slurm/submit.sh), or try it without Slurm: CUDA_VISIBLE_DEVICES= "
                     "torchrun --standalone --nproc-per-node 2 05_ddp_slurm/train.py")
        # SLURM: the site checks, at the end of this file: before setup(), no rank waits yet.
        check_launch(args.checkpoint, int(os.environ["SLURM_PROCID"]))
    rank, local_rank, world_size = (int(os.environ[name]) for name in names)
    device, gloo_group = setup(rank, local_rank, world_size, args.collective_timeout)
    exit_code = train(args, rank, world_size, device, gloo_group)  # SLURM: a stop's, or 0
    # DDP: not after an error, where NCCL's clean-up can hang: the launcher ends all.
    dist.destroy_process_group()
    sys.exit(exit_code)  # SLURM: REQUEUE_EXIT_CODE after a stop, for submit.sh to requeue the job


# Site checks: what a real cluster can get wrong, set apart from the lesson above.


def check_same_checkpoint(path, resumed, load_error, group):
    """DDP: every rank loads the checkpoint itself (a node's ranks share the file's pages). If one
    could not use it, or found no file or another, as where a node's view of shared storage lags,
    all end with rank 0's line rather than train from different states."""
    every_rank = [None] * dist.get_world_size()  # (host, progress, error) of each rank
    found_here = (socket.gethostname(), resumed, load_error)
    dist.all_gather_object(every_rank, found_here, group=group)  # DDP: what every rank found
    for rank, (host, _, error) in enumerate(every_rank):
        if error:  # the first rank that could not use the file
            exit_with_error(f"cannot resume from {path} (rank {rank} on {host}): {error}")
    positions = [(found["epoch"], found.get("step", 0)) if found else "no file"
                 for _, found, _ in every_rank]  # (epochs done, step)
    # Compared as text: a NaN (in 05's saved loss sums) is not equal to itself.
    rank_0_text = repr(every_rank[0][1])
    others = [f"rank {rank} on {host} finds {positions[rank]}"
              for rank, (host, found, _) in enumerate(every_rank) if repr(found) != rank_0_text]
    if others:
        exit_with_error(f"ranks see another checkpoint at {path} than rank 0 on "
                        f"{every_rank[0][0]}, which finds (epochs done, step) {positions[0]}: "
                        f"{', '.join(others)}; start again once every node sees the same file")


def tasks_on_node(node_id, default):
    """SLURM: this job step's tasks on node node_id: SLURM_STEP_TASKS_PER_NODE as "4(x2),2"
    says 4 on nodes 0 and 1, 2 on node 2."""
    counts = []
    for part in os.environ.get("SLURM_STEP_TASKS_PER_NODE", str(default)).split(","):
        count, _, repeats = part.rstrip(")").partition("(x")
        counts += [int(count)] * int(repeats or 1)
    return counts[node_id]


def gpus_on_node():
    """SLURM: the GPUs of this node that the job has: SLURM_GPUS_ON_NODE where the job asked Slurm
    for GPUs (any SLURM_GPUS* variable), else what CUDA or the GPU device files show (a site
    without gres; GPU_DEVICES= for none)."""
    if any(name.startswith("SLURM_GPUS") for name in os.environ):
        return int(os.environ.get("SLURM_GPUS_ON_NODE", 0))
    device_file_prefix = os.environ.get("GPU_DEVICES", "/dev/nvidia")  # a dead driver's too
    if not device_file_prefix:
        return 0
    device_files = sum(os.path.exists(f"{device_file_prefix}{index}") for index in range(64))
    return max(device_files, torch.cuda.device_count())


def check_launch(checkpoint, rank):
    """SLURM: a wrong launch ends here with one line, before any rank waits for another (05's
    page lists the checks)."""
    error_prefix = f"error: task {rank} on {socket.gethostname()}"
    gpus, visible = gpus_on_node(), torch.cuda.device_count()
    tasks = tasks_on_node(int(os.environ.get("SLURM_NODEID", 0)), gpus)
    one_task_per_gpu = torch.cuda.is_available() and tasks == gpus and visible in (1, gpus)
    if (gpus or visible) and not one_task_per_gpu:
        sys.exit(f"{error_prefix}: {tasks} tasks and {gpus} GPUs on it, and CUDA sees {visible} "
                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}): run one task "
                 "per GPU (--ntasks-per-node as --gpus-per-node, or --gpus-per-task=1) on nodes "
                 "whose GPUs work (nvidia-smi)")
    if checkpoint and "SLURM_JOB_ID" in os.environ:
        folder = os.path.dirname(os.path.abspath(checkpoint))
        if not os.path.isdir(folder):
            sys.exit(f"{error_prefix}: no checkpoint folder {folder}: make it before the job "
                     "(and mount it there in a container)")
    if int(os.environ.get("SLURM_NNODES", 1)) == 1:
        return
    # On several nodes, Gloo binds the address that the hostname resolves to: on a loopback one
    # (Debian's /etc/hosts: 127.0.1.1) the others retry until the timeout (an hour on NCCL runs).
    address = host_address(socket.gethostname())
    if not os.environ.get("GLOO_SOCKET_IFNAME") and (
            address in ("no address", "::1") or address.startswith("127.")):
        sys.exit(f"{error_prefix}: its hostname resolves to {address}, which the other nodes "
                 "cannot reach: export GLOO_SOCKET_IFNAME=<the nodes' network interface> "
                 "(one name, as ib0 or eth0: ip -br addr lists them)")
    if host_address(os.environ["MASTER_ADDR"]) == "no address":  # the store would retry as long
        sys.exit(f"{error_prefix}: MASTER_ADDR {os.environ['MASTER_ADDR']} does not resolve here")


def host_address(name):
    """SLURM: the first address that name resolves to, as Gloo and torch's store take it, or
    "no address"."""
    try:
        return socket.getaddrinfo(name, None)[0][4][0]
    except OSError:
        return "no address"


def check_checkpoint_folder_shared(path, group):
    """SLURM: rank 0 makes a file beside the checkpoint that every rank must see. A folder on
    node-local or per-job storage ($TMPDIR, /tmp) exists on every node, but a requeue whose rank 0
    runs on another node would find no checkpoint there and start over, at every requeue."""
    probe_path, write_error = f"{path}.{socket.gethostname()}-{os.getpid()}.probe", None
    if dist.get_rank() == 0:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # as when saving
            open(probe_path, "w").close()
        except OSError as error:  # a read-only mount, a full disk, a file in the path
            write_error = f"{type(error).__name__}: {error}"
    rank_0_probe = [probe_path, write_error]
    dist.broadcast_object_list(rank_0_probe, src=0, group=group)  # DDP: once the file is there
    probe_path, write_error = rank_0_probe
    if write_error:
        exit_with_error(f"cannot write beside the checkpoint {path}: {write_error}")
    every_seen = [None] * dist.get_world_size()
    this_seen = (socket.gethostname(), os.path.exists(probe_path))
    dist.all_gather_object(every_seen, this_seen, group=group)
    if dist.get_rank() == 0:
        os.remove(probe_path)
    blind = sorted({host for host, seen in every_seen if not seen})
    if blind:
        exit_with_error(f"the checkpoint folder {os.path.dirname(os.path.abspath(path))} is not "
                        f"shared: {', '.join(blind)} cannot see rank 0's files there; put it on "
                        "storage that every node mounts (a requeue would start over)")


def check_gpus_not_shared(device, group):
    """SLURM: tasks that share a GPU (--gpu-bind=map_gpu:0, MIG slices of one GPU) would fail in
    NCCL, on every rank. Compared by host and PCI address, not by CUDA index (0 in every task
    under ConstrainDevices) nor by UUID (each MIG slice has its own)."""
    every_gpu = [None] * dist.get_world_size()
    properties = torch.cuda.get_device_properties(device)
    this_gpu = (socket.gethostname(), properties.pci_domain_id, properties.pci_bus_id,
                properties.pci_device_id)
    dist.all_gather_object(every_gpu, this_gpu, group=group)  # over Gloo, before NCCL's first
    shared = [(rank, *gpu) for rank, gpu in enumerate(every_gpu) if every_gpu.count(gpu) > 1]
    if shared:
        exit_with_error(f"tasks share a GPU (task, host, PCI domain, bus, device): {shared}: "
                        "give each its own GPU")


def check_sample_order(path, resumed, progress):
    """SLURM: a checkpoint saved inside an epoch resumes only where its steps take the same
    samples: the same global batch, seed and data size."""
    if isinstance(resumed.get("sample_order"), list):  # as 05 saved it until 2026-11-28
        resumed["sample_order"] = dict(zip(["global_batch", "seed", "train_samples"],
                                           resumed["sample_order"]))
    if "sample_order" not in resumed:
        exit_with_error(f"{path} was saved inside an epoch by an older train.py: resume it with "
                        "that one, or from an end-of-epoch checkpoint")
    if resumed["sample_order"] == progress["sample_order"]:
        return
    saved, now = resumed["sample_order"], progress["sample_order"]
    exit_with_error(
        f"{path} stopped inside epoch {resumed['epoch'] + 1} with {resumed['world_size']} "
        f"processes x {resumed['batch_size']} samples x --accumulate {resumed['accumulate']} "
        f"per step, --seed {saved['seed']} and {saved['train_samples']} training samples; resume "
        f"it with the same global batch, seed and data (now {progress['world_size']} x "
        f"{progress['batch_size']} x {progress['accumulate']}, {now['seed']}, "
        f"{now['train_samples']}) or from an end-of-epoch checkpoint")


CHECK_STEPS = 20  # --check's timed optimizer steps, after one that warms up
CHECK_ALLREDUCES = 5  # and its timed all-reduces of DDP_BUCKET_BYTES, after one untimed
DDP_BUCKET_BYTES = 25 * 2**20  # what each of DDP's all-reduces sends (its bucket_cap_mb)
STOP_EXIT_SECONDS = 30  # a stopped job's exit and requeue, after its save (srun's --wait=30)


def check_job(args, ddp_model, train_loader, optimizer, checkpointed, device, gloo_group):
    """SLURM: --check, from train() once the launch checks, the data, the checkpoint folder and a
    resume have passed: a line per node, the job's figures (time_job()) and a verdict. Saves
    nothing; returns 0, or ends with one line and exit code 1 where a stop and its save would not
    fit the signal's lead."""
    gpu = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    this_task = (socket.gethostname(), host_address(socket.gethostname()),
                 (dist.get_rank(), f"{gpu.name}, PCI bus {gpu.pci_bus_id}" if gpu else "cpu",
                  len(os.sched_getaffinity(0)), args.workers, torch.get_num_threads()))
    every_task = [None] * dist.get_world_size()
    dist.all_gather_object(every_task, this_task, group=gloo_group)
    step_seconds, allreduce_seconds, save_seconds, peak_memory = time_job(
        args, ddp_model, train_loader, optimizer, checkpointed, device, gloo_group)
    world_size = dist.get_world_size()
    if dist.get_rank() == 0:
        hosts = list(dict.fromkeys(host for host, _, _ in every_task))  # in rank order
        for host in hosts:  # one line a node
            address = next(address for name, address, _ in every_task if name == host)
            tasks = [task for name, _, task in every_task if name == host]
            print(f"node {host} (its name resolves to {address}): (rank, device, cores, workers, "
                  f"threads) {tasks}", flush=True)
        # A ring all-reduce sends 2 (n - 1) / n of the buffer over each rank's link.
        bus_gb_per_s = DDP_BUCKET_BYTES * 2 * (world_size - 1) / world_size / allreduce_seconds
        print(f"check: {world_size} ranks, {len(hosts)} nodes, "
              f"{args.batch_size * args.accumulate * world_size / step_seconds:.0f} samples/s, "
              f"peak GPU memory (PyTorch's) {peak_memory:.1f} GiB, all-reduce of DDP's "
              f"{DDP_BUCKET_BYTES / 2**20:.0f} MiB bucket in {allreduce_seconds * 1e3:.1f} ms "
              f"({bus_gb_per_s / 1e9:.2f} GB/s bus), a save in {save_seconds:.1f} s"
              + ("" if args.checkpoint else " (no --checkpoint: none)"), flush=True)
    # At worst the signal comes during an end-of-epoch save, and the stop saves again; the tasks'
    # exit and the requeue take up to STOP_EXIT_SECONDS more, all before the time limit.
    stop_seconds = STOP_CHECK_SECONDS + step_seconds + 2 * save_seconds + STOP_EXIT_SECONDS
    if stop_seconds > SIGNAL_LEAD_SECONDS:
        exit_with_error(f"a stop would take {stop_seconds:.0f} s (the stop check, a step, two "
                        f"saves, the exit), more than the signal's {SIGNAL_LEAD_SECONDS} s lead: "
                        "raise SIGNAL_LEAD_SECONDS (05: and submit.sh's --signal=USR2@N to match)")
    if dist.get_rank() == 0:
        print(f"check passed: a stop takes up to {stop_seconds:.0f} s; the time limit's signal "
              f"gives {SIGNAL_LEAD_SECONDS} s, a preemption the partition's GraceTime", flush=True)
    return 0


def time_job(args, ddp_model, train_loader, optimizer, checkpointed, device, gloo_group):
    """SLURM: --check's figures with train()'s DDP model and optimizer, the slowest rank's on every
    rank (one verdict for all): the seconds of an optimizer step, of an all-reduce of DDP's bucket
    and of a save beside the checkpoint (then removed), and the peak GPU memory in GiB."""
    # The loader's batches, from its start again where an epoch has fewer steps than the check.
    batches = (batch for _ in range((CHECK_STEPS + 1) * args.accumulate) for batch in train_loader)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    train_step(args, ddp_model, batches, args.accumulate, optimizer, device, sums)  # warms up
    max_over_ranks([0], device)  # waits for the GPU's queued work, and for every rank
    started = time.perf_counter()
    for _ in range(CHECK_STEPS):
        train_step(args, ddp_model, batches, args.accumulate, optimizer, device, sums)
    max_over_ranks([0], device)
    step_seconds = (time.perf_counter() - started) / CHECK_STEPS
    peak_memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0
    bucket = torch.ones(DDP_BUCKET_BYTES // 4, device=device)
    dist.all_reduce(bucket)  # NCCL may connect its ring at a size's first all-reduce: not timed
    max_over_ranks([0], device)
    started = time.perf_counter()
    for _ in range(CHECK_ALLREDUCES):
        dist.all_reduce(bucket)
    max_over_ranks([0], device)
    allreduce_seconds = (time.perf_counter() - started) / CHECK_ALLREDUCES
    started = time.perf_counter()
    if args.checkpoint and dist.get_rank() == 0:
        save_checkpoint(f"{args.checkpoint}.check", checkpointed, {})
        os.remove(f"{args.checkpoint}.check")
    dist.barrier(group=gloo_group)  # DDP: the others wait until the save is complete
    save_seconds = time.perf_counter() - started
    return max_over_ranks([step_seconds, allreduce_seconds, save_seconds, peak_memory], device)


if __name__ == "__main__":
    main()
