"""When things go wrong: a rank that dies does not leave the others hanging, torchrun's restart resumes
from the checkpoint, and a submitit job preempted on this machine requeues itself and resumes."""
import os
import signal
import subprocess
import sys
import time

import pytest

import torch

from conftest import (LAUNCH_LINE, REPO, SYNTHETIC, TOLERANCE, Result, batch_args, child_env, max_abs_diff,
                      read_line, submitit_logs, weights)


def start(cmd, env):
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, bufsize=1)


def read_until(proc, pattern, lines, timeout=60):
    """Reads proc's output line by line until one matches pattern; returns the match."""
    deadline = time.monotonic() + timeout
    while True:
        line = read_line(proc, deadline)
        if not line:
            break
        lines.append(line)
        match = pattern.search(line) if hasattr(pattern, "search") else (pattern in line or None)
        if match:
            return match
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"never saw {pattern!r}:\n{''.join(lines)}")


def finish(proc, lines, timeout):
    """Waits for proc at most timeout seconds; returns a Result with all its output."""
    start_time = time.monotonic()
    try:
        rest, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running {timeout} s after a rank died (hang):\n{''.join(lines)}")
    return Result(proc.returncode, "".join(lines) + rest, "", time.monotonic() - start_time)


LAUNCHERS = {
    "03_ddp_mpspawn": ([sys.executable, "03_ddp_mpspawn/train.py", "--world-size", "2"], {}),
    "04_ddp_torchrun": (["bash", "04_ddp_torchrun/run.sh"], {"NPROC_PER_NODE": "2", "MAX_RESTARTS": "0"}),
}


@pytest.mark.parametrize("step", list(LAUNCHERS))
def test_a_dead_rank_ends_the_run(step):
    cmd, extra = LAUNCHERS[step]
    proc = start([*cmd, *SYNTHETIC, "--epochs", "50"], child_env(**extra))
    lines, pids = [], {}
    while len(pids) < 2:
        match = read_until(proc, LAUNCH_LINE, lines)
        pids[match.group(1)] = int(match.group(5))
    read_until(proc, "epoch 1/50", lines)  # training is under way
    os.kill(pids["1"], signal.SIGKILL)
    result = finish(proc, lines, timeout=30)
    assert result.returncode != 0, result
    assert "epoch 50/50" not in result.output


def test_torchrun_restart_resumes_from_the_checkpoint(tmp_path, reference):
    """A worker dies in epoch 2; torchrun restarts both, they resume after epoch 1 and end with the
    weights of an uninterrupted run."""
    checkpoint = tmp_path / "ckpt.pt"
    proc = start(["bash", "04_ddp_torchrun/run.sh", *SYNTHETIC, *batch_args("04_ddp_torchrun"), "--epochs", "2",
                  "--checkpoint", str(checkpoint)], child_env(NPROC_PER_NODE="2", MAX_RESTARTS="1"))
    lines, pids = [], {}
    while len(pids) < 2:
        match = read_until(proc, LAUNCH_LINE, lines)
        pids[match.group(1)] = int(match.group(5))
    read_until(proc, "epoch 1/2", lines)
    os.kill(pids["1"], signal.SIGKILL)
    result = finish(proc, lines, timeout=90)
    assert result.returncode == 0, result
    assert result.output.count("resumed from") == 1 and "after epoch 1" in result.output, result
    assert result.output.count("epoch 1/2 |") == 1 and result.output.count("epoch 2/2 |") == 1, result
    assert max_abs_diff(weights(checkpoint), weights(reference.epoch2)) <= TOLERANCE


def test_submitit_local_preemption_requeues_and_resumes(tmp_path, ladder):
    """SIGUSR2 to both tasks of a --local job in epoch 2: they stop at one step, rank 0 saves it and
    submitit's handler requeues the job on this machine; it resumes there and ends like the ladder's run."""
    checkpoint, logs = tmp_path / "ckpt.pt", tmp_path / "logs"
    proc = start([sys.executable, "06_ddp_submitit/train.py", "--local", "--tasks-per-node", "2", "--log-dir",
                  str(logs), *SYNTHETIC, *batch_args("06_ddp_submitit"), "--epochs", "2",
                  "--checkpoint", str(checkpoint)], child_env())
    deadline = time.monotonic() + 60
    while "epoch 1/2 |" not in submitit_logs(logs):
        assert time.monotonic() < deadline and proc.poll() is None, submitit_logs(logs)
        time.sleep(0.1)
    for match in LAUNCH_LINE.finditer(submitit_logs(logs)):
        os.kill(int(match.group(5)), signal.SIGUSR2)
    result = finish(proc, [], timeout=90)
    log = submitit_logs(logs)
    assert result.returncode == 0, result.output + log
    assert "stopped at epoch 2 step" in log and "Requeued job" in log and "after epoch 1 step" in log, log
    assert log.count("epoch 1/2 |") == 1 and log.count("epoch 2/2 |") == 1, log
    resumed, uninterrupted = weights(checkpoint), weights(ladder("06_ddp_submitit").final)
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
