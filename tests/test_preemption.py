"""Preemption and resume as real clusters do them, without a cluster: 05 started as srun would start it and
06 through submitit's local executor. Slurm signals every process of a task, the data-loader workers too,
and on Python 3.14 those start by forkserver, elsewhere often by spawn; a node's view of the checkpoint can
lag; a job can come back with another layout. A fake `scontrol` on the PATH records the requeue."""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from conftest import (LAUNCH_LINE, REPO, SYNTHETIC, TOLERANCE, batch_args, child_env, free_port, load_step_module,
                      max_abs_diff, read_line, run_step, submitit_logs, weights)

TRAIN_05 = [*SYNTHETIC[:2], *batch_args("05_ddp_slurm")]  # --workers is chosen per test
# Python 3.14's default start method is forkserver; a sitecustomize on PYTHONPATH forces one here, in every
# Python process the test starts. It can also log every sample a TensorDataset hands out.
SITECUSTOMIZE = '''
import multiprocessing, os
if os.environ.get("TEST_START_METHOD"):
    multiprocessing.set_start_method(os.environ["TEST_START_METHOD"], force=True)
if os.environ.get("TEST_FETCH_LOG"):
    import torch.utils.data
    fetch = torch.utils.data.TensorDataset.__getitem__
    def logged_fetch(self, index):  # one index, or a batch's list of them
        with open(os.environ["TEST_FETCH_LOG"], "a") as log:
            for i in index if isinstance(index, list) else [index]:
                log.write(f"{os.environ.get('SLURM_PROCID')} {len(self)} {i}\\n")
        return fetch(self, index)
    torch.utils.data.TensorDataset.__getitem__ = logged_fetch
if os.environ.get("TEST_SIGNAL_AT_FETCH"):  # "SIZE:N": SIGUSR2 to itself at the Nth sample of a set of SIZE
    import signal, torch.utils.data
    size, nth = map(int, os.environ["TEST_SIGNAL_AT_FETCH"].split(":"))
    fetch, fetches = torch.utils.data.TensorDataset.__getitem__, [0]
    def signalling_fetch(self, index):
        fetches[0] += len(self) == size
        if len(self) == size and fetches[0] == nth:
            os.kill(os.getpid(), signal.SIGUSR2)
        return fetch(self, index)
    torch.utils.data.TensorDataset.__getitem__ = signalling_fetch
'''
STOPPED = re.compile(r"^stopped at epoch (\d+) step (\d+) on (SIGUSR2|SIGTERM)", re.M)
REQUEUE_CODE = 144  # what a stopped run exits with, for submit.sh (or submitit) to requeue the job
ATTEMPTS = 3


@pytest.fixture
def cluster_env(tmp_path):
    """child_env plus the sitecustomize and a fake scontrol that appends its arguments to a file."""
    bin_dir, site_dir = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir()
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    scontrol.chmod(0o755)

    def env(**extra):
        base = child_env(**extra)
        base.update(PYTHONPATH=str(site_dir), PATH=f"{bin_dir}{os.pathsep}{base['PATH']}")
        return base
    env.requeues = lambda: (tmp_path / "scontrol.log").read_text().splitlines() if (
        tmp_path / "scontrol.log").exists() else []
    return env


