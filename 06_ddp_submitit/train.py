"""Step 06: DDP submitted from Python with submitit, to Slurm or to processes on this machine.

Run:  python 06_ddp_submitit/train.py --nodes 2 --gpus-per-node 4 --epochs 3 --checkpoint ckpt.pt
      python 06_ddp_submitit/train.py --local --dataset synthetic   (no cluster needed)

Changed since 05: no batch script: this file submits itself through submitit, prints the job's log
folder and waits for it. In every task TorchDistributedEnvironment exports the rendezvous variables.
The job is Checkpointable: on SIGUSR2 (timeout or preemption) all ranks stop at the same step, rank
0 saves, and submitit's handler calls checkpoint() and requeues the job, which resumes from there.
"""
import argparse
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import submitit
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Subset, TensorDataset


def parse_args():
    parser = argparse.ArgumentParser(description="Train a small CNN on MNIST.")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step in each process")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate of SGD with momentum 0.9")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data order")
    parser.add_argument("--dataset", choices=["mnist", "synthetic"], default="mnist",
                        help="real MNIST, or MNIST-shaped data made in memory (no download)")
    parser.add_argument("--data-dir", default="data", help="folder that holds or receives MNIST")
    parser.add_argument("--workers", type=int,
                        help="data-loader worker processes per process (default: half of --cpus-per-task)")
    parser.add_argument("--checkpoint", metavar="PATH", help="save after every epoch; resume if PATH exists")
    parser.add_argument("--log-interval", type=int, default=200,
                        help="steps between progress lines inside an epoch (0: only the line at its end)")
    parser.add_argument("--collective-timeout", type=float, default=600,
                        help="seconds a collective waits for every rank: a rank that stops answering ends the run "
                             "after this long (rank 0's download and checkpoints get at least an hour)")
    parser.add_argument("--local", action="store_true", help="run the tasks as processes on this machine")
    parser.add_argument("--nodes", type=int, default=1, help="Slurm nodes")
    parser.add_argument("--gpus-per-node", type=int,
                        help="GPUs per node: needed on Slurm (0 for CPU nodes); with --local, this machine's")
    parser.add_argument("--tasks-per-node", type=int,
                        help="processes per node: one per GPU (default: --gpus-per-node, or 2 without GPUs)")
    parser.add_argument("--cpus-per-task", type=int, default=1, help="cores per process")
    parser.add_argument("--timeout-min", type=int, default=60, help="time limit of the job in minutes")
    parser.add_argument("--max-timeouts", type=int,
                        help="Slurm: times the job is requeued at its time limit before submitit fails it "
                             "(default: 100 with --checkpoint; without, each requeue starts over: submitit's 3)")
    parser.add_argument("--partition", help="Slurm partition (default: the cluster's default)")
    parser.add_argument("--log-dir", default="submitit_logs", help="every job gets a new log folder in here")
    args = parser.parse_args()
    if min(args.nodes, args.tasks_per_node or 1, args.cpus_per_task, args.timeout_min) < 1 or args.tasks_per_node == 0:
        parser.error("--nodes, --tasks-per-node, --cpus-per-task and --timeout-min must be at least 1")
    args.max_timeouts = (100 if args.checkpoint else 3) if args.max_timeouts is None else args.max_timeouts
    if args.max_timeouts < 0:
        parser.error("--max-timeouts must be at least 0")
    if args.local and args.nodes > 1:
        parser.error("--local runs the tasks on this machine: one node")
    # submitit: the task's cores are split so that nothing runs on top of anything else: half for data-loader
    # workers (one core each), the rest for the main process's threads (OMP_NUM_THREADS, set on Slurm in main()).
    args.workers = args.cpus_per_task // 2 if args.workers is None else args.workers
    if args.epochs < 1 or args.batch_size < 1 or min(args.workers, args.log_interval) < 0 or not args.lr > 0:
        parser.error("--epochs and --batch-size must be at least 1, --workers and --log-interval at least 0, "
                     "--lr above 0")
    if not args.collective_timeout > 0:
        parser.error("--collective-timeout must be above 0 seconds")
    # submitit: the launcher often runs on a login node, whose GPUs (none) say nothing of the compute nodes'.
    if args.gpus_per_node is None and not args.local and submitit.AutoExecutor.which() == "slurm":
        parser.error("--gpus-per-node is needed on Slurm: the GPUs of each compute node (0 for CPU nodes)")
    args.gpus_per_node = torch.cuda.device_count() if args.gpus_per_node is None else args.gpus_per_node
    args.tasks_per_node = args.tasks_per_node or args.gpus_per_node or 2
    return args


