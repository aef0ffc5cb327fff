"""What each step costs and gains, measured on this machine: python tests/benchmark.py

Runs every step on the same work (synthetic data by default; `--dataset mnist --data-dir DIR` reads MNIST
from DIR) with the launcher a user would use, for several epochs, with two sizes of model (`--size small`,
`wide` or `both`, the default), and prints a markdown table for each size and the ratios below for each.

- small: the steps' own Net at --batch-size (64) per process. A step takes about 2 ms on an H200 and 14 ms
  on 2 CPU cores, so what every step costs besides the model (Python, DDP's hooks, kernel launches, the
  per-step reseed) weighs more than it would in a model a user trains.
- wide: the same CNN, wider (--wide C1,C2,FC: the channels of its two convolutions and the width of its
  hidden layer), at --wide-batch-size per process. On a GPU 256,512,4096 (104M parameters, nearly all in
  the hidden layer) at 320: issue 33 measured this Net at about 9 ms a step at batch 256 on an H200, so
  about 11 ms at 320 (the table's "ms a step" shows it: the aim is at least 10). On the CPU the same
  Net would take seconds a step, so there it is 32,64,1024 (3.2M) at 64: about 5 times the small one's
  step, as on the GPU, so the costs besides the model weigh about as little as they do there.
  The wide Net is swapped into copies of the step folders as tests/test_copy.py does (copy_step,
  replace_definitions): the steps' code is otherwise unchanged and their Net() keeps its signature.

Every configuration runs from such copies (the small size's are the steps as shipped). Two copies are
edited for an A/B pair, by finding their lines in the text (the benchmark stops with an error if a line
is not there): 01 without the per-step reseed in train_one_epoch (the default generator's manual_seed
and, on GPUs, torch.cuda.manual_seed_all), and 04 without DDP's gradient_as_bucket_view=True.

The figures: samples/s is the median over the epochs after the first (the first warms up: allocator,
kernels chosen), over all rounds; the spread is the lowest and highest of the rounds' medians; "ms a
step" is the batch of all processes over that median. Rounds run every configuration of every size once,
in the same order, so that a noisy machine shows as spread instead of favouring one side. Each ratio is
of two such medians, from the same rounds, printed for each size; above 1, the first one is faster:

- DDP at world size 1: 04 x1 (torchrun, one process) / 01, same batch and threads: what DDP's wrapper,
  its hooks and its all-reduce (trivial with one rank, still launched) cost;
- weak scaling: 03 with N processes / N x 03 with one, per-process batch and threads fixed (N: the GPUs,
  or 2 on the CPU; not printed with one GPU);
- input pipeline: 01 / 01's own train_one_epoch fed batches that are already on the device: what the
  data loader costs;
- --amp: 01 --amp / 01: what bf16 autocast gains (GPUs from Ampere on; on a CPU without bf16 units it
  costs);
- per-step reseed: 01 / the copy of 01 without it: below 1 by what the reseed costs;
- stop vote: 05 with N processes (srun emulated) / 04 with N: what 05 adds a step, its stop vote (an
  all-reduce of a CPU tensor over Gloo after every step, read before the next) and signal handling, DDP
  on both sides;
- gradient_as_bucket_view: 04 x1 / the copy of 04 without it: above 1 by what the option saves.

With one GPU or on the CPU the multi-process configurations are as before: 03, 04, 05 and 06 with one
process per GPU (2 on the CPU); with one GPU they are the one-process ones, so each runs once. Every
process gets cores // processes threads (OMP_NUM_THREADS), 03 x1 what each of 03 xN's processes gets, and
the steps' default data-loader workers (none: the data is in memory) unless --workers says otherwise.
--only NAME,NAME runs only the configurations so named (the table's first column), for both sizes.

How long, on 2 CPU cores: `--size small --epochs 2 --rounds 1` took 7.5 minutes on a shared VM under a
load of 8 (on quiet cores, where 01 trains 4650 samples/s, 1-2 minutes); a wide epoch is about 5 small
ones, so the defaults (both sizes, 10 epochs, 3 rounds) take about half an hour to an hour.
On a GPU the synthetic set's 3200 samples make short epochs (10 wide steps): give it more --epochs, or
--dataset mnist where MNIST is at hand. Not collected by pytest; tests/test_benchmark.py runs its
in-process part and the edits of the copies.
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
STEPS = ["01_single_gpu", "02_dataparallel", "03_ddp_mpspawn", "04_ddp_torchrun", "05_ddp_slurm", "06_ddp_submitit"]
EPOCH_LINE = re.compile(r"^epoch (\d+)/\d+ \|.* \| (\d+) samples/s \|", re.M)
WIDE = {"gpu": ("256,512,4096", 320), "cpu": ("32,64,1024", 64)}  # the wide Net's default widths and batch
WIDE_NET = '''class Net(nn.Module):
    """The benchmark's wide Net: the steps' CNN with {c1} and {c2} channels and {fc} hidden units."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, {c1}, 3, padding=1)
        self.conv2 = nn.Conv2d({c1}, {c2}, 3, padding=1)
        self.fc1 = nn.Linear({c2} * 7 * 7, {fc})
        self.fc2 = nn.Linear({fc}, 10)

    def forward(self, x):
        x = F.avg_pool2d(F.silu(self.conv1(x)), 2)
        x = F.avg_pool2d(F.silu(self.conv2(x)), 2)
        return self.fc2(F.silu(self.fc1(x.flatten(1))))
