"""The loop of a real job in every step: gradient accumulation (one all-reduce per optimizer step under DDP), a
warm-up + cosine schedule, bf16 autocast, and a model with dropout that resumes bit for bit after a stop inside an
epoch, also one that comes between two micro-batches of an optimizer step; --clip-grad clips the whole step's
gradient, once. Hooks in a sitecustomize count DDP's all-reduces (a comm hook, as DDP's reducer bypasses
dist.all_reduce) and clip_grad_norm_'s calls, log each optimizer step's learning rate, see the dtype of the activations
and send a stop signal at a chosen forward."""
import contextlib
import math
import io
import os
import signal
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from conftest import (STEPS, STEPS_PER_EPOCH, SYNTHETIC, TOLERANCE, Result, Task, batch_args, child_env, free_port, load_step_module,
                      max_abs_diff, run_slurm_tasks, run_step, wait_for)
from test_copy import copy_step
from test_preemption import REQUEUE_CODE, SITECUSTOMIZE, STOPPED, finish_all, hold_env

# The train() functions that differ: 04's is 03's byte for byte, 06's is 05's (test_structure.py), and the ladder
# proves that their launchers hand train() the same ranks; that their parse_args reads these flags alike, the first
# test below. So the runs here train 01, 02 (DataParallel), 03 and 05, and no launcher twice.
TRAINS = ["01_single_gpu", "02_dataparallel", "03_ddp_mpspawn", "05_ddp_slurm"]
FLAGS = ["--accumulate", "4", "--amp", "--clip-grad", "0.1", "--warmup", "0.1", "--cosine", "--batch-size", "8"]


@pytest.mark.parametrize("step, twin", [("04_ddp_torchrun", "03_ddp_mpspawn"), ("06_ddp_submitit", "05_ddp_slurm")])
def test_04_and_06_read_the_training_flags_as_03_and_05(step, twin, monkeypatch):
    parsed = {}
    for name in (step, twin):
        monkeypatch.setattr(sys, "argv", [f"{name}/train.py", *FLAGS, *(["--local"] if name == STEPS[5] else [])])
        parsed[name] = vars(load_step_module(name).parse_args())
    keys = ("accumulate", "amp", "clip_grad", "warmup", "cosine", "batch_size", "lr", "epochs", "seed")
    assert [parsed[step][k] for k in keys] == [parsed[twin][k] for k in keys] == [4, True, 0.1, 0.1, True, 8,
                                                                                  *[parsed[twin][k] for k in keys[6:]]]

HOOKS = '''
import os, signal
def _log(name, text):
    import torch.distributed as dist
    with open(os.environ[name], "a") as log:
        log.write(f"{dist.get_rank() if dist.is_initialized() else 0} {text}\\n")
def _grad_norm(optimizer):  # of the gradient that the optimizer applies, all parameters together
    import torch
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
if os.environ.get("TEST_COMM_LOG"):  # "all-reduce" per all-reduce of DDP's first bucket, "clip NORM" per call of
    # clip_grad_norm_ (the norm it found, before clipping), "step NORM" per optimizer step (the norm it applied)
    import torch.nn.utils
    from torch.nn.parallel import DistributedDataParallel
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook
    ddp_init = DistributedDataParallel.__init__
    def counted_hook(group, bucket):
        if bucket.index() == 0:
            _log("TEST_COMM_LOG", "all-reduce")
        return allreduce_hook(group, bucket)
    def counting_init(self, *args, **kwargs):
        ddp_init(self, *args, **kwargs)
        self.register_comm_hook(None, counted_hook)
    DistributedDataParallel.__init__ = counting_init
    clip_grad_norm = torch.nn.utils.clip_grad_norm_
    def logged_clip(*args, **kwargs):
        norm = clip_grad_norm(*args, **kwargs)
        _log("TEST_COMM_LOG", f"clip {norm.item()!r}")
        return norm
    torch.nn.utils.clip_grad_norm_ = logged_clip
    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: _log("TEST_COMM_LOG",
                                                                           f"step {_grad_norm(optimizer)!r}"))
if os.environ.get("TEST_LR_LOG"):  # the learning rate of every optimizer step
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: _log("TEST_LR_LOG", repr(optimizer.param_groups[0]["lr"])))
if os.environ.get("TEST_DTYPE_LOG") or os.environ.get("TEST_SIGNAL_AT_FORWARD"):
    import torch.nn
    seen, forwards = set(), [0]
    def forward_hook(module, inputs, output):
        if module.training and isinstance(module, torch.nn.Linear) and os.environ.get("TEST_DTYPE_LOG"):
            if output.dtype not in seen:  # the dtype of a training activation, once per process and dtype
                seen.add(output.dtype)
                _log("TEST_DTYPE_LOG", str(output.dtype))
        # "N": rank 0 sends itself SIGTERM in its Nth training forward of Net (a micro-batch, inside a step)
        if module.training and type(module).__name__ == "Net" and os.environ.get("TEST_SIGNAL_AT_FORWARD"):
            forwards[0] += 1
            if forwards[0] == int(os.environ["TEST_SIGNAL_AT_FORWARD"]) and os.environ.get("SLURM_PROCID") == "0":
                os.kill(os.getpid(), signal.SIGTERM)
    torch.nn.modules.module.register_module_forward_hook(forward_hook)
'''
SCHEDULE = ["--warmup", "0.1", "--cosine"]
CLIP_NORM = 0.1  # below every step's gradient norm in `accumulated` (0.17-0.33 unclipped): it clips every step
DROPOUT_NET = '''
class Net(nn.Module):
    """The ladder's CNN with dropout, as a user's model has random layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.dropout = nn.Dropout(0.3)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.avg_pool2d(F.silu(self.conv1(x)), 2)
        x = F.avg_pool2d(F.silu(self.conv2(x)), 2)
        return self.fc2(self.dropout(F.silu(self.fc1(x.flatten(1)))))
'''