def descendants(pid):
    """The processes pid started, theirs, and so on (workers, a forkserver and its children), from /proc."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_every_process(pids, signum=signal.SIGUSR2):
    """A signal as Slurm sends it: to every process of each task; here the workers before their parent."""
    targets = [child for pid in pids for child in descendants(pid)] + list(pids)
    for pid in targets:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    return len(targets)


def start_05(args, env, world_size=2, cwds=None, job_id="4242"):
    """Step 05's tasks as srun starts them on one node (SLURM_* variables, submit.sh's MASTER_ADDR/PORT)."""
    port = free_port()
    return [subprocess.Popen([sys.executable, str(REPO / "05_ddp_slurm" / "train.py"), *args],
                             cwd=(cwds or [REPO] * world_size)[rank], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True,
                             env=env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(world_size),
                                     SLURM_STEP_ID="0", SLURM_JOB_ID=job_id, MASTER_ADDR="127.0.0.1",
                                     MASTER_PORT=str(port)))
            for rank in range(world_size)]


def finish_all(procs, timeout=90, lines=()):
    """Waits for every task; a task still running at the timeout fails the test (a hang)."""
    deadline, outs = time.monotonic() + timeout, []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=max(1, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                os.killpg(other.pid, signal.SIGKILL)
            pytest.fail(f"a task still ran after {timeout} s (hang):\n{''.join(lines)}")
    codes = [proc.returncode for proc in procs]
    return codes, "".join(lines) + "".join(outs)


def preempt_05(env, checkpoint, workers, extra_env=(), ranks=(0, 1), signum=signal.SIGUSR2):
    """Runs 05 for two epochs and signals every process of the tasks of `ranks` early in epoch 2, until one
    attempt stops inside the epoch's training (a signal that lands after the last check stops the evaluation
    or lets the run finish, which is right; one before the first step stops at step 0). Returns (step,
    output of the stopped run)."""
    for attempt in range(ATTEMPTS):
        checkpoint.unlink(missing_ok=True)
        procs = start_05([*TRAIN_05, "--workers", str(workers), "--epochs", "2", "--checkpoint", str(checkpoint)],
                         lambda **kw: env(**kw, **dict(extra_env)))
        lines, deadline = [], time.monotonic() + 90
        while not any(line.startswith("epoch 1/2 |") for line in lines):
            line = read_line(procs[0], deadline)
            assert line, "".join(lines)
            lines.append(line)
        time.sleep(0.1 + 0.2 * attempt)  # into epoch 2 (about a second long)
        signalled = signal_every_process([procs[rank].pid for rank in ranks], signum)
        codes, output = finish_all(procs, lines=lines)
        stopped = STOPPED.search(output)
        assert codes == ([REQUEUE_CODE] * 2 if stopped else [0, 0]), output  # no process died of the signal
        assert "killed by signal" not in output and "died unexpectedly" not in output, output  # workers, helpers
        assert signalled >= len(ranks) * (1 + workers), signalled  # the workers were there and were signalled
        if stopped and 0 < int(stopped.group(2)) < 94:  # 94 steps: 3000 samples a rank, 32 a step
            assert stopped.group(1) == "2" and stopped.group(3) == signum.name, output
            return int(stopped.group(2)), output
    pytest.fail(f"in {ATTEMPTS} attempts the signal never stopped epoch 2 after its first step:\n{output}")


@pytest.mark.parametrize("method, ranks, signum", [("forkserver", (0, 1), signal.SIGTERM),
                                                   ("spawn", (0, 1), signal.SIGUSR2), ("fork", (1,), signal.SIGUSR2)],
                         ids=["forkserver-SIGTERM", "spawn-SIGUSR2", "fork-SIGUSR2-to-rank-1-only"])
def test_05_preemption_with_any_worker_start_method(cluster_env, ladder, reference, tmp_path, method, ranks, signum):
    """SIGTERM (a preemption, scancel) or SIGUSR2 (the time-limit warning) to every process of both tasks (or of
    rank 1's alone: the others must follow it), two data-loader workers each: no process dies, all ranks stop at
    one step inside epoch 2, rank 0 saves, and every task exits with the code that has submit.sh requeue the job,
    running no Slurm command itself; the resumed run loads none of the batches it trained before the stop and
    ends with the weights of an uninterrupted run."""
    checkpoint = tmp_path / "ckpt.pt"
    step, output = preempt_05(cluster_env, checkpoint, workers=2, extra_env={"TEST_START_METHOD": method},
                              ranks=ranks, signum=signum)
    assert cluster_env.requeues() == [], output  # scontrol is submit.sh's business, on the host
    saved = torch.load(checkpoint, map_location="cpu")
    assert (saved["epoch"], saved["step"], saved["world_size"], saved["batch_size"]) == (1, step, 2, 32)

    fetch_log = tmp_path / "fetches.log"
    procs = start_05([*TRAIN_05, "--workers", "2", "--epochs", "2", "--checkpoint", str(checkpoint),
                      "--log-interval", "30"],
                     lambda **kw: cluster_env(TEST_START_METHOD=method, TEST_FETCH_LOG=str(fetch_log), **kw))
    codes, output = finish_all(procs)
    assert codes == [0, 0], output
    assert f"resumed from {checkpoint} after epoch 1 step {step}" in output, output
    # Progress lines count the epoch's steps, not the resumed run's: at 30, 60, 90 of 94 past the stop.
    progress = re.findall(r"^epoch 2 step (\d+)/(\d+) \|", output, re.M)
    assert progress == [(str(n), "94") for n in (30, 60, 90) if n > step], (step, output)
    assert output.count("epoch 2/2 |") == 1 and "epoch 1/2 |" not in output, output
    # Each rank's share of epoch 2 is 3000 samples; the resumed run fetches only those after the stop.
    fetched = [line.split() for line in fetch_log.read_text().splitlines()]
    for rank in ("0", "1"):
        assert sum(1 for r, size, _ in fetched if r == rank and size == "6000") == 3000 - step * 32, (rank, step)
    final = weights(checkpoint)
    assert max_abs_diff(final, weights(reference.epoch2)) <= TOLERANCE
    assert max_abs_diff(final, weights(ladder("05_ddp_slurm").final)) <= TOLERANCE


@pytest.mark.parametrize("rank1_sees", ["no file", "the file before"])
def test_05_a_rank_that_sees_another_checkpoint_stops_the_run_with_one_line(cluster_env, ladder, tmp_path, rank1_sees):
    """Rank 1 runs in a folder where the relative --checkpoint path is missing, or holds an older checkpoint, as
    on a node whose view of shared storage lags behind. Rank 0 decides: both stop at once, before training, with
    one line that says so, rather than hang or train from two states."""
    folders = [tmp_path / "rank0", tmp_path / "rank1"]
    for folder in folders:
        folder.mkdir()
    (folders[0] / "ckpt.pt").write_bytes(ladder("05_ddp_slurm").final.read_bytes())  # after epoch 2
    if rank1_sees == "the file before":
        (folders[1] / "ckpt.pt").write_bytes(ladder("05_ddp_slurm").epoch1.read_bytes())
    procs = start_05([*TRAIN_05, "--workers", "0", "--epochs", "3", "--checkpoint", "ckpt.pt"], cluster_env,
                     cwds=folders)
    codes, output = finish_all(procs, timeout=60)
    assert codes[0] != 0 and codes[1] != 0, output
    seen = "no file" if rank1_sees == "no file" else "epoch 1 step 0"
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert errors == [f"error: rank 1 on {os.uname().nodename} finds {seen} at ckpt.pt, rank 0 epoch 2 step 0: start "
                      "again once every node sees rank 0's file"], output
    assert "Traceback" not in output and "epoch 3/3" not in output, output
    assert (folders[0] / "ckpt.pt").read_bytes() == ladder("05_ddp_slurm").final.read_bytes()  # nothing saved


def test_05_mid_epoch_checkpoint_and_another_layout(cluster_env, reference, tmp_path):
    """A checkpoint from inside epoch 2 of 2 processes x 32 resumes in 1 process x 64 (the same global batch,
    the position maps exactly) and ends right; with 2 x 16 it is refused with one line; an end-of-epoch
    checkpoint resumes under any layout."""
    checkpoint = tmp_path / "ckpt.pt"
    step, _ = preempt_05(cluster_env, checkpoint, workers=0)
    mid_epoch = checkpoint.read_bytes()

    procs = start_05([*SYNTHETIC, "--batch-size", "16", "--epochs", "2", "--checkpoint", str(checkpoint)],
                     cluster_env)
    codes, output = finish_all(procs, timeout=60)
    assert codes[0] != 0 and codes[1] != 0, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {checkpoint} stopped inside epoch 2 with 2 processes x 32 samples per step, --seed 0 and "
                      "6000 training samples; resume it with the same global batch, seed and data (now 2 x 16, 0, 6000) "
                      "or from an end-of-epoch checkpoint"], output
    assert checkpoint.read_bytes() == mid_epoch  # refused before anything was trained or saved

    procs = start_05([*SYNTHETIC, "--batch-size", "32", "--seed", "1", "--epochs", "2", "--checkpoint",
                      str(checkpoint)], cluster_env)  # another seed: step N would mean other samples
    codes, output = finish_all(procs, timeout=60)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert codes[0] != 0 and len(errors) == 1 and "now 2 x 32, 1, 6000" in errors[0], output
    assert checkpoint.read_bytes() == mid_epoch

    for other in ("01_single_gpu", "02_dataparallel", "03_ddp_mpspawn", "04_ddp_torchrun"):  # they cannot skip steps
        result = run_step(other, [*SYNTHETIC, *batch_args(other), "--epochs", "2", "--checkpoint", str(checkpoint)],
                          tmp_path)
        errors = [line for line in (result.output + result.stderr).splitlines() if line.startswith("error:")]
        assert result.returncode != 0 and errors == [  # torchrun adds its own report of the failed process
            f"error: {checkpoint} stopped inside epoch 2; resume it with the step that wrote it (05 or 06), or start "
            "from a checkpoint saved at the end of an epoch"], (other, result)
        assert checkpoint.read_bytes() == mid_epoch

    procs = start_05([*SYNTHETIC, "--batch-size", "64", "--epochs", "2", "--checkpoint", str(checkpoint)],
                     cluster_env, world_size=1)
    codes, output = finish_all(procs, timeout=60)
    assert codes == [0], output
    assert f"after epoch 1 step {step}" in output and output.count("epoch 2/2 |") == 1, output
    assert max_abs_diff(weights(checkpoint), weights(reference.epoch2)) <= TOLERANCE

    end_of_epoch = tmp_path / "epoch1.pt"
    end_of_epoch.write_bytes(reference.epoch1.read_bytes())  # written by 01: one process x 64
    procs = start_05([*SYNTHETIC, "--batch-size", "16", "--epochs", "2", "--checkpoint", str(end_of_epoch)],
                     cluster_env, world_size=2)
    codes, output = finish_all(procs, timeout=60)
    assert codes == [0, 0] and "after epoch 1 step 0" in output and "epoch 2/2 |" in output, output


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_06_local_preemption_requeues_and_resumes(cluster_env, ladder, tmp_path, method):
    """06 --local with two workers per task: SIGUSR2 to every process of both tasks in epoch 2 stops them at
    one step inside the epoch, rank 0 saves, submitit's handler requeues the job on this machine, and it
    resumes there and ends like the ladder's uninterrupted run."""
    for attempt in range(ATTEMPTS):
        checkpoint, logs = tmp_path / f"ckpt{attempt}.pt", tmp_path / f"logs{attempt}"
        proc = subprocess.Popen(
            [sys.executable, "06_ddp_submitit/train.py", "--local", "--tasks-per-node", "2", "--log-dir", str(logs),
             *SYNTHETIC[:2], "--workers", "2", *batch_args("06_ddp_submitit"), "--epochs", "2",
             "--checkpoint", str(checkpoint)],
            cwd=REPO, env=cluster_env(TEST_START_METHOD=method), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True)
        deadline = time.monotonic() + 90
        while "epoch 1/2 |" not in submitit_logs(logs):
            assert time.monotonic() < deadline and proc.poll() is None, submitit_logs(logs)
            time.sleep(0.05)
        time.sleep(0.1 + 0.2 * attempt)
        signal_every_process([int(m.group(5)) for m in LAUNCH_LINE.finditer(submitit_logs(logs))])
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"06 still running 120 s after the signal:\n{submitit_logs(logs)}")
        log = submitit_logs(logs)
        assert proc.returncode == 0, out + log
        stopped = STOPPED.search(log)
        if stopped and int(stopped.group(2)) > 0:
            break
    else:
        pytest.fail(f"in {ATTEMPTS} attempts the signal never stopped epoch 2 after its first step:\n{log}")
    assert stopped.group(1) == "2" and f"exit code {REQUEUE_CODE} to be requeued" in log, log
    assert f"after epoch 1 step {stopped.group(2)}" in log, log
    assert log.count("epoch 1/2 |") == 1 and log.count("epoch 2/2 |") == 1, log
    resumed, uninterrupted = weights(checkpoint), weights(ladder("06_ddp_submitit").final)
    assert max_abs_diff(resumed, uninterrupted) <= TOLERANCE


