"""Step 03: DistributedDataParallel, one process per GPU, started by torch.multiprocessing.spawn.

Run:  bash 03_ddp_mpspawn/run.sh --epochs 3 --checkpoint ckpt03.pt
      (--dataset synthetic needs no download; Python 3.10 or later)

Changed since 02: mp.spawn starts --world-size processes, one per GPU (NCCL; Gloo on the CPU),
which meet at a store that this process serves. Each wraps the model in DDP and trains on its own
share of every epoch; only rank 0 prints and saves. The global batch is --batch-size x world size
x --accumulate.
"""
import argparse
import math
import os
import socket
import sys
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
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
    parser.add_argument("--workers", type=int, default=0,
                        help="data-loader worker processes per process "
                             "(0: none, for data in memory; more for files)")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="save after every epoch; resume if PATH exists")
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
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count() or 2,
                        help="processes to start: one per GPU, or 2 on a CPU")
    args = parser.parse_args()
    minimums = dict(epochs=1, batch_size=1, test_batch_size=1, accumulate=1, workers=0,
                    log_interval=0, clip_grad=0, lr=0, collective_timeout=1)
    for flag, minimum in minimums.items():
        if not minimum <= getattr(args, flag) < math.inf:  # not NaN either
            parser.error(f"--{flag.replace('_', '-')} must be at least {minimum}, and finite")
    if not 0 <= args.warmup < 1:
        parser.error("--warmup must be at least 0 and below 1")
    if not 1 <= args.world_size <= (torch.cuda.device_count() or args.world_size):
        parser.error("--world-size must be at least 1 and at most the GPUs")
    return args


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


def make_loaders(args, rank, world_size, device, gloo_group):
    # Returns (train loader, test loader) of --dataset: this rank's share of each.
    if rank != 0:  # DDP: rank 0 loads the data first, downloading what is missing; the others next
        dist.barrier(group=gloo_group)
    train_set, test_set = load_datasets(args)
    if rank == 0:
        dist.barrier(group=gloo_group)
    # DDP: each rank takes every world_size-th index of the epoch's order, padded to equal steps.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
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


def train_one_epoch(args, model, loader, optimizer, peak_lrs, device, epoch):
    """One pass over loader; returns (mean training loss, samples)."""
    model.train()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # [loss sum, count, samples]
    logged_sums, logged_at = sums.clone(), time.perf_counter()  # at the last progress line
    batches = iter(loader)  # draws the workers' seeds: from train()'s seeding, not a step's
    steps_per_epoch = math.ceil(len(loader) / args.accumulate)  # optimizer steps
    for step in range(steps_per_epoch):
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
    return (sums[0] / sums[1]).item(), int(sums[2])


@torch.no_grad()
def evaluate(model, loader, device, seed):
    """Returns [loss sum, metric sum, count] over loader."""
    model.eval()
    torch.manual_seed(seed)  # a model that samples (a VAE) gives the same figures after a resume
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in loader:
        inputs, targets = (tensor.to(device, non_blocking=True) for tensor in batch)
        for i, value in enumerate(loss_and_metric(model(inputs), targets)):
            sums[i] += value  # on the device: no GPU sync per batch
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


def setup(rank, local_rank, world_size, timeout, store=None):
    """DDP: picks this process's device and joins the process group (at store, or at
    MASTER_ADDR:MASTER_PORT); returns the device and a Gloo group to wait for rank 0 in."""
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"  # DDP: one GPU per process
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    # DDP: a collective fails after timeout seconds without every rank; the launcher ends the rest.
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    print(f"rank {rank}/{world_size} local_rank {local_rank} host {socket.gethostname()} "
          f"pid {os.getpid()} device {device} backend {backend} "
          f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}\n",
          end="", flush=True)  # one write, so that the ranks' lines do not interleave
    # DDP: a Gloo group (no GPU memory) to wait in, an hour, while rank 0 downloads or saves.
    gloo_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(3600, timeout)))
    return device, gloo_group


def train(args, rank, world_size, device, gloo_group):
    is_main = rank == 0  # DDP: only global rank 0 prints and saves
    train_loader, test_loader = make_loaders(args, rank, world_size, device, gloo_group)
    torch.manual_seed(args.seed)  # the same initial weights for the same seed
    model = Net().to(device)
    optimizer = make_optimizer(model, args)
    peak_lrs = [group["lr"] for group in optimizer.param_groups]  # this run's, not a checkpoint's
    # What a checkpoint holds and a resume restores, by name: add yours (01's page: an EMA).
    checkpointed = {"model": model, "optimizer": optimizer}
    progress, load_error = load_checkpoint(args.checkpoint, checkpointed)
    check_same_checkpoint(args.checkpoint, progress, load_error, gloo_group)  # DDP: a site check
    start_epoch = progress["epoch"] if progress else 0
    if progress and progress.get("step"):  # saved inside an epoch by 05 or 06
        exit_with_error(f"{args.checkpoint} stopped inside epoch {start_epoch + 1}; resume it "
                        "with 05 or 06, or from an end-of-epoch checkpoint")
    if progress and is_main:
        print(f"resumed from {args.checkpoint} after epoch {start_epoch}", flush=True)
    # DDP: copies rank 0's weights to every rank, then averages gradients during backward.
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)

    for epoch in range(start_epoch, args.epochs):
        train_loader.sampler.set_epoch(epoch)  # DDP: else every epoch repeats the first's order
        # The data-loader workers' seeds (persistent workers': once per run). DDP: and by rank.
        torch.manual_seed(hash((args.seed, rank, epoch)))
        start = time.perf_counter()
        loss, samples = train_one_epoch(args, ddp_model, train_loader, optimizer, peak_lrs, device,
                                        epoch)
        train_time = time.perf_counter() - start
        # -1: the seed of no training step, so that evaluation draws numbers of its own.
        test_loss, metric, count = evaluate(model, test_loader, device,
                                            hash((args.seed, rank, epoch, -1)))
        if args.checkpoint and is_main:
            save_checkpoint(args.checkpoint, checkpointed, {"epoch": epoch + 1})
        dist.barrier(group=gloo_group)  # DDP: the others wait until the checkpoint is complete
        if is_main:
            print(f"epoch {epoch + 1}/{args.epochs} | train loss {loss:.4f} | "
                  f"test loss {test_loss / count:.4f} | test {METRIC} {metric / count:.4f} "
                  f"of {count:.0f} | {samples / train_time:.0f} samples/s | "
                  f"{time.perf_counter() - start:.1f} s", flush=True)


def run(rank, args):
    """One training process; mp.spawn passes its index: its rank and local rank (one machine)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    device, gloo_group = setup(rank, rank, args.world_size, args.collective_timeout, store)
    train(args, rank, args.world_size, device, gloo_group)
    # DDP: not after an error, where NCCL's clean-up can hang: the launcher ends all.
    dist.destroy_process_group()


def main():
    args = parse_args()
    # DDP: the ranks meet at a store this process holds all run, on a free port the OS picks.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    try:
        mp.spawn(run, args=(args,), nprocs=args.world_size)  # returns when all have finished
    except mp.ProcessExitedException as error:  # a rank exited or was killed
        # Its own error is printed above, but not a signal's.
        sys.exit(f"error: {error}" if error.signal_name else error.exit_code)


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


if __name__ == "__main__":
    main()
