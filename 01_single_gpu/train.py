"""Step 01: train a small CNN on MNIST in one process on one device.

Run:  bash 01_single_gpu/run.sh --epochs 3 --checkpoint ckpt01.pt   (--dataset synthetic needs no download)

The baseline that every later step changes a little: what a step does not change stays the same
bytes in every folder, so `diff` between neighbouring folders shows only the step. It uses the GPU
when there is one, else the CPU.
"""
import argparse
import math
import os
import socket
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset


def parse_args():
    class Defaults(argparse.ArgumentDefaultsHelpFormatter):  # --help shows the defaults, but no "None"
        def _get_help_string(self, action):
            return action.help if action.default is None else super()._get_help_string(action)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=Defaults)  # names the step
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per micro-batch in each process")
    parser.add_argument("--test-batch-size", type=int, default=1000, help="samples per evaluation step in each process")
    parser.add_argument("--lr", type=float, default=0.01, help="peak learning rate (make_optimizer: SGD, momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, the data order and other randomness")
    parser.add_argument("--dataset", choices=["mnist", "synthetic"], default="mnist",
                        help="real MNIST, or MNIST-shaped data made in memory (no download)")
    parser.add_argument("--data-dir", default="data", help="folder that holds or receives MNIST")
    parser.add_argument("--workers", type=int, default=0,
                        help="data-loader worker processes per process (0: none, for data in memory; more for files)")
    parser.add_argument("--checkpoint", metavar="PATH", help="save after every epoch; resume if PATH exists")
    parser.add_argument("--log-interval", type=int, default=200,
                        help="steps between progress lines inside an epoch (0: only the line at its end)")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches of --batch-size per optimizer step")
    parser.add_argument("--warmup", type=float, default=0, help="fraction of the run in which the rate rises to --lr")
    parser.add_argument("--cosine", action="store_true", help="then let the rate fall along a cosine to 0 at the end")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast (GPUs from Ampere on, real models)")
    parser.add_argument("--clip-grad", type=float, default=0, metavar="NORM",
                        help="scale the gradient down to this norm before each optimizer step (0: never)")
    args = parser.parse_args()
    if (min(args.epochs, args.batch_size, args.test_batch_size, args.accumulate) < 1 or not args.lr > 0
            or min(args.workers, args.log_interval, args.clip_grad) < 0 or not 0 <= args.warmup < 1):
        parser.error("--epochs, --batch-size, --test-batch-size and --accumulate must be at least 1, --lr above 0, "
                     "--workers, --log-interval, --clip-grad and --warmup at least 0, --warmup below 1")
    return args


# Your task replaces these, down to make_optimizer: the data, the model, the loss and metric, the optimizer.
def load_datasets(args):
    """Returns (train, test): datasets that take one index and return one (image, label), as torchvision's do.
    These two are decoded and normalised into memory once; yours may read each sample from disk instead."""
    if args.dataset == "synthetic":  # each class is a fixed random pattern under noise, the same everywhere
        generator = torch.Generator().manual_seed(1234)
        patterns = 2 * torch.randn(10, 1, 28, 28, generator=generator)
        labels = torch.randint(0, 10, (4_000,), generator=generator)
        images = patterns[labels] + torch.randn(len(labels), 1, 28, 28, generator=generator)
        return TensorDataset(images[:3_200], labels[:3_200]), TensorDataset(images[3_200:], labels[3_200:])
    from torchvision import datasets  # imported only for MNIST: it takes a second or more
    try:  # downloads what --data-dir lacks (torchvision checks the files first)
        splits = [datasets.MNIST(args.data_dir, train=train, download=True) for train in (True, False)]
    except (OSError, RuntimeError) as error:  # no internet, as on many compute nodes
        reason = " ".join(str(error).split())  # torchvision's message spans lines
        sys.exit(f"error: MNIST is not in {args.data_dir} and could not be downloaded ({reason}); fetch it where "
                 f"there is internet: python -c \"from torchvision.datasets import MNIST; MNIST('{args.data_dir}', "
                 f"download=True)\", then copy the folder (or use --dataset synthetic)")
    return [TensorDataset((s.data.unsqueeze(1) / 255 - 0.1307) / 0.3081, s.targets) for s in splits]


class Net(nn.Module):
    """A small CNN without dropout or BatchNorm (03's page says why). SiLU and average pooling, not ReLU and max
    pooling: smooth, so the rounding differences between steps (DDP adds in another order) stay near 1e-6."""

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
    """Returns (loss sum, metric sum, count) of a batch: sums over what the loss is a mean of (samples here; tokens,
    say, for a sequence model), which add up exactly over batches and ranks. Training minimises loss sum / count."""
    loss = F.cross_entropy(output, target, reduction="sum")
    return loss, (output.argmax(dim=1) == target).sum(), len(target)


def make_optimizer(model, args):
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)  # per-group rates and AdamW work too


def get_lr(step, steps, args):  # the rate of optimizer step `step` of the run's `steps`, times each group's own
    warmup = args.warmup * steps  # optimizer steps of warm-up; 0 without --warmup
    if step < warmup:  # rises linearly
        return (step + 1) / (warmup + 1)
    if args.cosine:  # then falls along a cosine, to 0 at the end
        return (1 + math.cos(math.pi * min(1, (step - warmup) / (steps - warmup)))) / 2
    return 1