def test_05_a_signal_during_evaluation_stops_the_job(cluster_env, reference, tmp_path):
    """Rank 1 signals itself during epoch 2's evaluation (at its 1001st test sample; 1000 per rank and
    epoch), rank 0 gets nothing: both stop there, rank 0 saves the epoch as trained, both exit to be requeued; the
    resumed run trains no step, evaluates, and prints epoch 2's line with the uninterrupted run's loss."""
    checkpoint = tmp_path / "ckpt.pt"
    signal_on_rank_1 = lambda **kw: cluster_env(**kw, **(  # noqa: E731
        {"TEST_SIGNAL_AT_FETCH": "2000:1001"} if kw["SLURM_PROCID"] == "1" else {}))
    procs = start_05([*TRAIN_05, "--workers", "0", "--epochs", "2", "--checkpoint", str(checkpoint)],
                     signal_on_rank_1)
    codes, output = finish_all(procs, timeout=60)
    assert codes == [REQUEUE_CODE] * 2, output
    assert "stopped at epoch 2 step 94 on SIGUSR2" in output and "epoch 2/2 |" not in output, output  # 94 steps
    assert "epoch 1/2 |" in output, output
    assert cluster_env.requeues() == [], output

    procs = start_05([*TRAIN_05, "--workers", "0", "--epochs", "2", "--checkpoint", str(checkpoint)], cluster_env)
    codes, output = finish_all(procs, timeout=60)
    assert codes == [0, 0], output
    assert "after epoch 1 step 94" in output, output
    [resumed] = [line for line in output.splitlines() if line.startswith("epoch 2/2 |")]
    [uninterrupted] = [line for line in reference.run2.output.splitlines() if line.startswith("epoch 2/2 |")]
    assert resumed.split("|")[1:3] == uninterrupted.split("|")[1:3], (resumed, uninterrupted)  # loss, accuracy
    assert max_abs_diff(weights(checkpoint), weights(reference.epoch2)) <= TOLERANCE