def download_mnist(data_dir):
    """Fetch MNIST into data_dir unless it is there already (torchvision checks the files first)."""
    from torchvision import datasets  # imported only for MNIST: it takes a second or more
    try:
        datasets.MNIST(data_dir, download=True)
    except (OSError, RuntimeError) as error:  # no internet, as on many compute nodes
        reason = " ".join(str(error).split())  # torchvision's message spans lines
        sys.exit(f"error: MNIST is not in {data_dir} and could not be downloaded ({reason}); fetch it where "
                 f"there is internet: python -c \"from torchvision.datasets import MNIST; MNIST('{data_dir}', "
                 f"download=True)\", then copy the folder (or use --dataset synthetic)")


def load_datasets(args):
    """Returns (train, test) as in-memory tensors: decoded and normalised once, not per sample."""
    if args.dataset == "synthetic":  # each class is a fixed random pattern under noise, the same everywhere
        generator = torch.Generator().manual_seed(1234)
        patterns = torch.randn(10, 1, 28, 28, generator=generator)
        labels = torch.randint(0, 10, (8_000,), generator=generator)
        images = patterns[labels] + torch.randn(len(labels), 1, 28, 28, generator=generator)
        return TensorDataset(images[:6_000], labels[:6_000]), TensorDataset(images[6_000:], labels[6_000:])
    from torchvision import datasets
    splits = [datasets.MNIST(args.data_dir, train=train) for train in (True, False)]
    return [TensorDataset((s.data.unsqueeze(1) / 255 - 0.1307) / 0.3081, s.targets) for s in splits]


class Net(nn.Module):
    """A small CNN. No dropout and no BatchNorm: dropout draws other masks in each process and BatchNorm
    normalises over each process's own batch, so the steps would compute different things (a model with
    BatchNorm wants nn.SyncBatchNorm under DDP). SiLU and average pooling rather than ReLU and max pooling:
    their output moves smoothly with the weights, so the rounding differences between steps (DDP adds
    gradients in another order) stay near 1e-6 instead of flipping which input wins a max and growing."""

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


class ResumableSampler(DistributedSampler):
    """SLURM: a DistributedSampler that skips the first `start` indices of this rank's share of the epoch, so
    that a job resumed inside an epoch does not load the batches it trained before it was stopped."""
    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self):
        return max(0, super().__len__() - self.start)


STOP = {"requested": False}  # SLURM: set by the SIGUSR2 handler
STOP_CHECK_SECONDS = 10  # SLURM: the ranks agree on stopping about this often; the warning comes 120 s ahead


def signalled():
    """SLURM: whether this process has had SIGUSR2: through the handler, or pending where it is blocked."""
    return STOP["requested"] or signal.SIGUSR2 in signal.sigpending()


def stop_requested(device, since):
    """SLURM: a collective; returns (True on every rank once any rank has had the signal, the slowest rank's
    seconds since `since`), so that all ranks stop at the same step and plan the next check alike."""
    state = torch.tensor([float(signalled()), time.monotonic() - since], device=device)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    stop, seconds = state.tolist()
    return stop > 0, seconds