'''
# 01's per-step reseed: the step's seed, the default generator's seed and, on GPUs, every GPU's (train_one_epoch).
RESEED = re.compile(r'^( +)seed = hash\(.*\n'
                    r'\1torch\.default_generator\.manual_seed\(seed\).*\n'
                    r'\1if device\.type == "cuda":.*\n'
                    r'\1    torch\.cuda\.manual_seed_all\(seed\).*\n', re.M)
BUCKET_VIEW = ",\n                    gradient_as_bucket_view=True)"  # 04's DDP(...) call ends with it (its own line)


def parse_args():
    parser = argparse.ArgumentParser(description="Benchmark the steps of the ladder on this machine.")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per run; the first is not counted")
    parser.add_argument("--rounds", type=int, default=3, help="times every configuration runs, interleaved")
    parser.add_argument("--size", choices=["small", "wide", "both"], default="both",
                        help="the steps' own Net, a wider one (--wide), or both")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step in each process, small Net")
    parser.add_argument("--wide", metavar="C1,C2,FC",
                        help=f"the wide Net's conv channels and hidden units (default: {WIDE['gpu'][0]} on a GPU, "
                             f"{WIDE['cpu'][0]} on the CPU)")
    parser.add_argument("--wide-batch-size", type=int,
                        help=f"samples per step in each process, wide Net (default: {WIDE['gpu'][1]} on a GPU, "
                             f"{WIDE['cpu'][1]} on the CPU)")
    parser.add_argument("--workers", type=int, help="data-loader workers per process (default: the steps' own, 0)")
    parser.add_argument("--dataset", choices=["synthetic", "mnist"], default="synthetic",
                        help="synthetic (3200 training images, made in memory) or MNIST read from --data-dir")
    parser.add_argument("--data-dir", default="data", help="where MNIST is (it is not downloaded here)")
    parser.add_argument("--only", metavar="NAMES", help="comma-separated configuration names: run only these")
    parser.add_argument("--prebatched", action="store_true", help=argparse.SUPPRESS)  # the inner loop's process
    parser.add_argument("--script", help=argparse.SUPPRESS)  # --prebatched: the copy of 01's train.py to run
    args = parser.parse_args()
    if args.epochs < 2 or args.rounds < 1:
        parser.error("--epochs must be at least 2 (the first is not counted) and --rounds at least 1")
    if min(args.batch_size, args.wide_batch_size or 1) < 1:
        parser.error("--batch-size and --wide-batch-size must be at least 1")
    if args.wide is not None and not re.fullmatch(r"[1-9]\d*,[1-9]\d*,[1-9]\d*", args.wide):
        parser.error("--wide takes three positive integers: C1,C2,FC")
    return args


def load_01(script=None):
    spec = importlib.util.spec_from_file_location("step01", script or REPO / "01_single_gpu" / "train.py")
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
    """01's training loop (of the 01 at args.script, else the repository's) on the same data, shuffled the same
    way, cut into batches on the device first; the model, optimizer and schedule as 01's train() makes them."""
    step01 = load_01(getattr(args, "script", None))
    args = argparse.Namespace(**{**vars(defaults(step01)), **vars(args), "log_interval": 0})  # what the loop reads
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_set, _ = step01.load_datasets(args)
    images, labels = (t.to(device) for t in train_set.tensors)
    torch.manual_seed(args.seed)
    model = step01.Net().to(device)
    optimizer = step01.make_optimizer(model, args)
    peak_lrs = [group["lr"] for group in optimizer.param_groups]  # train_one_epoch sets each step's rate from them
    losses = []
    for epoch in range(args.epochs):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch)).to(device)
        batches = [(images[i], labels[i]) for i in order.split(args.batch_size)]
        start = time.perf_counter()
        loss, samples = step01.train_one_epoch(args, model, batches, optimizer, peak_lrs, device, epoch)
        losses.append(loss)  # .item() in the loop: the time includes the device's work
        print(f"epoch {epoch + 1}/{args.epochs} | prebatched | {samples / (time.perf_counter() - start):.0f} "
              "samples/s |", flush=True)
    return losses


def without_reseed(source):
    """01's text without the per-step reseed; exits if its lines are not there once."""
    source, found = RESEED.subn("", source)
    if found != 1:
        sys.exit(f"error: the per-step reseed of 01's train_one_epoch was found {found} times, not once, by the "
                 f"pattern {RESEED.pattern!r}: update tests/benchmark.py's RESEED to the loop's lines")
    return source


def without_bucket_view(source):
    """04's text with DDP(...) built without gradient_as_bucket_view=True; exits if that is not there once."""
    if source.count(BUCKET_VIEW) != 1:
        sys.exit(f"error: {BUCKET_VIEW!r} is in 04's train.py {source.count(BUCKET_VIEW)} times, not once: update "
                 "tests/benchmark.py's BUCKET_VIEW to its DDP(...) call")
    return source.replace(BUCKET_VIEW, ")")


VARIANTS = {"shipped": (STEPS, None), "no-reseed": (["01_single_gpu"], without_reseed),
            "no-bucket-view": (["04_ddp_torchrun"], without_bucket_view)}


def make_project(root, wide=None):
    """The step folders copied under root/shipped (with the wide Net C1,C2,FC swapped in, if wide), and the
    edited copies under root/no-reseed and root/no-bucket-view; returns root."""
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    from test_copy import copy_step  # as the copy tests make theirs
    if wide:
        c1, c2, fc = wide.split(",")
        code, names = WIDE_NET.format(c1=c1, c2=c2, fc=fc), ("Net",)
    else:
        code, names = "", ()
    for variant, (steps, edit) in VARIANTS.items():
        for step in steps:
            script = copy_step(step, root / variant, code, names) / "train.py"
            if edit:
                script.write_text(edit(script.read_text()))
    return root


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configurations(gpus, cores):
    """(name, step, variant, launcher, processes, threads per process, flags) of every run of a size in a round;
    with one GPU, the multi-process runs are the one-process ones (NCCL takes one process per GPU), so each runs
    once."""
    n = gpus or 2  # processes of the multi-process runs: one per GPU, or 2 on the CPU
    each = max(1, cores // n)
    configs = [
        ("01", "01_single_gpu", "shipped", "python", 1, cores, []),
        ("01 prebatched", "01_single_gpu", "shipped", "batches on the device", 1, cores, []),
        ("01 --amp", "01_single_gpu", "shipped", "python", 1, cores, ["--amp"]),
        ("01 no reseed", "01_single_gpu", "no-reseed", "python", 1, cores, []),
        ("02", "02_dataparallel", "shipped", "python", 1, cores, []),
        ("03 x1", "03_ddp_mpspawn", "shipped", "mp.spawn", 1, each, []),
        (f"03 x{n}", "03_ddp_mpspawn", "shipped", "mp.spawn", n, each, []),
        ("04 x1", "04_ddp_torchrun", "shipped", "torchrun", 1, cores, []),
        ("04 x1 no bucket view", "04_ddp_torchrun", "no-bucket-view", "torchrun", 1, cores, []),
        (f"04 x{n}", "04_ddp_torchrun", "shipped", "torchrun", n, each, []),
        (f"05 x{n}", "05_ddp_slurm", "shipped", "srun (emulated)", n, each, []),
        (f"06 x{n}", "06_ddp_submitit", "shipped", "submitit --local", n, each, []),
    ]
    return [config for i, config in enumerate(configs) if config[0] not in [c[0] for c in configs[:i]]]


def ratios(n):
    """(what, numerator, denominator, times the denominator) of the ratios printed for each size."""
    return [
        ("DDP at world size 1: 04 x1 / 01", "04 x1", "01", 1),
        *([(f"weak scaling: 03 x{n} / ({n} x 03 x1)", f"03 x{n}", "03 x1", n)] if n > 1 else []),
        ("input pipeline: 01 / 01 prebatched", "01", "01 prebatched", 1),
        ("--amp: 01 --amp / 01", "01 --amp", "01", 1),
        ("per-step reseed: 01 / 01 no reseed", "01", "01 no reseed", 1),
        (f"stop vote: 05 x{n} / 04 x{n}", f"05 x{n}", f"04 x{n}", 1),
        ("gradient_as_bucket_view: 04 x1 / 04 x1 no bucket view", "04 x1", "04 x1 no bucket view", 1),
    ]


def run_one(config, root, batch_size, args, folder):
    """Runs one configuration from the copies under root to its end; returns its epoch lines' samples/s."""
    name, step, variant, launcher, processes, threads, extra = config
    cwd = root / variant
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHON=sys.executable)
    data = ["--dataset", args.dataset, "--data-dir", str(Path(args.data_dir).resolve()), "--epochs", str(args.epochs),
            "--batch-size", str(batch_size)]
    flags = [*data, "--log-interval", "0", *extra]
    flags += [] if args.workers is None else ["--workers", str(args.workers)]
    if launcher == "batches on the device":
        cmds = [[sys.executable, __file__, "--prebatched", "--script", str(cwd / step / "train.py"), *data]]
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
    procs = [subprocess.Popen(cmd, cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for cmd, e in zip(cmds, envs)]
    outs = [proc.communicate(timeout=3600) for proc in procs]
    output = "".join(out for out, _ in outs)
    if step == "06_ddp_submitit":
        output += "".join(p.read_text() for p in sorted(log_dir.glob("*/*_0_log.out")))
    if any(proc.returncode for proc in procs):
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        sys.exit(f"error: {name} ({cwd / step}) failed:\n{output}\n{''.join(e for _, e in outs)}")
    speeds = [int(speed) for epoch, speed in EPOCH_LINE.findall(output) if int(epoch) > 1]
    if len(speeds) != args.epochs - 1:
        sys.exit(f"error: {name} printed {len(speeds)} counted epoch lines:\n{output}")
    return speeds


def commit():
    """The repository's commit, marked when tracked files differ from it; "unknown" without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} with uncommitted changes" if changed else head


def parameters(script):
    """The parameters of the Net in script, counted without allocating them."""
    with torch.device("meta"):
        return sum(p.numel() for p in load_01(script).Net().parameters())


def main():
    args = parse_args()
    if args.prebatched:
        prebatched(args)
        return 0
    gpus, cores = torch.cuda.device_count(), len(os.sched_getaffinity(0))
    device = torch.cuda.get_device_name(0) if gpus else f"CPU, {cores} cores"
    wide, wide_batch = WIDE["gpu" if gpus else "cpu"]
    wide, wide_batch = args.wide or wide, args.wide_batch_size or wide_batch
    sizes = {"small": (None, args.batch_size), "wide": (wide, wide_batch)}
    sizes = {size: sizes[size] for size in (["small", "wide"] if args.size == "both" else [args.size])}
    configs = configurations(gpus, cores)
    if args.only:
        names = [name.strip() for name in args.only.split(",")]
        unknown = sorted(set(names) - {c[0] for c in configs})
        if unknown:
            sys.exit(f"error: no configuration {unknown} here; they are: {', '.join(c[0] for c in configs)}")
        configs = [config for config in configs if config[0] in names]
    n = gpus or 2
    speeds = {(size, c[0]): [] for size in sizes for c in configs}  # every counted epoch of every round
    round_medians = {key: [] for key in speeds}
    with tempfile.TemporaryDirectory(prefix="benchmark-") as folder:
        roots = {size: make_project(Path(folder) / size, spec) for size, (spec, _) in sizes.items()}
        nets = {size: parameters(roots[size] / "shipped" / "01_single_gpu" / "train.py") for size in sizes}
        began = time.monotonic()
        for round_ in range(args.rounds):
            for size, (_, batch_size) in sizes.items():
                for config in configs:
                    start = time.monotonic()
                    measured = run_one(config, roots[size], batch_size, args, folder)
                    speeds[size, config[0]] += measured
                    round_medians[size, config[0]].append(statistics.median(measured))
                    print(f"round {round_ + 1}/{args.rounds}: {size} {config[0]}: {measured} samples/s "
                          f"({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    median = {key: statistics.median(values) for key, values in speeds.items()}
    backend = "NCCL" if gpus else "Gloo"
    print(f"\n{device}, torch {torch.__version__}, commit {commit()}, {backend}, {args.dataset} data, --workers "
          f"{'default' if args.workers is None else args.workers}, {args.epochs} epochs x {args.rounds} rounds, "
          f"{(time.monotonic() - began) / 60:.1f} minutes")
    for size, (spec, batch_size) in sizes.items():
        net = "the steps' Net" if spec is None else "conv {}, {} channels, fc {}".format(*spec.split(","))
        print(f"\n{size}: {net} ({nets[size] / 1e6:.2f}M parameters), batch {batch_size} per process\n")
        print("| step | launcher | processes | threads each | samples/s (all processes) | ms a step | "
              "spread of the rounds |")
        print("|---|---|---|---|---|---|---|")
        for name, step, variant, launcher, processes, threads, extra in configs:
            low, high = min(round_medians[size, name]), max(round_medians[size, name])
            ms = 1000 * batch_size * processes / median[size, name]
            print(f"| {name} | {launcher} | {processes} | {threads} | {median[size, name]:.0f} | {ms:.1f} | "
                  f"{low:.0f}-{high:.0f} |")
    shown = [r for r in ratios(n) if all((size, name) in median for size in sizes for name in r[1:3])]
    if shown:
        print(f"\n| ratio (above 1: the first is faster) | {' | '.join(sizes)} |")
        print(f"|---|{'---|' * len(sizes)}")
        for what, numerator, denominator, times in shown:
            values = [median[size, numerator] / (times * median[size, denominator]) for size in sizes]
            print(f"| {what} | {' | '.join(f'{value:.3f}' for value in values)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
