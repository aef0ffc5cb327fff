"""What a resume restores, beyond the weights (issue 37). A user adds a stateful object of their own to the dict
next to `checkpointed = {...}` in train(), as its comment says: a copied 05 stopped inside an epoch saves it with the
position and, resumed, ends with the uninterrupted run's. And what a resume does not restore: the optimizer's
settings are this run's, so a resume under another --lr trains at it, and per-group rates stay apart."""
import ast
import contextlib
import difflib
import io
import os
import signal
import socket
import sys
from argparse import Namespace

import pytest
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from conftest import REPO, STEPS_PER_EPOCH, SYNTHETIC, load_step_module, wait_for
from test_accumulation import site_dir, start_copy
from test_copy import copy_step
from test_preemption import REQUEUE_CODE, STOPPED, finish_all, hold_env

COUNTER = '''

class StepCounter:
    """The optimizer steps taken, counted by a hook on the optimizer: state of the user's own that a resume restores."""

    def __init__(self, optimizer):
        self.steps = 0
        optimizer.register_step_post_hook(lambda optimizer, args, kwargs: self.count())

    def count(self):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]
'''
STATEFUL = '    checkpointed = {"model": model, "optimizer": optimizer}\n'
USER_STATEFUL = '    checkpointed = {"model": model, "optimizer": optimizer, "steps": StepCounter(optimizer)}\n'
HOLD = 20  # the optimizer step of the epoch's 50 after which both ranks are held and get SIGTERM
FLAGS = [*SYNTHETIC, "--batch-size", "32", "--epochs", "1"]  # 2 ranks x 32: 50 steps


