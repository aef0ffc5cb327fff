"""What each step costs and gains, measured on this machine: python tests/benchmark.py

Runs every step on the same work (synthetic data by default; `--dataset mnist --data-dir DIR` reads MNIST
from DIR) with the launcher a user would use, for several epochs, and prints a markdown table: samples/s
is the median over the epochs after the first, over all rounds; the spread is the lowest and highest of
the rounds' medians. Rounds run every configuration once, in the same order, so that a noisy machine
shows as spread instead of favouring one side. Then three ratios, each from the same rounds:

- DDP at world size 1 (04 under torchrun, one process) against 01, same batch and threads;
- weak scaling: 03 with N processes against N x 03 with one, per-process batch and threads fixed;
- input pipeline: 01 end to end against the same training loop (01's train_one_epoch) fed batches that
  are already on the device: what the data loader costs.

Every process gets cores // processes threads (OMP_NUM_THREADS) and the steps' default data-loader workers
(none: the data is in memory) unless --workers says otherwise. Not collected by pytest.
"""
import argparse
import importlib.util
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
EPOCH_LINE = re.compile(r"^epoch (\d+)/\d+ \|.* \| (\d+) samples/s \|", re.M)


def parse_args():
    parser = argparse.ArgumentParser(description="Benchmark the steps of the ladder on this machine.")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per run; the first is not counted")
    parser.add_argument("--rounds", type=int, default=3, help="times every configuration runs, interleaved")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step in each process")
    parser.add_argument("--workers", type=int, help="data-loader workers per process (default: the steps' own, 0)")
    parser.add_argument("--dataset", choices=["synthetic", "mnist"], default="synthetic",
                        help="synthetic (3200 training images, made in memory) or MNIST read from --data-dir")
    parser.add_argument("--data-dir", default="data", help="where MNIST is (it is not downloaded here)")
    parser.add_argument("--prebatched", action="store_true", help=argparse.SUPPRESS)  # the inner loop's process
    args = parser.parse_args()
    if args.epochs < 2 or args.rounds < 1:
        parser.error("--epochs must be at least 2 (the first is not counted) and --rounds at least 1")
    return args