def test_05_without_a_checkpoint_a_stop_ends_the_run_and_asks_for_no_requeue(cluster_env, tmp_path):
    """Without --checkpoint there is nothing to resume from: SIGUSR2 (rank 1 signals itself at its 3500th
    training sample, in epoch 2) ends the run with one line that says so and exit code 0, so that submit.sh
    requeues nothing (a requeued job would start over)."""
    signal_on_rank_1 = lambda **kw: cluster_env(**kw, **(  # noqa: E731
        {"TEST_SIGNAL_AT_FETCH": "6000:3500"} if kw["SLURM_PROCID"] == "1" else {}))
    procs = start_05([*TRAIN_05, "--workers", "0", "--epochs", "2"], signal_on_rank_1, cwds=[tmp_path] * 2)
    codes, output = finish_all(procs, timeout=60)
    assert codes == [0, 0], output
    stops = [line for line in output.splitlines() if line.startswith("stopped at")]
    assert len(stops) == 1 and re.fullmatch(r"stopped at epoch 2 step \d+ on SIGUSR2: no --checkpoint, so nothing is "
                                            r"saved and the job is not requeued \(it would start over\)", stops[0]), output
    assert "epoch 1/2 |" in output and "epoch 2/2 |" not in output and cluster_env.requeues() == [], output
    assert not list(tmp_path.glob("*.pt")), list(tmp_path.iterdir())


