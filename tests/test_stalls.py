"""A job whose runs keep stopping without progress is not requeued for ever. A time limit that the start-up and
the signal's lead use up (a big data load, a short --time for a first try) stops every run before its first step,
and the batch script would requeue it again and again. The runs here are 05's train() in this process, stopped by
a stop signal that stop_signal_received() finds pending from a point the test chooses: from the start, at the first
batch of an evaluation, or once the end-of-epoch checkpoint is written."""
import re
import signal

import pytest
import torch

from conftest import STEPS_PER_EPOCH, SYNTHETIC, train_in_process

REQUEUE_CODE = 144


def test_the_third_run_in_a_row_without_progress_ends_the_job(monkeypatch, capsys, tmp_path):
    """Runs that stop where they resumed, with no step trained and no evaluation finished, count in the checkpoint;
    the third in a row ends with one line and exit code 1, which submit.sh and 06's batch script do not requeue. A run
    that resumes at the end of an epoch and finishes its evaluation has made progress, even if it trains no step. The
    count carries over only into a requeued run (SLURM_RESTART_COUNT above 0): a new job that resumes the file starts
    at 0."""
    pending, when = set(), {}
    monkeypatch.setattr(signal, "sigpending", lambda: set(pending))  # what stop_signal_received() finds
    # A batch script that requeues on 144 without exporting REQUEUE_ON_144 (a copy of submit.sh from before it, a
    # site's template): the guard holds all the same. With the stop line's wording first, every run exited 144.
    monkeypatch.delenv("REQUEUE_ON_144", raising=False)
    save = torch.save

    def save_then_stop(*args, **kwargs):  # the end-of-epoch checkpoint written, then the signal
        save(*args, **kwargs)
        pending.update({signal.SIGUSR2} if when.get("after_save") else ())
    monkeypatch.setattr(torch, "save", save_then_stop)

    def stop_in_evaluation(module, inputs, output):
        if not module.training and when.get("in_evaluation"):
            pending.add(signal.SIGUSR2)
    hook = torch.nn.modules.module.register_module_forward_hook(stop_in_evaluation)
    checkpoint = tmp_path / "ckpt.pt"
    runs = []
    try:
        for restart, stop in enumerate(["in_evaluation"] * 3 + ["after_save"] + ["start"] * 3 + ["start"]):
            monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart % 7))  # the last run: a new job's first
            pending.clear()
            pending.update({signal.SIGUSR2} if stop == "start" else ())
            when.clear()
            when[stop] = True
            code, output = train_in_process("05_ddp_slurm", [*SYNTHETIC, "--batch-size", "64", "--epochs", "2",
                                                             "--test-batch-size", "100", "--checkpoint",
                                                             str(checkpoint)], capsys)
            saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
            runs.append((code, saved["epoch"], saved.get("step"), saved.get("stalled_runs"), output))
    finally:
        hook.remove()
    # The first run trains epoch 1 and stops in its evaluation: progress. The next two resume there and stop in
    # the evaluation again: none. The fourth finishes it (its epoch line) and stops at the next epoch's first step.
    assert [run[:4] for run in runs] == [
        (REQUEUE_CODE, 0, STEPS_PER_EPOCH, 0), (REQUEUE_CODE, 0, STEPS_PER_EPOCH, 1),
        (REQUEUE_CODE, 0, STEPS_PER_EPOCH, 2), (REQUEUE_CODE, 1, 0, 0), (REQUEUE_CODE, 1, 0, 1), (REQUEUE_CODE, 1, 0, 2),
        (1, 1, 0, 3), (REQUEUE_CODE, 1, 0, 1)], [r[4] for r in runs]
    assert "epoch 1/2 |" in runs[3][4] and "epoch 1/2 |" not in "".join(run[4] for run in runs[:3])
    stops = [line for line in runs[-2][4].splitlines() if line.startswith("stopped")]
    assert len(stops) == 1 and re.fullmatch(
        r"stopped at epoch 2 step 0 on SIGUSR2 [\d.]+ s after the signal was seen, saved in [\d.]+ s: exit code 1, not "
        r"requeued: 3 runs in a row made no step \(raise the time limit\)",
        stops[0]), stops


def test_preemptions_before_any_progress_do_not_end_the_job(monkeypatch, capsys, tmp_path):
    """A scavenger partition, or a long start-up, can see a job preempted (SIGTERM) before its first step many times
    in a row: each run is requeued, as the next start may get further. Only time-limit stops (SIGUSR2) without
    progress count towards the stall guard; a preemption between them neither counts nor breaks the row. (When every
    stop counted, the third preemption in a row ended the job with exit code 1.)"""
    pending = set()
    monkeypatch.setattr(signal, "sigpending", lambda: set(pending))  # what stop_signal_received() finds
    monkeypatch.setenv("REQUEUE_ON_144", "1")  # a job of submit.sh, which requeues on 144
    checkpoint, runs = tmp_path / "ckpt.pt", []
    stops = [signal.SIGTERM] * 4 + [signal.SIGUSR2, signal.SIGTERM, signal.SIGUSR2, signal.SIGUSR2]
    for restart, stop in enumerate(stops):  # a new job, then its requeues, each stopped before its first step
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        pending.clear()
        pending.add(stop)
        code, output = train_in_process("05_ddp_slurm", [*SYNTHETIC, "--batch-size", "64", "--epochs", "2",
                                                         "--checkpoint", str(checkpoint)], capsys)
        saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
        runs.append((signal.Signals(stop).name, code, saved["stalled_runs"]))
    assert runs == [("SIGTERM", REQUEUE_CODE, 0)] * 4 + [
        ("SIGUSR2", REQUEUE_CODE, 1), ("SIGTERM", REQUEUE_CODE, 1), ("SIGUSR2", REQUEUE_CODE, 2),
        ("SIGUSR2", 1, 3)], runs