def train_one_epoch(args, model, loader, optimizer, scheduler, device, epoch):
    """One pass over loader; returns (mean training loss, samples); progress every --log-interval steps."""
    model.train()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # [loss sum, count, samples]
    logged, logged_at = totals.clone(), time.perf_counter()  # the totals and time at the last progress line
    batches, steps = iter(loader), math.ceil(len(loader) / args.accumulate)  # iter() draws: before the seeding below
    for step in range(steps):
        torch.default_generator.manual_seed(seed := hash((args.seed, epoch, step)))  # dropout: as if never stopped
        if device.type == "cuda":  # not torch.manual_seed, which seeds every kind of device: 0.1 ms a call
            torch.cuda.manual_seed_all(seed)  # every GPU's generator (02's replicas draw on all of them)
        group = min(args.accumulate, len(loader) - step * args.accumulate)  # the epoch's last group may be short
        for micro in range(group):
            inputs, targets = (tensor.to(device, non_blocking=True) for tensor in next(batches))
            with torch.autocast(device.type, torch.bfloat16, enabled=args.amp):  # bf16 where autocast finds it safe
                loss_sum, _, count = loss_and_metric(model(inputs), targets)
            (loss_sum / count / group).backward()  # the gradients add up to those of the mean of the group's means
            totals[0] += loss_sum.detach()  # stays on the device: no GPU sync per step
            totals[1] += count
            totals[2] += len(inputs)
        if args.clip_grad:  # the whole step's gradient, after its last backward
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if args.log_interval and (step + 1) % args.log_interval == 0:  # one GPU sync per progress line, none between
            (loss_sum, count, samples), now = (totals - logged).tolist(), time.perf_counter()
            print(f"epoch {epoch + 1} step {step + 1}/{steps} | loss {loss_sum / count:.4f} | "
                  f"{samples / (now - logged_at):.0f} samples/s", flush=True)
            logged, logged_at = totals.clone(), now
    return (totals[0] / totals[1]).item(), int(totals[2])


@torch.no_grad()
def evaluate(model, loader, device):
    """Returns [loss sum, metric sum, count] over loader."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for inputs, targets in loader:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        for i, value in enumerate(loss_and_metric(model(inputs), targets)):
            sums[i] += value  # on the device: no GPU sync per batch
    return sums.tolist()


def save_checkpoint(path, stateful, **position):
    """Saves each stateful object's state_dict() by name, and the position: a crash mid-write leaves the old file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        torch.save({**{name: obj.state_dict() for name, obj in stateful.items()}, **position}, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
    os.replace(path + ".tmp", path)  # atomic on POSIX filesystems


def load_checkpoint(path, stateful):
    """Restores each stateful object from path if it exists; returns where it left off ({"epoch": ...}), or None.
    The file is mapped, not read: its tensors are copied once, onto this process's device, and nothing else kept."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True) if os.path.exists(path) else None
    for name, obj in stateful.items() if state is not None else ():
        obj.load_state_dict(state.pop(name))  # onto this process's device, whatever the saver's was
    return state


def train(args, device):
    train_set, test_set = load_datasets(args)
    # The order depends only on --seed and the epoch (reseeded below), so a resumed run sees the same batches.
    generator = torch.Generator()
    sampler = RandomSampler(train_set, generator=generator)
    loader_args = dict(num_workers=args.workers, pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, **loader_args)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, **loader_args)

    torch.manual_seed(args.seed)  # the same initial weights for the same seed
    model = Net().to(device)
    optimizer = make_optimizer(model, args)
    settings = [dict(group, initial_lr=group["lr"]) for group in optimizer.param_groups]  # initial_lr: get_lr's base
    # What a checkpoint holds and a resume restores, by name: add yours (a GradScaler, an EMA: 01's page).
    stateful = {"model": model, "optimizer": optimizer}
    position = load_checkpoint(args.checkpoint, stateful) if args.checkpoint else None
    for group, setting in zip(optimizer.param_groups, settings):
        group.update(setting)  # this run's rates and settings (a changed flag), not the saved ones
    # The rate of optimizer step s is a formula of s (as nanoGPT's): a resume recomputes it from the steps trained, as
    # this run counts them, under another --epochs, --lr or global batch too.
    per_epoch = math.ceil(len(train_loader) / args.accumulate)  # optimizer steps of an epoch
    steps = args.epochs * per_epoch  # of the run
    steps_done = position["epoch"] * per_epoch + position.get("step", 0) if position else 0  # before this run
    scheduler = torch.optim.lr_scheduler.LambdaLR(  # built at the steps done: its first rate is the next step's
        optimizer, lambda step: get_lr(step, steps, args), last_epoch=steps_done - 1)
    start_epoch = position["epoch"] if position else 0
    if position and position.get("step"):  # saved inside an epoch by 05 or 06, which go on from that step
        sys.exit(f"error: {args.checkpoint} stopped inside epoch {start_epoch + 1}; resume it with the step that wrote "
                 "it (05 or 06), or start from a checkpoint saved at the end of an epoch")
    if position:
        print(f"resumed from {args.checkpoint} after epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        generator.manual_seed(args.seed + epoch)
        torch.manual_seed(hash((args.seed, epoch)))  # data-loader workers' seeds (persistent ones': once per run)
        start = time.perf_counter()
        loss, samples = train_one_epoch(args, model, train_loader, optimizer, scheduler, device, epoch)
        train_time = time.perf_counter() - start
        test_loss, metric, count = evaluate(model, test_loader, device)
        if args.checkpoint:
            save_checkpoint(args.checkpoint, stateful, epoch=epoch + 1)
        summary = (f"epoch {epoch + 1}/{args.epochs} | train loss {loss:.4f} | test loss {test_loss / count:.4f} | "
                   f"test {METRIC} {metric / count:.4f} of {count:.0f} | {samples / train_time:.0f} samples/s | "
                   f"{time.perf_counter() - start:.1f} s")
        print(summary, flush=True)


def main():
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"host {socket.gethostname()} pid {os.getpid()} device {device}", flush=True)
    train(args, device)


if __name__ == "__main__":
    main()