class SlowData(Dataset):
    def __init__(self, seconds, size):
        self.seconds, self.size = seconds, size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        time.sleep(self.seconds)
        return torch.zeros(1, 28, 28), 0


def test_05_the_stop_check_is_bounded_in_time_and_cheap(monkeypatch):
    """The ranks agree on stopping at least every STOP_CHECK_SECONDS whatever a step costs, and with cheap
    steps they check rarely (each check is an all_reduce that waits for the GPU)."""
    module = load_step_module("05_ddp_slurm")
    monkeypatch.setattr(module, "STOP_CHECK_SECONDS", 0.5, raising=False)
    checks = []
    stop_requested = module.stop_requested
    monkeypatch.setattr(module, "stop_requested", lambda *a: checks.append(time.monotonic()) or stop_requested(*a))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10))  # steps of well under 1 ms
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        module.STOP.clear()
        (_, samples), stopped_at, _ = module.train_one_epoch(model, DataLoader(SlowData(0, 4000), batch_size=4),
                                                             optimizer, torch.device("cpu"), 0, 0)
        assert stopped_at is None and samples == 4000
        assert len(checks) < 40, len(checks)  # 1000 cheap steps: a few checks, not one every 10 steps

        checks.clear()
        loader = DataLoader(SlowData(0.05, 400), batch_size=4)  # 0.2 s a step: 10 steps take 2 s
        timer = threading.Timer(2.0, lambda: module.STOP.update(signal=signal.SIGUSR2))
        timer.start()
        requested = time.monotonic() + 2.0
        (_, samples), stopped_at, signum = module.train_one_epoch(model, loader, optimizer, torch.device("cpu"), 0, 0)
        timer.cancel()
        assert stopped_at is not None and 0 < samples < 400 and signum == signal.SIGUSR2, (stopped_at, samples)
        assert checks[-1] - requested < 0.5 + 0.25, [round(t - requested, 2) for t in checks]  # one interval + a step
    finally:
        module.STOP.clear()
        dist.destroy_process_group()