def train_one_epoch(model, loader, optimizer, device, epoch, log_interval, start_step=0):
    """One pass over loader, whose sampler starts at batch start_step; returns ([sum of losses, samples] over
    all ranks, None), or the same until the stop and the step at which all ranks stopped on SIGUSR2. Every
    log_interval steps (0: never) it prints the mean loss and the speed since the line before."""
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of losses, samples]
    logged, logged_at = totals.clone(), time.perf_counter()  # the totals and time at the last progress line
    check_at, every, last_check, stopped_at = start_step, 1, time.monotonic(), None
    for step, (images, labels) in enumerate(loader, start_step):
        if step == check_at:  # SLURM: each check waits for the GPU, so as many steps apart as take STOP_CHECK_SECONDS
            stop, seconds = stop_requested(device, last_check)
            if stop:
                stopped_at = step
                break
            step_seconds = seconds / every  # on the slowest rank: the same number on every rank
            every = max(1, min(2 * every, int(STOP_CHECK_SECONDS / max(step_seconds, 1e-6))))
            check_at, last_check = step + every, time.monotonic()
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        totals[0] += loss.detach() * len(labels)  # stays on the device: no GPU sync per step
        totals[1] += len(labels)
        if log_interval and (step + 1) % log_interval == 0:  # one GPU sync per progress line, none between
            (loss_sum, samples), now = (totals - logged).tolist(), time.perf_counter()
            # DDP: rank 0's own loss (an average over ranks would take a collective); each rank trains as many.
            print(f"epoch {epoch + 1} step {step + 1}/{start_step + len(loader)} | loss {loss_sum / samples:.4f} "
                  f"(rank 0) | {samples * dist.get_world_size() / (now - logged_at):.0f} samples/s", flush=True)
            logged, logged_at = totals.clone(), now
    dist.all_reduce(totals)  # DDP: sum over ranks, so rank 0 reports the global mean loss
    return totals.tolist(), stopped_at


@torch.no_grad()
def evaluate(model, loader, device):
    """Returns [correct, total] over loader, or None on every rank when a rank had SIGUSR2 before the end."""
    model.eval()
    counts = torch.zeros(3, dtype=torch.int64, device=device)  # [correct, total, ranks that stopped early]
    for images, labels in loader:
        if signalled():  # SLURM: no collective here, as ranks may have one batch more than others
            counts[2] = 1
            break
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        counts[0] += (model(images).argmax(dim=1) == labels).sum()
        counts[1] += len(labels)
    dist.all_reduce(counts)  # DDP: add up the ranks' disjoint shards
    return None if counts[2] else counts[:2].tolist()


