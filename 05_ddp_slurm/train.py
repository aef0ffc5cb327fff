"""Step 05: DDP under Slurm: srun starts the processes, and a preempted job requeues itself.

Run:  sbatch 05_ddp_slurm/submit.sh --epochs 3   (from the repository root; see submit.sh for CPU runs)

Changed since 04: srun starts one task per GPU on every node and the script reads its place from
SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS; submit.sh sets the rendezvous address. Before the
time limit Slurm sends SIGUSR2: all ranks stop at the same step, rank 0 saves the position in the
epoch and requeues the job, and the requeued job resumes at that step.
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset


def parse_args():
    parser = argparse.ArgumentParser(description="Train a small CNN on MNIST.")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step in each process")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate of SGD with momentum 0.9")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data order")
    parser.add_argument("--dataset", choices=["mnist", "synthetic"], default="mnist",
                        help="real MNIST, or MNIST-shaped data made in memory (no download)")
    parser.add_argument("--data-dir", default="data", help="folder that holds or receives MNIST")
    parser.add_argument("--workers", type=int, default=1, help="data-loader worker processes per process")
    parser.add_argument("--checkpoint", metavar="PATH", help="save after every epoch; resume if PATH exists")
    args = parser.parse_args()
    if args.epochs < 1 or args.batch_size < 1 or args.workers < 0 or not args.lr > 0:
        parser.error("--epochs and --batch-size must be at least 1, --workers at least 0, --lr above 0")
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


STOP = {"requested": False}  # SLURM: set by the SIGUSR2 handler, read between steps


def stop_requested(device):
    """SLURM: True on every rank once any rank has the signal, so that all stop at the same step."""
    flag = torch.tensor(float(STOP["requested"]), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def train_one_epoch(model, loader, optimizer, device, start_step=0):
    """One pass over loader from batch start_step; returns (mean training loss, number of samples,
    None), or (None, None, step) when asked to stop before that step."""
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of losses, samples]
    for step, (images, labels) in enumerate(loader):
        if step < start_step:  # SLURM: trained before the requeue (same seed and epoch, same batches)
            continue
        if step % 10 == 0 and stop_requested(device):  # SLURM: every 10 steps, as each check waits for the GPU
            return None, None, step
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        totals[0] += loss.detach() * len(labels)  # stays on the device: no GPU sync per step
        totals[1] += len(labels)
    dist.all_reduce(totals)  # DDP: sum over ranks, so rank 0 reports the global mean loss
    return (totals[0] / totals[1]).item(), int(totals[1]), None


@torch.no_grad()
def evaluate(model, loader, device):
    """Returns [correct, total] over loader."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        counts[0] += (model(images).argmax(dim=1) == labels).sum()
        counts[1] += len(labels)
    dist.all_reduce(counts)  # DDP: add up the ranks' disjoint shards
    return counts.tolist()


def save_checkpoint(path, model, optimizer, epoch, step=0):
    """Write a temporary file, then rename it: a crash mid-write leaves the previous checkpoint intact."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step}, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
    os.replace(path + ".tmp", path)  # atomic on POSIX filesystems


def load_checkpoint(path, model, optimizer, device):
    """Restore model and optimizer from path; returns (epochs done, steps done in the next epoch)."""
    state = torch.load(path, map_location=device)  # onto this process's device, not the saver's
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"], state["step"]


def setup(rank, local_rank, world_size):
    """DDP: pick this process's device and join the process group; returns the device."""
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            sys.exit(f"error: local rank {local_rank} but {torch.cuda.device_count()} GPUs: start one process per GPU")
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            device_id=device if device.type == "cuda" else None)
    facts = (f"rank {rank}/{world_size} local_rank {local_rank} host {socket.gethostname()} pid {os.getpid()} "
             f"device {device} backend {backend} master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    print(facts + "\n", end="", flush=True)  # one write, so that the ranks' lines do not interleave
    return device


def train(args, rank, world_size, device):
    is_main = rank == 0  # DDP: only global rank 0 downloads, prints and saves
    if args.dataset == "mnist" and is_main:
        download_mnist(args.data_dir)
    dist.barrier()  # DDP: the other ranks read MNIST only once rank 0 has it
    train_set, test_set = load_datasets(args)
    # DDP: each rank takes every world_size-th index of the epoch's order, which depends only on --seed
    # and the epoch (set below); a few repeats pad it so that all ranks take the same number of steps.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    loader_args = dict(num_workers=args.workers, pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, **loader_args)
    # DDP: each rank scores a disjoint slice of the test set, with no padding, so the sums are exact.
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=1000, **loader_args)

    torch.manual_seed(args.seed)  # the same initial weights for the same seed
    model = Net().to(device)
    # DDP: copies rank 0's weights to every rank, then averages gradients during backward.
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start_epoch, start_step = 0, 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        start_epoch, start_step = load_checkpoint(args.checkpoint, model, optimizer, device)
        if is_main:
            print(f"resumed from {args.checkpoint} after epoch {start_epoch} step {start_step}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # DDP: without it every epoch repeats the first epoch's order
        start = time.perf_counter()
        loss, samples, stopped_at = train_one_epoch(ddp_model, train_loader, optimizer, device, start_step)
        if stopped_at is not None:  # SLURM: save where all ranks stopped, then requeue the job
            if args.checkpoint and is_main:
                save_checkpoint(args.checkpoint, model, optimizer, epoch, stopped_at)
            dist.barrier()
            note = "" if args.checkpoint else " (no --checkpoint: the job will start over)"
            return requeue(is_main, f"epoch {epoch + 1} step {stopped_at}{note}")
        start_step = 0
        train_time = time.perf_counter() - start
        correct, total = evaluate(model, test_loader, device)
        if args.checkpoint and is_main:
            save_checkpoint(args.checkpoint, model, optimizer, epoch + 1)
        dist.barrier()  # DDP: the others wait until the checkpoint is complete
        summary = (f"epoch {epoch + 1}/{args.epochs} | train loss {loss:.4f} | test acc {100 * correct / total:.2f}% "
                   f"({correct}/{total}) | {samples / train_time:.0f} samples/s | {time.perf_counter() - start:.1f} s")
        if is_main:
            print(summary, flush=True)


def requeue(is_main, position):
    """SLURM: rank 0 puts the job back in the queue; it starts again under the same job id and resumes."""
    if is_main:
        print(f"stopped at {position} on SIGUSR2: requeueing job {os.environ['SLURM_JOB_ID']}", flush=True)
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)


def main():
    # SLURM: submit.sh asks for SIGUSR2 before the time limit. Handled first, so that it cannot kill us.
    signal.signal(signal.SIGUSR2, lambda signum, frame: STOP.update(requested=True))
    args = parse_args()
    # SLURM: srun starts the tasks and tells each its place; submit.sh exports MASTER_ADDR and MASTER_PORT.
    if "SLURM_STEP_ID" not in os.environ or "MASTER_ADDR" not in os.environ:
        sys.exit("error: start this script with srun inside a job of submit.sh: sbatch 05_ddp_slurm/submit.sh")
    rank, local_rank, world_size = (int(os.environ[name]) for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"))
    device = setup(rank, local_rank, world_size)
    try:
        train(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()  # DDP: also after an error


if __name__ == "__main__":
    main()