def site_dir(folder):
    """A folder with the sitecustomize: test_preemption's hooks (hold, step clock) and these."""
    path = Path(folder) / "site"
    path.mkdir(exist_ok=True)
    (path / "sitecustomize.py").write_text(SITECUSTOMIZE + HOOKS)
    return str(path)


def run_here(step, args, hook=None, comm_log=None):
    """01 or 02 in this process (parse_args and train, with hook as a forward hook of every module; comm_log: what
    the sitecustomize's TEST_COMM_LOG logs, clip and step lines): a process start is most of a short run's time."""
    module, output = load_step_module(step), io.StringIO()
    with (contextlib.ExitStack() as undo, pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(output)):
        patch.setattr(sys, "argv", [f"{step}/train.py", *args])
        if hook:
            undo.callback(torch.nn.modules.module.register_module_forward_hook(hook).remove)
        if comm_log:
            def log(text):
                with open(comm_log, "a") as file:
                    file.write(f"0 {text}\n")

            def logged_clip(*args, clip_grad_norm=torch.nn.utils.clip_grad_norm_, **kwargs):
                norm = clip_grad_norm(*args, **kwargs)
                log(f"clip {norm.item()!r}")
                return norm
            patch.setattr(torch.nn.utils, "clip_grad_norm_", logged_clip)
            undo.callback(register_optimizer_step_post_hook(
                lambda optimizer, args, kwargs: log(f"step {grad_norm(optimizer)!r}")).remove)
        module.train(module.parse_args(), torch.device("cpu"))
    return Result(0, output.getvalue(), "", 0)


def grad_norm(optimizer):
    """What the sitecustomize's _grad_norm computes: the norm of the gradient that the optimizer applies."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


def per_rank(log):
    """{rank: [its lines, in order]} of a hook's log."""
    lines = {}
    for line in Path(log).read_text().splitlines() if Path(log).exists() else []:
        rank, text = line.split(" ", 1)
        lines.setdefault(int(rank), []).append(text)
    return lines