def save_checkpoint(path, model, optimizer, epoch, **position):
    """Write a temporary file, then rename it: a crash mid-write leaves the previous checkpoint intact. SLURM:
    position says where in the next epoch training stopped, what that depends on, and the loss until then."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, **position}, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
    os.replace(path + ".tmp", path)  # atomic on POSIX filesystems


def load_checkpoint(path, model, optimizer, group):
    """Restore model and optimizer from path if it exists; returns the checkpoint, or None. DDP: rank 0 alone
    looks for path and reads it, and every rank loads what it read: all resume from one state, even where a
    node's view of shared storage lags behind. The others wait for rank 0's read in group."""
    state = [torch.load(path, map_location="cpu") if dist.get_rank() == 0 and os.path.exists(path) else None]
    dist.broadcast_object_list(state, group=group)  # DDP: rank 0's object, pickled, to all (on the CPU, in Gloo)
    state = state[0]
    if state is not None:
        model.load_state_dict(state["model"])  # onto this process's device, whatever the saver's was
        optimizer.load_state_dict(state["optimizer"])
    return state


def setup(rank, local_rank, world_size, timeout, store=None):
    """DDP: pick this process's device and join the process group (through store, which only 03 passes, or
    the MASTER_ADDR and MASTER_PORT of the environment); returns the device."""
    if torch.cuda.is_available():
        # DDP: one process per GPU. The task sees all of its node's GPUs (take the local rank's) or, where the
        # site binds one GPU per task (--gpus-per-task, --gpu-bind, a container), only its own, as cuda:0.
        visible = torch.cuda.device_count()
        if local_rank >= visible and visible != 1:
            sys.exit(f"error: local rank {local_rank} sees {visible} GPUs (CUDA_VISIBLE_DEVICES="
                     f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give each task all of its node's GPUs "
                     "or exactly one, and start one process per GPU")
        device, backend = torch.device("cuda", local_rank if local_rank < visible else 0), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    # DDP: a collective fails after timeout seconds without every rank, and the launcher then ends the others.
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    facts = (f"rank {rank}/{world_size} local_rank {local_rank} host {socket.gethostname()} pid {os.getpid()} "
             f"device {device} backend {backend} master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    print(facts + "\n", end="", flush=True)  # one write, so that the ranks' lines do not interleave
    return device


def train(args, rank, world_size, device):
    is_main = rank == 0  # DDP: only global rank 0 downloads, prints and saves
    # DDP: while rank 0 alone works (download, reading or writing a checkpoint) the others wait in this group,
    # which allows at least an hour, as that work can outlast --collective-timeout. Gloo: on the CPU, no GPU memory.
    rank0_work = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(3600, args.collective_timeout)))
    if args.dataset == "mnist" and is_main:
        download_mnist(args.data_dir)
    dist.barrier(group=rank0_work)  # DDP: the other ranks read MNIST only once rank 0 has it
    train_set, test_set = load_datasets(args)
    # DDP: each rank takes every world_size-th index of the epoch's order, which depends only on --seed
    # and the epoch (set below); a few repeats pad it so that all ranks take the same number of steps.
    sampler = ResumableSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    loader_args = dict(num_workers=args.workers, pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    # Whole batches: the dataset gets each batch's list of indices, which a TensorDataset takes in one indexing
    # (not one call per sample and a stack). A dataset that takes one index at a time needs the usual
    # DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, **loader_args).
    batches = BatchSampler(sampler, args.batch_size, drop_last=False)
    train_loader = DataLoader(train_set, sampler=batches, batch_size=None, **loader_args)
    # DDP: each rank scores a disjoint slice of the test set, with no padding, so the sums are exact.
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=1000, **loader_args)

    torch.manual_seed(args.seed)  # the same initial weights for the same seed
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    checkpoint = load_checkpoint(args.checkpoint, model, optimizer, rank0_work) if args.checkpoint else None
    start_epoch = checkpoint["epoch"] if checkpoint else 0
    # SLURM: a job stopped inside an epoch goes on from that step, with the loss summed until then. The step
    # means the same samples under any layout of the same global batch: the epoch's order is split by rank.
    start_step, done = 0, [0, 0]
    if checkpoint and checkpoint.get("step"):
        start_step, done = checkpoint["step"], checkpoint["totals"]
        if checkpoint["world_size"] * checkpoint["batch_size"] != world_size * args.batch_size:
            sys.exit(f"error: {args.checkpoint} stopped inside epoch {start_epoch + 1} with {checkpoint['world_size']} "
                     f"processes x {checkpoint['batch_size']} samples per step; resume it with that global batch "
                     f"(now {world_size} x {args.batch_size}) or from an end-of-epoch checkpoint" if is_main else 1)
    if checkpoint and is_main:
        print(f"resumed from {args.checkpoint} after epoch {start_epoch} step {start_step}", flush=True)
    # DDP: copies rank 0's weights to every rank, then averages gradients during backward.
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # DDP: without it every epoch repeats the first epoch's order
        sampler.start = start_step * args.batch_size  # SLURM: this rank's samples of the steps trained already
        start = time.perf_counter()
        (loss_sum, samples), stopped_at = train_one_epoch(ddp_model, train_loader, optimizer, device, epoch,
                                                          args.log_interval if is_main else 0, start_step)
        train_time, totals = time.perf_counter() - start, [done[0] + loss_sum, done[1] + samples]
        counts = evaluate(model, test_loader, device) if stopped_at is None else None
        if counts is None:  # SLURM: stopped in training or evaluation: save where, then requeue the job
            stopped_at = start_step + len(train_loader) if stopped_at is None else stopped_at
            if args.checkpoint and is_main:
                save_checkpoint(args.checkpoint, model, optimizer, epoch, step=stopped_at, world_size=world_size,
                                batch_size=args.batch_size, totals=totals)
            dist.barrier(group=rank0_work)
            note = "" if args.checkpoint else " (no --checkpoint: the job will start over)"
            return requeue(is_main, f"epoch {epoch + 1} step {stopped_at}{note}")
        correct, total = counts
        loss, start_step, done = totals[0] / totals[1], 0, [0, 0]  # SLURM: later epochs start at step 0
        if args.checkpoint and is_main:
            save_checkpoint(args.checkpoint, model, optimizer, epoch + 1)
        dist.barrier(group=rank0_work)  # DDP: the others wait until the checkpoint is complete
        summary = (f"epoch {epoch + 1}/{args.epochs} | train loss {loss:.4f} | test acc {100 * correct / total:.2f}% "
                   f"({correct}/{total}) | {samples / train_time:.0f} samples/s | {time.perf_counter() - start:.1f} s")
        if is_main:
            print(summary, flush=True)


def requeue(is_main, position):
    """submitit: its handler calls Trainer.checkpoint() and requeues the job on rank 0, then exits."""
    if is_main:
        print(f"stopped at {position} on SIGUSR2: submitit requeues the job", flush=True)
    # submitit: the requeue has Slurm send SIGTERM to the job's processes, maybe before the `scontrol requeue`
    # that asked for it has returned (a busy controller). Ignored, also by scontrol, else submitit's requeue
    # fails; and the death of a data-loader worker from it must not raise here (PyTorch's SIGCHLD handler).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    STOP["submitit_handler"](signal.SIGUSR2, None)
    sys.exit(0)  # other ranks: leave without a result; the requeued job writes it


class Trainer(submitit.helpers.Checkpointable):
    """The job that submitit runs in every task; Checkpointable, so a timeout or preemption requeues it."""

    def checkpoint(self, args):
        """submitit calls this on rank 0 to get the job to run again, which resumes from --checkpoint. It pickles
        that job with this module's globals, so STOP is first reset to how a new job starts."""
        STOP.clear()
        STOP["requested"] = False
        return submitit.helpers.DelayedSubmission(Trainer(), args)

    def __call__(self, args):
        # submitit: SIGUSR2 is its timeout/preemption signal. Ours first stops all ranks at one step; blocked
        # as in 05, so that data-loader workers started by forkserver or spawn keep it pending, not die of it.
        STOP["submitit_handler"] = signal.signal(signal.SIGUSR2, lambda signum, frame: STOP.update(requested=True))
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
        dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        device = setup(dist_env.rank, dist_env.local_rank, dist_env.world_size, args.collective_timeout)
        try:
            train(args, dist_env.rank, dist_env.world_size, device)
        finally:
            dist.destroy_process_group()  # DDP: also after an error