def load_01():
    spec = importlib.util.spec_from_file_location("step01", REPO / "01_single_gpu" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def defaults(module):
    """A step's flags at their defaults, as its parse_args() gives them."""
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        return module.parse_args()
    finally:
        sys.argv = argv


def prebatched(args):
    """01's training loop on the same data, shuffled the same way, cut into batches on the device first."""
    step01 = load_01()
    args = argparse.Namespace(**{**vars(defaults(step01)), **vars(args), "log_interval": 0})  # what the loop reads
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_set, _ = step01.load_datasets(args)
    images, labels = (t.to(device) for t in train_set.tensors)
    torch.manual_seed(0)
    model = step01.Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1)  # the steps' loop takes one
    losses = []
    for epoch in range(args.epochs):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch)).to(device)
        batches = [(images[i], labels[i]) for i in order.split(args.batch_size)]
        start = time.perf_counter()
        loss, samples = step01.train_one_epoch(args, model, batches, optimizer, scheduler, device, epoch)
        losses.append(loss)  # .item() in the loop: the time includes the device's work
        print(f"epoch {epoch + 1}/{args.epochs} | prebatched | {samples / (time.perf_counter() - start):.0f} "
              "samples/s |", flush=True)
    return losses


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configurations(gpus, cores):
    """(name, step, launcher, processes, threads per process) of every run in a round; with one GPU, the
    multi-process runs are the one-process ones (NCCL takes one process per GPU), so each runs once."""
    n = gpus or 2  # processes of the multi-process runs: one per GPU, or 2 on the CPU
    configs = [
        ("01", "01_single_gpu", "python", 1, cores),
        ("01 prebatched", "01_single_gpu", "batches on the device", 1, cores),
        ("02", "02_dataparallel", "python", 1, cores),
        ("03 x1", "03_ddp_mpspawn", "mp.spawn", 1, max(1, cores // n)),
        (f"03 x{n}", "03_ddp_mpspawn", "mp.spawn", n, max(1, cores // n)),
        ("04 x1", "04_ddp_torchrun", "torchrun", 1, cores),
        (f"04 x{n}", "04_ddp_torchrun", "torchrun", n, max(1, cores // n)),
        (f"05 x{n}", "05_ddp_slurm", "srun (emulated)", n, max(1, cores // n)),
        (f"06 x{n}", "06_ddp_submitit", "submitit --local", n, max(1, cores // n)),
    ]
    return [config for i, config in enumerate(configs) if config[0] not in [c[0] for c in configs[:i]]]


def run_one(step, launcher, processes, threads, args, folder):
    """Runs one configuration to its end; returns its epoch lines' samples/s."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHON=sys.executable)
    flags = ["--dataset", args.dataset, "--data-dir", args.data_dir, "--epochs", str(args.epochs),
             "--batch-size", str(args.batch_size), "--log-interval", "0"]
    flags += [] if args.workers is None else ["--workers", str(args.workers)]
    if launcher == "batches on the device":
        cmds = [[sys.executable, __file__, "--prebatched", *flags[:6], "--batch-size", str(args.batch_size)]]
        envs = [env]
    elif step == "03_ddp_mpspawn":
        cmds, envs = [["bash", f"{step}/run.sh", "--world-size", str(processes), *flags]], [env]
    elif step == "04_ddp_torchrun":
        cmds, envs = [["bash", f"{step}/run.sh", *flags]], [dict(env, NPROC_PER_NODE=str(processes))]
    elif step == "05_ddp_slurm":  # one process per task, with the variables srun gives it on one node
        port = free_port()
        cmds = [[sys.executable, f"{step}/train.py", *flags]] * processes
        envs = [dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS=str(processes), SLURM_STEP_ID="0",
                     SLURM_JOB_ID="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(processes)]
    elif step == "06_ddp_submitit":
        log_dir = Path(folder) / f"submitit-{time.monotonic_ns()}"
        cmds = [[sys.executable, f"{step}/train.py", "--local", "--tasks-per-node", str(processes), "--log-dir",
                 str(log_dir), *flags]]
        envs = [env]
    else:
        cmds, envs = [["bash", f"{step}/run.sh", *flags]], [env]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for cmd, e in zip(cmds, envs)]
    outs = [proc.communicate(timeout=1800) for proc in procs]
    output = "".join(out for out, _ in outs)
    if step == "06_ddp_submitit":
        output += "".join(p.read_text() for p in sorted(log_dir.glob("*/*_0_log.out")))
    if any(proc.returncode for proc in procs):
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        sys.exit(f"error: {step} with {processes} process(es) failed:\n{output}\n{''.join(e for _, e in outs)}")
    speeds = [int(speed) for epoch, speed in EPOCH_LINE.findall(output) if int(epoch) > 1]
    if len(speeds) != args.epochs - 1:
        sys.exit(f"error: {step} printed {len(speeds)} counted epoch lines:\n{output}")
    return speeds


def main():
    args = parse_args()
    if args.prebatched:
        prebatched(args)
        return 0
    gpus, cores = torch.cuda.device_count(), len(os.sched_getaffinity(0))
    device = torch.cuda.get_device_name(0) if gpus else f"CPU, {cores} cores"
    configs = configurations(gpus, cores)
    speeds = {name: [] for name, *_ in configs}  # every counted epoch of every round
    round_medians = {name: [] for name, *_ in configs}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for name, step, launcher, processes, threads in configs:
                start = time.monotonic()
                measured = run_one(step, launcher, processes, threads, args, folder)
                speeds[name] += measured
                round_medians[name].append(statistics.median(measured))
                print(f"round {round_ + 1}/{args.rounds}: {name}: {measured} samples/s "
                      f"({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    median = {name: statistics.median(values) for name, values in speeds.items()}
    backend = "NCCL" if gpus else "Gloo"
    print(f"\n{device}, torch {torch.__version__}, {backend}, {args.dataset} data, --batch-size {args.batch_size} "
          f"per process, --workers {'default' if args.workers is None else args.workers}, {args.epochs} epochs x "
          f"{args.rounds} rounds\n")
    print("| step | launcher | processes | threads each | samples/s (all processes) | spread of the rounds |")
    print("|---|---|---|---|---|---|")
    for name, step, launcher, processes, threads in configs:
        low, high = min(round_medians[name]), max(round_medians[name])
        print(f"| {name} | {launcher} | {processes} | {threads} | {median[name]:.0f} | {low:.0f}-{high:.0f} |")
    n = gpus or 2
    print()
    print(f"- DDP at world size 1 (04 under torchrun) / 01: {median['04 x1'] / median['01']:.3f}")
    if n > 1:
        print(f"- weak scaling, 03 x{n} / ({n} x 03 x1): {median[f'03 x{n}'] / (n * median['03 x1']):.3f}")
    print(f"- input pipeline, 01 / 01 on batches already on the device: {median['01'] / median['01 prebatched']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