def state(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def definition(source, name):
    """The source of the top-level definition called name."""
    [node] = [node for node in ast.parse(source).body if getattr(node, "name", None) == name]
    return "".join(source.splitlines(keepends=True)[node.lineno - 1:node.end_lineno])


def copy_05_with_a_counter(project):
    """05 copied alone into project, as a user adds a StepCounter: the class after Net, and the one line."""
    original = (REPO / "05_ddp_slurm" / "train.py").read_text()
    script = copy_step("05_ddp_slurm", project, definition(original, "Net") + COUNTER, ("Net",)) / "train.py"
    assert script.read_text().count(STATEFUL) == 1
    script.write_text(script.read_text().replace(STATEFUL, USER_STATEFUL))
    return script


@pytest.fixture(scope="session")
def counted(shared):
    """The copy, 2 ranks x 32, one epoch: uninterrupted, and (at the same time) held after step HOLD, stopped there by
    SIGTERM to both ranks, then resumed. Made once for all pytest-xdist workers."""
    def compute(folder):
        script, site = copy_05_with_a_counter(folder / "project"), site_dir(folder)
        uninterrupted, checkpoint = folder / "uninterrupted.pt", folder / "ckpt.pt"
        hold, held, _ = hold_env(folder, HOLD)
        whole = start_copy(script, [*FLAGS, "--checkpoint", str(uninterrupted)], dict(PYTHONPATH=site))
        stopping = start_copy(script, [*FLAGS, "--checkpoint", str(checkpoint)], dict(PYTHONPATH=site, **hold))
        wait_for(lambda: len(held()) == 2 or any(proc.poll() is not None for proc in stopping), 120, "both ranks held")
        for proc in stopping:
            os.kill(proc.pid, signal.SIGTERM)
        stopped = finish_all(stopping)
        mid_epoch = folder / "mid-epoch.pt"
        mid_epoch.write_bytes(checkpoint.read_bytes())
        resumed = finish_all(start_copy(script, [*FLAGS, "--checkpoint", str(checkpoint)], dict(PYTHONPATH=site)))
        return Namespace(script=script, whole=finish_all(whole), uninterrupted=uninterrupted, stopped=stopped,
                         mid_epoch=mid_epoch, resumed=resumed, final=checkpoint)
    return shared("resume-counter", compute)


def test_the_users_edit_is_the_class_and_the_stateful_line(tmp_path):
    """The copy differs from 05 only where the user edited it: the class added after Net, and the checkpointed line (the
    copy the other tests run; that it needs no other change is what they prove)."""
    original = (REPO / "05_ddp_slurm" / "train.py").read_text().splitlines(keepends=True)
    edited = copy_05_with_a_counter(tmp_path / "project").read_text().splitlines(keepends=True)
    diff = [line for line in difflib.unified_diff(original, edited, n=0) if line[:3] not in ("---", "+++")]
    removed = [line[1:] for line in diff if line.startswith("-")]
    added = [line[1:] for line in diff if line.startswith("+")]
    assert removed == [STATEFUL], diff
    # The class and the line, in order; the diff may pair the blank lines around the class either way.
    expected = (COUNTER + USER_STATEFUL).splitlines(keepends=True)
    assert [line for line in added if line.strip()] == [line for line in expected if line.strip()], diff
    assert len(added) == len(expected), diff


def test_a_users_stateful_object_is_saved_mid_epoch_and_restored(counted):
    """The mid-epoch checkpoint holds the counter at the step of the stop; the resumed run goes on counting from
    there and ends with the uninterrupted run's count (without the restore it would end at 50 - HOLD) and weights."""
    codes, output = counted.whole
    assert codes == [0, 0], output
    (stop_codes, stopped), (resume_codes, resumed) = counted.stopped, counted.resumed
    assert stop_codes == [REQUEUE_CODE] * 2 and STOPPED.findall(stopped) == [("1", str(HOLD), "SIGTERM")], stopped
    assert resume_codes == [0, 0] and f"at epoch 1 step {HOLD}" in resumed, resumed
    mid_epoch, final, uninterrupted = map(state, (counted.mid_epoch, counted.final, counted.uninterrupted))
    assert mid_epoch["step"] == HOLD and mid_epoch["steps"] == {"steps": HOLD}, mid_epoch.keys()
    assert uninterrupted["steps"] == {"steps": STEPS_PER_EPOCH}, uninterrupted["steps"]
    assert final["epoch"] == 1 and final["steps"] == uninterrupted["steps"], (final["steps"], uninterrupted["steps"])
    assert all(torch.equal(final["model"][k], uninterrupted["model"][k]) for k in final["model"])


def test_a_users_stateful_object_is_not_in_the_position_the_ranks_compare(counted, monkeypatch):
    """check_same_checkpoint compares the progress that load_checkpoint returns (what is not a checkpointed object)
    across ranks with all_gather_object: the counter is not part of it (a rank's own state there would stop a run
    whose ranks differ in it), and is restored. In this process, as rank 0 of a world of one."""
    module = load_step_module("05_copied_counter", counted.script)
    gathered = []
    gather = dist.all_gather_object
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: gathered.append(obj) or gather(
        out, obj, group=group))
    model = module.Net()
    optimizer = module.make_optimizer(model, Namespace(lr=0.01))
    counter = module.StepCounter(optimizer)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        progress, load_error = module.load_checkpoint(str(counted.mid_epoch), {
            "model": model, "optimizer": optimizer, "steps": counter})
        module.check_same_checkpoint(str(counted.mid_epoch), progress, load_error, None)
    finally:
        dist.destroy_process_group()
    assert gathered == [(socket.gethostname(), progress, None)] and progress["step"] == HOLD, gathered  # the counter's state is not in it
    assert sorted(progress) == ["count", "epoch", "loss_sum", "resumed_at", "sample_order", "stalled_runs", "step"], (
        progress)
    assert counter.steps == HOLD


def train_here(script, args):
    """A 01 (the repository's, or a copy at script) trained in this process; returns (its output, the rates of
    every optimizer step: a list per step of each group's)."""
    module, output, rates = load_step_module(f"resume_{script.parent.name}", script), io.StringIO(), []
    handle = register_optimizer_step_post_hook(
        lambda optimizer, a, kw: rates.append([group["lr"] for group in optimizer.param_groups]))
    try:
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(output):
            patch.setattr(sys, "argv", [str(script), *args])
            module.train(module.parse_args(), torch.device("cpu"))
    finally:
        handle.remove()
    return output.getvalue(), rates