def state(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="session")
def accumulated(shared):
    """One epoch, schedule on, --clip-grad CLIP_NORM, in each train() (TRAINS): 01 at a batch of 64 and 16 x 4
    micro-batches, 03 and 05 at 2 x 8 x 4, counting all-reduces and clip_grad_norm_'s calls; and a global batch of 96
    (01: 96, 16 x 6; 05: 2 x 8 x 6), which leaves a short last group of 2 micro-batches: 3200 = 33 x 96 + 32."""
    def compute(folder):
        path, runs = site_dir(folder), {}
        for name, step, flags in [("64", "01_single_gpu", ["--batch-size", "64"]),
                                  ("96", "01_single_gpu", ["--batch-size", "96"]),
                                  *[(f"{step[:2]}x4", step, ["--batch-size", "16" if step < "02" else "8",
                                                             "--accumulate", "4"]) for step in TRAINS if step != STEPS[1]],
                                  *[(f"{step[:2]}x6", step, ["--batch-size", "16" if step < "02" else "8",
                                                             "--accumulate", "6"])
                                    for step in ("01_single_gpu", "05_ddp_slurm")]]:
            checkpoint, comm = folder / f"{name}.pt", folder / f"{name}.comm"
            args = [*SYNTHETIC, *SCHEDULE, "--clip-grad", str(CLIP_NORM), *flags, "--epochs", "1", "--checkpoint",
                    str(checkpoint)]
            env = dict(PYTHONPATH=path, TEST_COMM_LOG=str(comm))
            if step == "01_single_gpu":
                result = run_here(step, args, comm_log=comm)
            else:
                result = run_slurm_tasks(args, **env) if step == "05_ddp_slurm" else run_step(step, args, folder, **env)
            runs[name] = Namespace(result=result, checkpoint=checkpoint, comm=comm)
        return runs
    return shared("accumulated", compute)


def test_accumulation_under_a_schedule_computes_the_weights_of_one_big_batch(accumulated):
    """01 with 16 x 4 micro-batches, 03-06 with 2 ranks x 8 x 4, end an epoch under the warm-up + cosine schedule and
    --clip-grad within TOLERANCE of 01 at a batch of 64; with a short last group (a global batch of 96), of 01 at 96.
    Clipped, every step's gradient has norm CLIP_NORM whatever its scale: the gradient's scale (a sum over ranks
    instead of a mean, a missing division) is checked before clipping, step by step, by the clip test below."""
    runs = accumulated
    assert all(run.result.returncode == 0 for run in runs.values()), runs
    big = {name: state(runs["96" if name.endswith("x6") else "64"].checkpoint)["model"] for name in runs}
    diffs = {name: max_abs_diff(state(run.checkpoint)["model"], big[name])
             for name, run in runs.items() if name not in ("64", "96")}
    print("max abs difference to 01 at one big batch:", {name: f"{diff:.1e}" for name, diff in diffs.items()})
    assert all(diff <= TOLERANCE for diff in diffs.values()), diffs
    for name, run in runs.items():  # the schedule ran to its end (the optimizer steps: the next test counts them):
        # the checkpoint holds the rate of the cosine's last step (train_one_epoch sets each step's before it)
        steps = 34 if name == "96" or name.endswith("x6") else 50
        last = 0.01 * (1 + math.cos(math.pi * (steps - 1 - 0.1 * steps) / (0.9 * steps))) / 2
        assert [group["lr"] for group in state(run.checkpoint)["optimizer"]["param_groups"]] == [
            pytest.approx(last, rel=1e-9)], name
    assert "epoch 1/1 |" in runs["05x4"].result.output


def test_one_all_reduce_per_optimizer_step(accumulated):
    """Under accumulation DDP all-reduces the gradients once per optimizer step, in the last micro-batch's backward
    (no_sync() in the others), in every DDP step and also for a short last group: each rank's log alternates."""
    for name, run in accumulated.items():
        if name[:2] in ("03", "04", "05", "06"):
            logs = {rank: [line.split()[0] for line in log if not line.startswith("clip ")]  # the next test's
                    for rank, log in per_rank(run.comm).items()}
            steps = 34 if name.endswith("x6") else 50
            assert sorted(logs) == [0, 1], name
            assert all(log == ["all-reduce", "step"] * steps for log in logs.values()), (name, logs[0][:9])