def main():
    args = parse_args()
    # submitit: the job inherits this shell's environment. One inside an allocation, or that ran torchrun, has
    # these set: TorchDistributedEnvironment would take that MASTER_PORT and refuse to export over the rest.
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    # submitit: Slurm when there is one (or --local: processes here); a new log folder for every launch.
    folder = os.path.join(args.log_dir, time.strftime("%Y%m%d-%H%M%S"))
    executor = submitit.AutoExecutor(folder=folder, cluster="local" if args.local else None,
                                     slurm_max_num_timeout=args.max_timeouts)  # submitit: else the 4th time-out fails
    executor.update_parameters(name="ddp-submitit", nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                               gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
                               timeout_min=args.timeout_min, slurm_partition=args.partition,
                               slurm_signal_delay_s=120,
                               # submitit: its srun does not pass --cpus-per-task on, which Slurm 22.05 to
                               # 23.02 do not do by themselves: where tasks are bound, each gets one core.
                               slurm_srun_args=["--kill-on-bad-exit=1", f"--cpus-per-task={args.cpus_per_task}"],
                               slurm_setup=[f"export OMP_NUM_THREADS={args.cpus_per_task - args.cpus_per_task // 2}"])
    job = executor.submit(Trainer(), args)
    print(f"submitted job {job.job_id}; logs in {job.paths.folder} (rank 0: {job.job_id}_0_log.out)", flush=True)
    job.results()  # waits for the job, through requeues, and raises its error if it failed
    print(f"job {job.job_id} finished", flush=True)


if __name__ == "__main__":
    main()