def test_a_resume_under_another_lr_trains_at_it(tmp_path):
    """01 trains epoch 1 at --lr 0.01, then resumes for epoch 2 at --lr 0.02: every optimizer step of epoch 2 is at
    0.02 (not the checkpoint's 0.01), and the saved param_groups hold 0.02 (each checkpoint: its last step's rate)."""
    checkpoint, script = tmp_path / "ckpt.pt", REPO / "01_single_gpu" / "train.py"
    flags = [*SYNTHETIC, "--batch-size", "64", "--log-interval", "0", "--checkpoint", str(checkpoint)]
    _, first = train_here(script, [*flags, "--epochs", "1", "--lr", "0.01"])
    assert first == [[0.01]] * STEPS_PER_EPOCH, first
    assert [g["lr"] for g in state(checkpoint)["optimizer"]["param_groups"]] == [0.01]
    output, second = train_here(script, [*flags, "--epochs", "2", "--lr", "0.02"])
    assert "resumed from" in output and "after epoch 1" in output and "epoch 2/2 |" in output, output
    assert second == [[0.02]] * STEPS_PER_EPOCH, second
    saved = state(checkpoint)
    assert saved["epoch"] == 2 and [g["lr"] for g in saved["optimizer"]["param_groups"]] == [
        0.02], saved["optimizer"]["param_groups"]
    assert saved["optimizer"]["param_groups"][0]["momentum"] == 0.9 and len(saved["optimizer"]["state"]) == 8


TWO_GROUPS = '''
def make_optimizer(model, args):
    """Two groups: the convolutions at --lr, the rest at a tenth of it."""
    convs = [p for name, p in model.named_parameters() if name.startswith("conv")]
    rest = [p for name, p in model.named_parameters() if not name.startswith("conv")]
    return torch.optim.SGD([{"params": convs}, {"params": rest, "lr": args.lr / 10}], lr=args.lr, momentum=0.9)
'''


def test_per_group_rates_stay_apart_on_a_resume(tmp_path):
    """A copied 01 whose make_optimizer builds two groups (--lr and --lr / 10), under warm-up + cosine: epoch 1 at
    --lr 0.01, resumed for epoch 2 at --lr 0.02. Each of epoch 2's steps has each group at its own rate times the
    schedule's factor, from 50 of 100 steps on (the code before bcffb47 set both groups' base to --lr)."""
    script = copy_step("01_single_gpu", tmp_path / "project", TWO_GROUPS, ("make_optimizer",)) / "train.py"
    checkpoint = tmp_path / "ckpt.pt"
    flags = [*SYNTHETIC, "--batch-size", "64", "--warmup", "0.1", "--cosine", "--log-interval", "0", "--checkpoint",
             str(checkpoint)]
    _, first = train_here(script, [*flags, "--epochs", "1", "--lr", "0.01"])
    assert len(first) == STEPS_PER_EPOCH and all(rest == pytest.approx(conv / 10) for conv, rest in first), first
    # The checkpoint holds the groups' rates of epoch 1's last step: still a tenth apart.
    assert [g["lr"] for g in state(checkpoint)["optimizer"]["param_groups"]] == first[-1]
    output, second = train_here(script, [*flags, "--epochs", "2", "--lr", "0.02"])
    assert "after epoch 1" in output and "epoch 2/2 |" in output, output
    module = load_step_module("resume_factor", script)
    args = Namespace(warmup=0.1, cosine=True)
    # The schedule's factor: the rate of a group whose own rate is 1.
    factors = [module.get_lr(step, 2 * STEPS_PER_EPOCH, 1.0, args)
               for step in range(STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH)]
    expected = [[0.02 * f, 0.002 * f] for f in factors]
    assert [rate for step in second for rate in step] == pytest.approx(
        [rate for step in expected for rate in step], rel=1e-12), (second[:3], expected[:3])
    assert factors[0] > 0.5  # the rates of epoch 2 are not all near 0, where the groups could not be told apart
    saved = state(checkpoint)["optimizer"]["param_groups"]
    assert [g["lr"] for g in saved] == second[-1] and [len(g["params"]) for g in saved] == [4, 4], saved