def test_clip_grad_clips_the_all_reduced_gradient_once_per_optimizer_step(accumulated):
    """--clip-grad CLIP_NORM, in every run of `accumulated`: each optimizer step calls clip_grad_norm_ once (under DDP
    after the step's all-reduce), which finds a norm above CLIP_NORM (it clips at every step), and applies a gradient
    of norm CLIP_NORM. The norm clipped, at every step of 01 at 16 x 4 and of 03-06 on both ranks, is that of 01 at one
    big batch: the whole step's gradient, summed over the micro-batches and averaged over the ranks (and the weights
    agree: the first test). Clipped after each micro-batch's backward instead, a rank would clip its own gradient."""
    runs, found = accumulated, {}
    for name, run in runs.items():
        ddp, logs = name[:2] in ("03", "04", "05", "06"), per_rank(run.comm)
        assert sorted(logs) == ([0, 1] if ddp else [0]), (name, logs)
        for rank, log in logs.items():
            clipped = [float(line.split()[1]) for line in log if line.startswith("clip ")]
            applied = [float(line.split()[1]) for line in log if line.startswith("step ")]
            found[name, rank] = (log, clipped, applied)
    clip_lines = {f"{name}/{rank}": len(clipped) for (name, rank), (_, clipped, _) in found.items()}
    steps = {name: 34 if name == "96" or name.endswith("x6") else 50 for name in runs}
    big = {name: found["96" if steps[name] == 34 else "64", 0][1] for name in runs}
    differences = {f"{name}/{rank}": max((abs(a / b - 1) for a, b in zip(clipped, big[name])), default=math.inf)
                   for (name, rank), (_, clipped, _) in found.items() if name not in ("64", "96")}
    print(f"--clip-grad {CLIP_NORM}: clip_grad_norm_ calls {clip_lines}; the norms it clipped: "
          f"{min(min(c, default=0) for _, c, _ in found.values()):.3f} to "
          f"{max(max(c, default=0) for _, c, _ in found.values()):.3f}, "
          f"max relative difference to 01 at one big batch, step by step: "
          f"{({key: f'{diff:.1e}' for key, diff in differences.items()})}")
    for (name, rank), (log, clipped, applied) in found.items():
        per_step = ["all-reduce", "clip", "step"] if name[:2] in ("03", "04", "05", "06") else ["clip", "step"]
        assert [line.split()[0] for line in log] == per_step * steps[name], (name, rank, log[:12])
        assert min(clipped) > CLIP_NORM, (name, rank, clipped)  # it clipped at every step
        assert applied == pytest.approx([CLIP_NORM] * steps[name], rel=1e-4), (name, rank, applied)
    assert all(diff <= TOLERANCE for diff in differences.values()), differences


@pytest.fixture(scope="session")
def amp_runs(shared):
    """One epoch of each train() (TRAINS) with --amp (bf16 autocast), logging the dtype of training activations."""
    def compute(folder):
        path, runs = site_dir(folder), {}
        for step in TRAINS:
            checkpoint, dtypes = folder / f"{step}.pt", folder / f"{step}.dtypes"
            args = [*SYNTHETIC, *batch_args(step), "--amp", "--epochs", "1", "--log-interval", "10", "--checkpoint",
                    str(checkpoint)]
            env = dict(PYTHONPATH=path, TEST_DTYPE_LOG=str(dtypes))
            if step in STEPS[:2]:
                def log_dtype(module, inputs, output, seen=set()):  # what the sitecustomize's hook does in a process
                    if module.training and isinstance(module, torch.nn.Linear) and output.dtype not in seen:
                        seen.add(output.dtype)
                        with open(dtypes, "a") as log:
                            log.write(f"0 {output.dtype}\n")
                result = run_here(step, args, log_dtype)
            elif step == "05_ddp_slurm":
                result = run_slurm_tasks(args, **env)
            else:
                result = run_step(step, args, folder, **env)
            runs[step] = Namespace(result=result, checkpoint=checkpoint, dtypes=dtypes)
        return runs
    return shared("amp", compute)


AMP_BOUND = 2e-4  # measured 6.3e-5 (03-06 to 01, one epoch, CPU): bf16 rounds the sums of another order coarsely


def test_amp_trains_in_bf16_in_every_step(amp_runs, reference):
    """--amp: every step trains (the loss falls, accuracy well above chance), its Linear layers compute in bf16
    (a --amp that did nothing would show float32), and the six steps agree within AMP_BOUND."""
    first = state(amp_runs["01_single_gpu"].checkpoint)["model"]
    diffs = {}
    for step, run in amp_runs.items():
        assert run.result.returncode == 0, run.result
        [epoch] = run.result.epochs()
        assert epoch["acc"] > 50, run.result
        losses = [float(line.split("| loss ")[1].split()[0]) for line in run.result.output.splitlines()
                  if line.startswith("epoch 1 step")]
        assert len(losses) == 5 and losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.05, losses
        dtypes = per_rank(run.dtypes)
        assert len(dtypes) == 1 + (step not in STEPS[:2]) and all(d == ["torch.bfloat16"] for d in dtypes.values()), dtypes
        diffs[step] = max_abs_diff(state(run.checkpoint)["model"], first)
    fp32 = max_abs_diff(first, state(reference.epoch1)["model"])
    print(f"--amp: max abs difference to 01 --amp {({s[:2]: f'{d:.1e}' for s, d in diffs.items()})}, 01 --amp to 01 "
          f"in fp32 {fp32:.1e}")
    assert all(diff <= AMP_BOUND for diff in diffs.values()), diffs
    assert fp32 > 0  # bf16 really ran


