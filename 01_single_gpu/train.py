"""Step 01: train a small CNN on MNIST in one process on one device.

Run:  bash 01_single_gpu/run.sh --epochs 3 --checkpoint ckpt01.pt   (--dataset synthetic needs no download)

The baseline that every later step changes a little: the model, data, evaluation, checkpointing
and logging stay the same in every folder, so `diff` between neighbouring folders shows only the
step. It uses the GPU when there is one, else the CPU.
"""
import argparse
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
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step in each process")
    parser.add_argument("--test-batch-size", type=int, default=1000, help="samples per evaluation step in each process")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate of SGD with momentum 0.9")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, the data order and other randomness")
    parser.add_argument("--dataset", choices=["mnist", "synthetic"], default="mnist",
                        help="real MNIST, or MNIST-shaped data made in memory (no download)")
    parser.add_argument("--data-dir", default="data", help="folder that holds or receives MNIST")
    parser.add_argument("--workers", type=int, default=0,
                        help="data-loader worker processes per process (0: none, for data in memory; more for files)")
    parser.add_argument("--checkpoint", metavar="PATH", help="save after every epoch; resume if PATH exists")
    parser.add_argument("--log-interval", type=int, default=200,
                        help="steps between progress lines inside an epoch (0: only the line at its end)")
    args = parser.parse_args()
    if min(args.epochs, args.batch_size, args.test_batch_size) < 1 or min(args.workers, args.log_interval) < 0:
        parser.error("--epochs, --batch-size and --test-batch-size must be at least 1, --workers and --log-interval "
                     "at least 0")
    if not args.lr > 0:
        parser.error("--lr must be above 0")
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
    """Returns (train, test): datasets that take one index and return one (image, label), as torchvision's do.
    These two are decoded and normalised into memory once; yours may read each sample from disk instead."""
    if args.dataset == "synthetic":  # each class is a fixed random pattern under noise, the same everywhere
        generator = torch.Generator().manual_seed(1234)
        patterns = 2 * torch.randn(10, 1, 28, 28, generator=generator)
        labels = torch.randint(0, 10, (4_000,), generator=generator)
        images = patterns[labels] + torch.randn(len(labels), 1, 28, 28, generator=generator)
        return TensorDataset(images[:3_200], labels[:3_200]), TensorDataset(images[3_200:], labels[3_200:])
    download_mnist(args.data_dir)
    from torchvision import datasets
    splits = [datasets.MNIST(args.data_dir, train=train) for train in (True, False)]
    return [TensorDataset((s.data.unsqueeze(1) / 255 - 0.1307) / 0.3081, s.targets) for s in splits]


class Net(nn.Module):
    """A small CNN. No dropout or BatchNorm, which compute differently in each process (BatchNorm under DDP wants
    nn.SyncBatchNorm). SiLU and average pooling, not ReLU and max pooling: smooth in the weights, so the rounding
    differences between steps (DDP adds gradients in another order) stay near 1e-6 instead of flipping a max."""

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


def train_one_epoch(model, loader, optimizer, device, epoch, log_interval):
    """One pass over loader; returns (mean training loss, number of samples). Every log_interval steps (0:
    never) it prints the mean loss and the speed since the line before."""
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of losses, samples]
    logged, logged_at = totals.clone(), time.perf_counter()  # the totals and time at the last progress line
    for step, (images, labels) in enumerate(loader):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        totals[0] += loss.detach() * len(labels)  # stays on the device: no GPU sync per step
        totals[1] += len(labels)
        if log_interval and (step + 1) % log_interval == 0:  # one GPU sync per progress line, none between
            (loss_sum, samples), now = (totals - logged).tolist(), time.perf_counter()
            print(f"epoch {epoch + 1} step {step + 1}/{len(loader)} | loss {loss_sum / samples:.4f} | "
                  f"{samples / (now - logged_at):.0f} samples/s", flush=True)
            logged, logged_at = totals.clone(), now
    return (totals[0] / totals[1]).item(), int(totals[1])


@torch.no_grad()
def evaluate(model, loader, device):
    """Returns [correct, total] over loader."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        counts[0] += (model(images).argmax(dim=1) == labels).sum()
        counts[1] += len(labels)
    return counts.tolist()


def save_checkpoint(path, model, optimizer, **position):
    """Write a temporary file, then rename it: a crash mid-write leaves the previous checkpoint intact."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), **position}, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
    os.replace(path + ".tmp", path)  # atomic on POSIX filesystems


def load_checkpoint(path, model, optimizer):
    """Restore model and optimizer from path if it exists; returns where it left off ({"epoch": ...}), or None.
    The file is mapped, not read into memory: its tensors are copied once, into the model and the optimizer
    on this process's device, and nothing else of it is kept."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True) if os.path.exists(path) else None
    if state is not None:
        model.load_state_dict(state.pop("model"))  # onto this process's device, whatever the saver's was
        optimizer.load_state_dict(state.pop("optimizer"))
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
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    position = load_checkpoint(args.checkpoint, model, optimizer) if args.checkpoint else None
    start_epoch = position["epoch"] if position else 0
    if position and position.get("step"):  # saved inside an epoch by 05 or 06, which go on from that step
        sys.exit(f"error: {args.checkpoint} stopped inside epoch {start_epoch + 1}; resume it with the step that wrote "
                 "it (05 or 06), or start from a checkpoint saved at the end of an epoch")
    if position:
        print(f"resumed from {args.checkpoint} after epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        generator.manual_seed(args.seed + epoch)
        # Random numbers drawn here (dropout; augmentations with --workers 0) depend only on --seed and the epoch:
        # hash() of ints is the same in every run. Persistent workers take their seeds from here once per run.
        torch.manual_seed(hash((args.seed, epoch)))
        start = time.perf_counter()
        loss, samples = train_one_epoch(model, train_loader, optimizer, device, epoch, args.log_interval)
        train_time = time.perf_counter() - start
        correct, total = evaluate(model, test_loader, device)
        if args.checkpoint:
            save_checkpoint(args.checkpoint, model, optimizer, epoch=epoch + 1)
        summary = (f"epoch {epoch + 1}/{args.epochs} | train loss {loss:.4f} | test acc {100 * correct / total:.2f}% "
                   f"({correct}/{total}) | {samples / train_time:.0f} samples/s | {time.perf_counter() - start:.1f} s")
        print(summary, flush=True)


def main():
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"host {socket.gethostname()} pid {os.getpid()} device {device}", flush=True)
    train(args, device)


if __name__ == "__main__":
    main()
