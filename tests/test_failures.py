"""When things go wrong: a rank that dies does not leave the others hanging, and torchrun's restart resumes
from the checkpoint. (Preemption: test_preemption.py.)"""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import (LAUNCH_LINE, REPO, SYNTHETIC, TOLERANCE, Result, batch_args, child_env, max_abs_diff,
                      read_line, weights)


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


def ranks_after_epoch_1(proc, epoch_line):
    """Reads the two ranks' launch lines and then epoch_line; returns (the lines read, {rank: pid})."""
    lines, pids = [], {}
    while len(pids) < 2:
        match = read_until(proc, LAUNCH_LINE, lines)
        pids[match.group(1)] = int(match.group(5))
    read_until(proc, epoch_line, lines)  # training is under way
    return lines, pids


LAUNCHERS = {
    "03_ddp_mpspawn": ([sys.executable, "03_ddp_mpspawn/train.py", "--world-size", "2"], {}),
    "04_ddp_torchrun": (["bash", "04_ddp_torchrun/run.sh"], {"NPROC_PER_NODE": "2", "MAX_RESTARTS": "0"}),
}


def ended_or_told_to(pid):
    """Whether pid has ended, or has a SIGTERM or SIGKILL pending: a stopped process (SIGSTOP) cannot end by
    itself, and some kernels (this sandbox's among them) keep a SIGTERM pending until it is continued."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status.read().splitlines() if ":" in line)
    except FileNotFoundError:
        return True
    pending = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return fields["State"].split()[0] == "Z" or bool(pending & (1 << (signal.SIGTERM - 1) | 1 << (signal.SIGKILL - 1)))


@pytest.mark.parametrize("step", list(LAUNCHERS))
def test_the_launcher_ends_the_run_when_a_rank_dies(step):
    """Rank 0 is stopped (SIGSTOP), so it cannot notice anything or fail by itself, and rank 1 is killed:
    within seconds the launcher must end rank 0 (or have sent it SIGTERM), and the run fails."""
    cmd, extra = LAUNCHERS[step]
    proc = start([*cmd, *SYNTHETIC, "--epochs", "50"], child_env(**extra))
    lines, pids = ranks_after_epoch_1(proc, "epoch 1/50")
    os.kill(pids["0"], signal.SIGSTOP)
    os.kill(pids["1"], signal.SIGKILL)
    killed = time.monotonic()
    while not ended_or_told_to(pids["0"]) and time.monotonic() - killed < 20:
        time.sleep(0.1)
    ended_in = time.monotonic() - killed
    try:
        os.kill(pids["0"], signal.SIGKILL)  # the launcher may wait for it a while longer
    except ProcessLookupError:
        pass
    result = finish(proc, lines, timeout=60)
    print(f"{step}: the launcher ended or signalled the stopped rank 0 {ended_in:.1f} s after rank 1 died")
    assert ended_in < 20, f"the launcher left the stopped rank 0 alone:\n{result}"
    assert result.returncode != 0, result
    assert "epoch 50/50" not in result.output


TIMEOUT = 5  # --collective-timeout in the tests below; 600 s by default


@pytest.mark.parametrize("step", list(LAUNCHERS))
def test_a_rank_that_stops_answering_ends_the_run_after_the_timeout(step):
    """Rank 1 is stopped (SIGSTOP) after epoch 1, as a rank stuck in I/O would be: nothing dies, so only the
    collective timeout can end the run. Rank 0's next collective fails after --collective-timeout seconds, not before,
    rank 0 exits, and the launcher ends rank 1 (or has sent it SIGTERM)."""
    cmd, extra = LAUNCHERS[step]
    proc = start([*cmd, *SYNTHETIC, "--epochs", "50", "--collective-timeout", str(TIMEOUT)], child_env(**extra))
    lines, pids = ranks_after_epoch_1(proc, "epoch 1/50")
    os.kill(pids["1"], signal.SIGSTOP)
    stopped = time.monotonic()
    while not (ended_or_told_to(pids["0"]) and ended_or_told_to(pids["1"])) and time.monotonic() - stopped < 60:
        time.sleep(0.1)
    ended_in = time.monotonic() - stopped
    try:
        os.kill(pids["1"], signal.SIGKILL)  # a stopped process keeps a SIGTERM pending
    except ProcessLookupError:
        pass
    result = finish(proc, lines, timeout=60)
    print(f"{step}: rank 1 stopped; rank 0 failed and the launcher ended both {ended_in:.1f} s later "
          f"(--collective-timeout {TIMEOUT})")
    assert TIMEOUT - 1 <= ended_in < TIMEOUT + 20, f"ended {ended_in:.1f} s after the stop:\n{result}"
    assert "timed out" in result.output.lower(), result  # Gloo's own words for a collective that waited too long
    assert result.returncode != 0 and "epoch 50/50" not in result.output, result


SLOW_SAVES = """
import os
if os.environ.get("RANK") == "0":
    import time, torch
    save = torch.save
    torch.save = lambda *args, **kwargs: (time.sleep({seconds}), save(*args, **kwargs))[1]
"""


@pytest.fixture(scope="session")
def restarted(shared):
    """04 under torchrun --max-restarts 1 for two epochs, --collective-timeout TIMEOUT, rank 0's checkpoint writes
    taking twice that (a slow shared filesystem: torch.save made slow by a sitecustomize), and a worker killed in
    epoch 2: the run that the next two tests read."""
    def compute(folder):
        (folder / "sitecustomize.py").write_text(SLOW_SAVES.format(seconds=2 * TIMEOUT))
        checkpoint = folder / "ckpt.pt"
        proc = start(["bash", "04_ddp_torchrun/run.sh", *SYNTHETIC, *batch_args("04_ddp_torchrun"), "--epochs", "2",
                      "--checkpoint", str(checkpoint), "--collective-timeout", str(TIMEOUT)],
                     child_env(NPROC_PER_NODE="2", MAX_RESTARTS="1", PYTHONPATH=str(folder)))
        lines, pids = ranks_after_epoch_1(proc, "epoch 1/2")
        os.kill(pids["1"], signal.SIGKILL)
        return finish(proc, lines, timeout=120), checkpoint
    return shared("torchrun-restarted", compute)


def test_torchrun_restart_resumes_from_the_checkpoint(restarted, reference):
    """A worker dies in epoch 2; torchrun restarts both, they resume after epoch 1 and end with the
    weights of an uninterrupted run."""
    result, checkpoint = restarted
    assert result.returncode == 0, result
    assert result.output.count("resumed from") == 1 and "after epoch 1" in result.output, result
    assert result.output.count("epoch 1/2 |") == 1 and result.output.count("epoch 2/2 |") == 1, result
    assert max_abs_diff(weights(checkpoint), weights(reference.epoch2)) <= TOLERANCE


def test_a_slow_rank0_save_does_not_count_against_the_timeout(restarted):
    """In the same run, each of rank 0's checkpoint writes (after epoch 1, and after epoch 2 of the restarted
    round) takes twice --collective-timeout: the other rank waits for them in a group of its own, and the run
    ends well (its weights: the test above)."""
    result, _ = restarted
    assert result.returncode == 0, result
    epoch_seconds = [e["seconds"] for e in result.epochs()]  # each epoch line's time includes its save
    assert len(epoch_seconds) == 2 and min(epoch_seconds) > 2 * TIMEOUT, result