def start_copy(script, args, env, world_size=2):
    """A copied 05's tasks as srun starts them on one node."""
    port = free_port()
    return [Task([script, *args], child_env(**env, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                                            SLURM_NTASKS=str(world_size), SLURM_STEP_ID="0", SLURM_JOB_ID="4242",
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                 script.parent.parent, stderr=subprocess.STDOUT)
            for rank in range(world_size)]


HOLD_AT = 10  # the optimizer step inside the warm-up (15 steps: 0.3 of 50) after which the first stop comes
SIGNAL_AT = 4 * 20 + 2  # the forward (micro-batch 2 of optimizer step 21) in which rank 0 gets SIGTERM


@pytest.fixture(scope="session")
def dropout_runs(shared):
    """name -> 05 copied with a dropout layer in Net, 2 ranks x 8 x 4 micro-batches, warm-up + cosine, one epoch (50
    steps): uninterrupted, and stopped then resumed: "fp32": by SIGTERM to both ranks held after step HOLD_AT;
    "amp": with --amp, by SIGTERM to rank 0 in a forward between two micro-batches."""
    def compute(folder, name):
        script = copy_step("05_ddp_slurm", folder / "project", DROPOUT_NET, ("Net",)) / "train.py"
        path = site_dir(folder)
        flags = [*SYNTHETIC, "--batch-size", "8", "--accumulate", "4", "--warmup", "0.3", "--cosine", "--epochs", "1"]
        amp = ["--amp"] if name == "amp" else []
        lr_log = folder / "uninterrupted.lr"
        procs = start_copy(script, [*flags, *amp, "--checkpoint", str(folder / "uninterrupted.pt")],
                           dict(PYTHONPATH=path, TEST_LR_LOG=str(lr_log)))
        uninterrupted = (*finish_all(procs), lr_log)
        checkpoint, lr_log = folder / "stopped.pt", folder / "stopped.lr"
        env = dict(PYTHONPATH=path, TEST_LR_LOG=str(lr_log))
        if name == "fp32":
            hold, held, _ = hold_env(folder, HOLD_AT)
            procs = start_copy(script, [*flags, "--checkpoint", str(checkpoint)], {**env, **hold})
            wait_for(lambda: len(held()) == 2 or any(p.poll() is not None for p in procs), 120, "both ranks held")
            for proc in procs:
                os.kill(proc.pid, signal.SIGTERM)
        else:
            procs = start_copy(script, [*flags, *amp, "--checkpoint", str(checkpoint)],
                               {**env, "TEST_STEP_CLOCK": "4", "TEST_SIGNAL_AT_FORWARD": str(SIGNAL_AT)})
        stopped = finish_all(procs)
        mid_epoch = folder / "mid-epoch.pt"
        mid_epoch.write_bytes(checkpoint.read_bytes())
        resumed = finish_all(start_copy(script, [*flags, *amp, "--checkpoint", str(checkpoint)], env))
        return Namespace(folder=folder, uninterrupted=uninterrupted, stopped=stopped, resumed=resumed, lr_log=lr_log,
                         mid_epoch=mid_epoch)
    return lambda name: shared(f"dropout-{name}", lambda folder: compute(folder, name))


def assert_resumed_bit_for_bit(runs, step):
    """The stopped run stopped at step (both ranks, exit 144, the step saved) and, resumed, ended with the
    uninterrupted run's weights, momentum and rates bit for bit; returns the uninterrupted run's rates."""
    codes, output, lr_log = runs.uninterrupted
    assert codes == [0, 0], output
    (stop_codes, stopped), (resume_codes, resumed) = runs.stopped, runs.resumed
    assert stop_codes == [REQUEUE_CODE] * 2 and STOPPED.findall(stopped) == [("1", str(step), "SIGTERM")], stopped
    assert state(runs.mid_epoch)["step"] == step
    assert resume_codes == [0, 0] and f"at epoch 1 step {step}" in resumed, resumed
    uninterrupted, final = state(runs.folder / "uninterrupted.pt"), state(runs.folder / "stopped.pt")
    assert all(torch.equal(final["model"][k], uninterrupted["model"][k]) for k in final["model"]), "not bit for bit"
    momentum = [(s["momentum_buffer"], uninterrupted["optimizer"]["state"][i]["momentum_buffer"])
                for i, s in final["optimizer"]["state"].items()]
    assert all(torch.equal(a, b) for a, b in momentum)
    assert final["optimizer"]["param_groups"] == uninterrupted["optimizer"]["param_groups"]  # the rates too
    return per_rank(lr_log)


def test_05_with_dropout_resumes_bit_for_bit_after_a_stop_in_the_warm_up(dropout_runs):
    """Stopped by SIGTERM after optimizer step HOLD_AT, inside the warm-up, and resumed: the weights, momentum and
    schedule of the uninterrupted run bit for bit, though dropout drew random numbers in every micro-batch; every
    optimizer step's learning rate, logged by both runs, is the uninterrupted sequence."""
    runs = dropout_runs("fp32")
    uninterrupted = assert_resumed_bit_for_bit(runs, HOLD_AT)
    interrupted = per_rank(runs.lr_log)
    assert interrupted == uninterrupted and len(uninterrupted[0]) == 50, (interrupted, uninterrupted)
    rates = [float(rate) for rate in uninterrupted[0]]
    assert rates[:16] == sorted(rates[:16]) and rates[HOLD_AT] < 0.01 and rates[-1] < 1e-4, rates  # warm-up, fall


def test_05_a_stop_between_two_micro_batches_falls_on_the_next_optimizer_step(dropout_runs):
    """--amp, SIGTERM to rank 0 in the second micro-batch of optimizer step 21: the step completes, both ranks stop
    after it, and the resumed run ends bit for bit like an uninterrupted --amp run."""
    assert_resumed_bit_for_bit(dropout_runs("amp"), SIGNAL_AT // 4 + 1)


def test_a_resume_under_another_global_batch_or_from_an_older_checkpoint_keeps_the_schedule(tmp_path):
    """An end-of-epoch checkpoint resumes under any layout: 01 trains one epoch at a global batch of 64 (50 steps
    an epoch), then resumes for epoch 2 at 32 x --accumulate 4 (25 steps an epoch, 50 in the run). Its rates go on from
    the steps trained as the new layout counts them (step 25 of 50), not from the old count (step 50: a rate of 0,
    so that epoch 2 would not train). The checkpoint's optimizer has no initial_lr, as those of the ladder before
    the schedule (and, since get_lr takes each group's rate from make_optimizer, every checkpoint): it resumes."""
    checkpoint, schedule = tmp_path / "ckpt.pt", ["--warmup", "0.1", "--cosine", "--log-interval", "0"]
    run_here("01_single_gpu", [*SYNTHETIC[:2], *schedule, "--epochs", "1", "--checkpoint", str(checkpoint)])
    old = state(checkpoint)
    assert old["epoch"] == 1 and sorted(old) == ["epoch", "model", "optimizer"], old  # no scheduler: it is recomputed
    assert all("initial_lr" not in group for group in old["optimizer"]["param_groups"]), old["optimizer"]
    rates = []
    handle = register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: rates.append(optimizer.param_groups[0]["lr"]))
    try:
        run_here("01_single_gpu", [*SYNTHETIC[:2], *schedule, "--batch-size", "32", "--accumulate", "4", "--epochs",
                                   "2", "--checkpoint", str(checkpoint)])
    finally:
        handle.remove()
    steps = STEPS_PER_EPOCH  # of the resumed layout's run: 2 epochs of 25
    rate = lambda s: (1 + math.cos(math.pi * min(1, max(0, s / steps - 0.1) / 0.9))) / 2  # noqa: E731 (after warm-up)
    assert rates == pytest.approx([0.01 * rate(s) for s in range(steps // 2, steps)], rel=1e-9), rates
    # The end of the cosine: the checkpoint holds the rate of the run's last step (set before each step).
    assert state(checkpoint)["optimizer"]["param_groups"][0]["lr"] == rates[-1] == pytest.approx(0.01 * rate(steps - 1))
