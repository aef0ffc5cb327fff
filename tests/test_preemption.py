"""Preemption and resume as real clusters do them, without a cluster: 05 started as srun would start it and
06 through submitit's local executor. Slurm signals every process of a task, the data-loader workers too,
and on Python 3.14 those start by forkserver, elsewhere often by spawn; a node's view of the checkpoint can
lag; a job can come back with another layout. A fake `scontrol` on the PATH would record a requeue: the
tasks must run none (the batch script, on the host, requeues)."""
import os
import re
import signal
import subprocess
import sys
import time
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import (GLOBAL_BATCH, REPO, STEPS_PER_EPOCH, SYNTHETIC, TOLERANCE, Task, batch_args, child_env, free_port,
                      max_abs_diff, run_step, submitit_logs, train_in_process, wait_for, weights)

TRAIN_05 = [*SYNTHETIC[:2], *batch_args("05_ddp_slurm")]  # --workers is chosen per test
# Python 3.14's default start method is forkserver; a sitecustomize on PYTHONPATH forces one here, in every
# Python process the test starts. It can also log every sample a TensorDataset hands out.
SITECUSTOMIZE = '''
import multiprocessing, os, sys
with open("/proc/self/cmdline", "rb") as cmdline:  # a training process (not a launcher's helper or a port probe)
    command = cmdline.read()  # or sys.argv: a process that conftest.Task forks from the preloaded Python sets it
    trains = b"train.py" in command or b"submitit.core._submit" in command or sys.argv[0].endswith("train.py")
if os.environ.get("TEST_START_METHOD"):  # one method, or one per rank: "forkserver,spawn"
    methods = os.environ["TEST_START_METHOD"].split(",")
    multiprocessing.set_start_method(methods[int(os.environ.get("SLURM_PROCID", 0)) % len(methods)], force=True)
if os.environ.get("TEST_SLOW_EXIT"):  # "RANK:SECONDS": that rank's training process takes so long to exit
    rank, seconds = os.environ["TEST_SLOW_EXIT"].split(":")
    if trains and os.environ.get("SLURM_PROCID") == rank:  # not its data-loader workers
        import atexit, time
        atexit.register(time.sleep, float(seconds))
if os.environ.get("TEST_FETCH_LOG"):
    import torch.utils.data
    fetch = torch.utils.data.TensorDataset.__getitem__
    def logged_fetch(self, index, fetch=fetch):  # one index, or a batch's list of them
        with open(os.environ["TEST_FETCH_LOG"], "a") as log:
            for i in index if isinstance(index, list) else [index]:
                log.write(f"{os.environ.get('SLURM_PROCID')} {len(self)} {i}\\n")
        return fetch(self, index)
    torch.utils.data.TensorDataset.__getitem__ = logged_fetch
if os.environ.get("TEST_SIGNAL_AT_FETCH"):  # "SIZE:N": SIGUSR2 to itself at the Nth sample of a set of SIZE
    import signal, torch.utils.data
    size, nth = map(int, os.environ["TEST_SIGNAL_AT_FETCH"].split(":"))
    fetch, fetches = torch.utils.data.TensorDataset.__getitem__, [0]
    def signalling_fetch(self, index, fetch=fetch):  # fetch: this one's, as TEST_FETCH_LOG's may wrap it
        fetches[0] += len(self) == size
        if len(self) == size and fetches[0] == nth:
            os.kill(os.getpid(), signal.SIGUSR2)
        return fetch(self, index)
    torch.utils.data.TensorDataset.__getitem__ = signalling_fetch
if trains and (os.environ.get("TEST_STEP_CLOCK") or os.environ.get("TEST_HOLD_AT_STEP")):
    import sys, time
    from torch.optim.optimizer import register_optimizer_step_post_hook
    steps, real_monotonic = [0], time.monotonic  # this process's optimizer steps (its workers take none)
    # TEST_STEP_CLOCK "SECONDS": the clock train.py reads (time.monotonic, for --save-every and the stop line)
    # advances SECONDS at each optimizer step and stands still between them, so that --save-every M saves every
    # 60 * M / SECONDS steps however fast or busy the machine. Every other caller keeps the real clock.
    per_step = float(os.environ.get("TEST_STEP_CLOCK") or 0)
    def step_clock():
        if per_step and sys._getframe(1).f_code.co_filename.endswith("train.py"):
            return steps[0] * per_step
        return real_monotonic()
    time.monotonic = step_clock
    # TEST_HOLD_AT_STEP "N0,N1,..:FILE": in this rank's run k (the lines it wrote to FILE before), after its Nk-th
    # optimizer step, "rank pid" to FILE, then wait there until train.py's stop_signal_received() finds a stop
    # signal (05, 06)
    # or FILE.go exists: a stop, a kill or a preemption the test sends then comes at that step.
    holds, marker = (os.environ.get("TEST_HOLD_AT_STEP") or "0:").split(":", 1)
    holds = [int(n) for n in holds.split(",")]
    def hold(optimizer, args, kwargs):
        steps[0] += 1
        rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"  # torchrun's, srun's
        if steps[0] == 1:
            earlier = open(marker).read().split() if os.path.exists(marker) else []
            holds.extend([0] * 99)
            holds[:] = holds[earlier[0::2].count(rank):]
        if steps[0] != holds[0]:
            return
        with open(marker, "a") as log:
            log.write(f"{rank} {os.getpid()}\\n")
        frame = sys._getframe(1)
        while frame and not frame.f_code.co_filename.endswith("train.py"):
            frame = frame.f_back
        received = frame.f_globals.get("stop_signal_received", lambda: 0) if frame else lambda: 0
        while not received() and not os.path.exists(marker + ".go"):
            time.sleep(0.01)
    register_optimizer_step_post_hook(hold)
'''
STOPPED = re.compile(r"^stopped at epoch (\d+) step (\d+) on (SIGUSR2|SIGTERM)", re.M)
REQUEUE_CODE = 144  # what a stopped run exits with, for submit.sh (or submitit) to requeue the job
STEP_CLOCK = "4"  # TEST_STEP_CLOCK: the default --save-every (30 minutes) never comes
HOLD = 10  # the step of epoch 2 at which the tests stop a run


def hold_env(folder, *steps):
    """(env, held, release): env holds each rank after its optimizer step steps[0] in its first run and steps[k]
    in its run k (counted from where that run resumed), until a stop signal reaches it (05, 06) or release() is
    called, on a clock that advances by steps (STEP_CLOCK): a stop then comes at the next step, whatever the
    machine's speed. held() lists the (rank, pid) of every hold so far, one per rank and run."""
    marker = Path(folder) / "held"
    env = {"TEST_STEP_CLOCK": STEP_CLOCK, "TEST_HOLD_AT_STEP": f"{','.join(map(str, steps))}:{marker}"}
    held = lambda: [tuple(map(int, line.split())) for line in  # noqa: E731
                    (marker.read_text().splitlines() if marker.exists() else [])]
    return env, held, lambda: Path(f"{marker}.go").touch()


def make_cluster_env(folder):
    """env(**extra): child_env plus the sitecustomize and a fake scontrol that appends its arguments to a file;
    env.requeues() lists them."""
    bin_dir, site_dir = folder / "bin", folder / "site"
    bin_dir.mkdir()
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {folder}/scontrol.log\n')
    scontrol.chmod(0o755)

    def env(**extra):
        base = child_env(**{"TEST_STEP_CLOCK": STEP_CLOCK, **extra})  # --save-every at steps, not moments
        base.update(PYTHONPATH=str(site_dir), PATH=f"{bin_dir}{os.pathsep}{base['PATH']}")
        return base
    env.requeues = lambda: (folder / "scontrol.log").read_text().splitlines() if (
        folder / "scontrol.log").exists() else []
    return env


@pytest.fixture
def cluster_env(tmp_path):
    return make_cluster_env(tmp_path)


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
    return [Task([REPO / "05_ddp_slurm" / "train.py", *args],
                 env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(world_size), SLURM_STEP_ID="0",
                     SLURM_JOB_ID=job_id, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                 (cwds or [REPO] * world_size)[rank], stderr=subprocess.STDOUT)
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


def preempt_05(env, checkpoint, workers, signals):
    """Runs 05 for two epochs, holds each rank after step HOLD of epoch 2 (hold_env) and sends signals[rank] to every
    process of each rank's task: all stop at step HOLD + 1's check, that is step HOLD. Returns the output."""
    hold, held, _ = hold_env(checkpoint.parent, STEPS_PER_EPOCH + HOLD)
    procs = start_05([*TRAIN_05, "--workers", str(workers), "--epochs", "2", "--checkpoint", str(checkpoint)],
                     lambda **kw: env(**kw, **hold))
    wait_for(lambda: len(held()) == 2 or any(proc.poll() is not None for proc in procs), 120, "both ranks held")
    sent = [signal_every_process([proc.pid], signum) for proc, signum in zip(procs, signals)]
    codes, output = finish_all(procs)
    assert codes == [REQUEUE_CODE] * 2, output  # no process died of the signal
    assert "killed by signal" not in output and "died unexpectedly" not in output, output  # workers, helpers
    assert min(sent) >= 1 + 2 * workers, sent  # each task's workers were there and were signalled
    # The ranks agree on the highest signal number that any of them has had.
    assert STOPPED.findall(output) == [("2", str(HOLD), max(signals).name)], output
    return output


# Rank 0's data-loader workers start by forkserver (Python 3.14's default) and every process of its task gets SIGUSR2
# (the time-limit warning); rank 1's start by spawn and get SIGTERM (a preemption, scancel). Workers started by fork
# (Linux's default before 3.14) get both signals in the Slurm tests' jobs, from Slurm (test_slurm.py). A signal to one
# process only: test_05_a_signal_during_evaluation_stops_the_job, test_05_without_a_checkpoint_a_stop_ends_the_run...
START_METHODS = ("forkserver", "spawn")
SIGNALS = (signal.SIGUSR2, signal.SIGTERM)  # rank 0 prints the stop line: the one signal that only rank 1 has had


@pytest.fixture(scope="session")
def preempted(shared):
    """05 stopped inside epoch 2 by a signal to every process of both tasks (START_METHODS, SIGNALS), one data-loader
    worker per loader, then resumed (with --log-interval 15, counting the samples it fetches). The mid-epoch
    checkpoint is kept aside for test_05_mid_epoch_checkpoint_and_another_layout."""
    def compute(folder):
        env = make_cluster_env(folder)
        with_methods = lambda **kw: env(TEST_START_METHOD=",".join(START_METHODS), **kw)  # noqa: E731
        checkpoint = folder / "ckpt.pt"
        stopped = preempt_05(with_methods, checkpoint, workers=1, signals=SIGNALS)
        mid_epoch = copy(checkpoint, folder / "mid-epoch.pt")
        fetch_log = folder / "fetches.log"
        procs = start_05([*TRAIN_05, "--workers", "1", "--epochs", "2", "--checkpoint", str(checkpoint),
                          "--log-interval", "15"], lambda **kw: with_methods(TEST_FETCH_LOG=str(fetch_log), **kw))
        codes, resumed = finish_all(procs)
        return Namespace(step=HOLD, stopped=stopped, codes=codes, resumed=resumed, requeues=env.requeues(),
                         fetch_log=fetch_log, mid_epoch=mid_epoch, final=checkpoint)
    return shared("preempted-05", compute)


def test_05_preemption_with_workers_of_any_start_method(preempted, ladder, reference):
    """SIGUSR2 (the time-limit warning) to every process of one task and SIGTERM (a preemption, scancel) to every
    process of the other, whose data-loader workers start by forkserver and by spawn: no process dies, all ranks stop
    at one step inside epoch 2, rank 0 saves, and every task exits with the code that has submit.sh requeue the job,
    running no Slurm command itself; the resumed run loads none of the batches it trained before the stop and ends
    with the weights of an uninterrupted run."""
    run = preempted
    step = run.step
    assert run.requeues == [], run.stopped  # scontrol is submit.sh's business, on the host
    saved = torch.load(run.mid_epoch, map_location="cpu")
    assert (saved["epoch"], saved["step"], saved["sample_order"]) == (1, step, "global batch 64, seed 0, 3200 samples")
    assert run.codes == [0, 0], run.resumed
    assert f"at epoch 2 step {step}" in run.resumed, run.resumed
    # Progress lines count the epoch's steps, not the resumed run's: at 15, 30, 45 of 50 past the stop.
    progress = re.findall(r"^epoch 2 step (\d+)/(\d+) \|", run.resumed, re.M)
    assert progress == [(str(n), str(STEPS_PER_EPOCH)) for n in (15, 30, 45) if n > step], (step, run.resumed)
    assert run.resumed.count("epoch 2/2 |") == 1 and "epoch 1/2 |" not in run.resumed, run.resumed
    # Each rank's share of epoch 2 is 1600 samples; the resumed run fetches only those after the stop.
    fetched = [line.split() for line in run.fetch_log.read_text().splitlines()]
    for rank in ("0", "1"):
        assert sum(1 for r, size, _ in fetched if r == rank and size == "3200") == 1600 - step * 32, (rank, step)
    final = weights(run.final)
    assert max_abs_diff(final, weights(reference.epoch2)) <= TOLERANCE
    assert max_abs_diff(final, weights(ladder("05_ddp_slurm").final)) <= TOLERANCE


def test_05_a_rank_that_sees_another_checkpoint_stops_the_run_with_one_line(cluster_env, ladder, tmp_path):
    """Three ranks, each in its own folder with the relative --checkpoint path: rank 0's holds the checkpoint,
    rank 1's nothing, rank 2's an older checkpoint, as on nodes whose view of shared storage lags behind. Rank 0
    decides: all stop at once, before training, with rank 0's one line naming the first rank that differs, rather
    than hang or train from different states."""
    folders = [tmp_path / f"rank{rank}" for rank in range(3)]
    for folder in folders:
        folder.mkdir()
    (folders[0] / "ckpt.pt").write_bytes(ladder("05_ddp_slurm").final.read_bytes())  # after epoch 2
    (folders[2] / "ckpt.pt").write_bytes(ladder("05_ddp_slurm").epoch1.read_bytes())
    for folder in folders[1:]:  # rank 0's probe file (05's site check), as a lagging shared folder shows it
        (folder / "ckpt.pt.probe").symlink_to(folders[0] / "ckpt.pt.probe")
    procs = start_05([*TRAIN_05, "--workers", "0", "--epochs", "3", "--checkpoint", "ckpt.pt"], cluster_env,
                     world_size=3, cwds=folders)
    codes, output = finish_all(procs, timeout=60)
    assert all(code != 0 for code in codes), output
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    host = os.uname().nodename
    assert errors == [f"error: cannot use the checkpoint ckpt.pt (rank 1 on {host}): it finds no file, rank 0 on "
                      f"{host} epoch 3 step 0: start again once every node sees the same file"], output
    assert "Traceback" not in output and "epoch 3/3" not in output, output
    assert (folders[0] / "ckpt.pt").read_bytes() == ladder("05_ddp_slurm").final.read_bytes()  # nothing saved


def test_05_mid_epoch_checkpoint_and_another_layout(preempted, reference, tmp_path, capsys):
    """A checkpoint from inside epoch 2 of 2 processes x 32 resumes in 1 process x 64 (the same global batch,
    the position maps exactly) and ends right; with 1 x 16, or another --seed, it is refused with one line; 01 to
    04, which cannot skip steps, refuse it with one line; an end-of-epoch checkpoint resumes under any layout.
    What only the layout decides runs in this process (train_in_process); 04 is started by torchrun, which adds
    its own report of the failed process, and must still give one error line."""
    run = preempted
    checkpoint, mid_epoch = tmp_path / "ckpt.pt", run.mid_epoch.read_bytes()
    checkpoint.write_bytes(mid_epoch)
    end_of_epoch = copy(reference.epoch1, tmp_path / "epoch1.pt")  # written by 01: one process x 64
    flags = [*SYNTHETIC, "--epochs", "2", "--checkpoint", str(checkpoint)]
    with ThreadPoolExecutor(1) as pool:  # torchrun's processes start while this one works
        torchrun = pool.submit(run_step, "04_ddp_torchrun", [*flags, *batch_args("04_ddp_torchrun")], tmp_path)
        batch16 = train_in_process("05_ddp_slurm", [*flags, "--batch-size", "16"], capsys)
        seed1 = train_in_process("05_ddp_slurm", [*flags, "--batch-size", "64", "--seed", "1"], capsys)
        others = {step: train_in_process(step, [*flags, *batch_args(step)], capsys) for step in OTHERS[:3]}
        result = torchrun.result()
    # 05 refuses with exit_with_error: exit code 1, rank 0's one line on stderr.
    assert batch16[0] == 1 and errors_of(batch16[1]) == [
        f"error: {checkpoint} stopped inside epoch 2 with global batch 64, seed 0, 3200 samples, now global batch 16, "
        "seed 0, 3200 samples: resume with those"], batch16
    assert seed1[0] == 1 and "now global batch 64, seed 1, 3200 samples" in "".join(errors_of(seed1[1])), seed1
    refusal = (f"error: {checkpoint} stopped inside epoch 2; resume it with 05 or 06, or from an end-of-epoch "
               "checkpoint")
    # 01 and 02 give sys.exit the line; 03, as every DDP step, exits 1 after rank 0 printed it (exit_with_error).
    assert [others[step][0] for step in OTHERS[:2]] == [refusal] * 2, others
    assert others[OTHERS[2]][0] == 1 and errors_of(others[OTHERS[2]][1]) == [refusal], others
    errors = [line for line in (result.output + result.stderr).splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and errors == [refusal], result
    assert checkpoint.read_bytes() == mid_epoch  # refused before anything was trained or saved

    code, output = train_in_process("05_ddp_slurm", [*SYNTHETIC, "--batch-size", "16", "--epochs", "2",
                                                     "--checkpoint", str(end_of_epoch)], capsys)
    assert code == 0 and "at epoch 2 step 0" in output and "epoch 2/2 |" in output, output
    code, output = train_in_process("05_ddp_slurm", [*flags, "--batch-size", "64"], capsys)
    assert code == 0, output
    assert f"at epoch 2 step {run.step}" in output and output.count("epoch 2/2 |") == 1, output
    assert max_abs_diff(weights(checkpoint), weights(reference.epoch2)) <= TOLERANCE


OTHERS = ("01_single_gpu", "02_dataparallel", "03_ddp_mpspawn")  # 04 (torchrun) is started as a user would


def errors_of(output):
    return [line for line in output.splitlines() if line.startswith("error:")]


def copy(src, dst):
    Path(dst).write_bytes(Path(src).read_bytes())
    return Path(dst)


def test_06_local_preemption_requeues_and_resumes(cluster_env, ladder, tmp_path):
    """06 --local with a data-loader worker per loader, started by forkserver: SIGUSR2 to every process of rank 0's
    task and SIGTERM to rank 1's in epoch 2 stop both at one step inside the epoch, on SIGTERM, rank 0 saves, the tasks exit with the code that
    has submitit's local controller start them again, and they resume there and end like the ladder's
    uninterrupted run."""
    checkpoint, logs = tmp_path / "ckpt.pt", tmp_path / "logs"
    hold, held, _ = hold_env(tmp_path, STEPS_PER_EPOCH + HOLD)
    proc = subprocess.Popen(
        [sys.executable, "06_ddp_submitit/train.py", "--local", "--tasks-per-node", "2", "--log-dir", str(logs),
         *SYNTHETIC[:2], "--workers", "1", *batch_args("06_ddp_submitit"), "--epochs", "2",
         "--checkpoint", str(checkpoint)],
        cwd=REPO, env=cluster_env(TEST_START_METHOD="forkserver", **hold), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for(lambda: len(held()) == 2 or proc.poll() is not None, 120, "both ranks held", lambda: submitit_logs(logs))
    for rank, pid in held():  # rank 0's line must name rank 1's signal: the ranks agree on the highest
        signal_every_process([pid], (signal.SIGUSR2, signal.SIGTERM)[rank])
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"06 still running 120 s after the signal:\n{submitit_logs(logs)}")
    log = submitit_logs(logs)
    assert proc.returncode == 0, out + log
    stopped = STOPPED.search(log)
    assert stopped and stopped.group(2) == str(HOLD) and stopped.group(3) == "SIGTERM", log
    assert stopped.group(1) == "2" and f"exit code {REQUEUE_CODE}, to be requeued" in log, log
    assert f"at epoch 2 step {stopped.group(2)}" in log, log
    assert log.count("epoch 1/2 |") == 1 and log.count("epoch 2/2 |") == 1, log
    assert "killed by signal" not in log and "died unexpectedly" not in log, log
    resumed, uninterrupted = weights(checkpoint), weights(ladder("06_ddp_submitit").final)
    assert max_abs_diff(resumed, uninterrupted) <= TOLERANCE


def test_05_a_signal_during_evaluation_stops_the_job(cluster_env, reference, tmp_path, capsys):
    """Rank 1 signals itself during epoch 2's evaluation (at its 401st test sample, in its first batch of 100; 400
    per rank and epoch), under --accumulate 2; rank 0 gets nothing: the ranks' vote after that batch stops both
    there (a loss with a collective would find every rank in it), rank 0 saves the epoch as trained, both exit to
    be requeued; the resumed run (here in this process, 1 x 64: the same global batch)
    trains no step, evaluates, and prints epoch 2's line with the uninterrupted run's loss."""
    checkpoint, fetch_log = tmp_path / "ckpt.pt", tmp_path / "fetches.log"
    signal_on_rank_1 = lambda **kw: cluster_env(**kw, TEST_FETCH_LOG=str(fetch_log), **(  # noqa: E731
        {"TEST_SIGNAL_AT_FETCH": "800:401"} if kw["SLURM_PROCID"] == "1" else {}))
    # 2 x 16 x --accumulate 2: the global batch of TRAIN_05, in half as many samples per micro-batch; the saved step
    # counts optimizer steps (a count of micro-batches would resume past the epoch's end, as 2 x STEPS_PER_EPOCH).
    procs = start_05([*SYNTHETIC[:2], "--batch-size", str(GLOBAL_BATCH // 4), "--accumulate", "2", "--workers", "0",
                      "--epochs", "2", "--test-batch-size", "100", "--checkpoint", str(checkpoint)], signal_on_rank_1)
    codes, output = finish_all(procs, timeout=60)
    assert codes == [REQUEUE_CODE] * 2, output
    assert f"stopped at epoch 2 step {STEPS_PER_EPOCH} on SIGUSR2" in output and "epoch 2/2 |" not in output, output
    assert "epoch 1/2 |" in output, output
    assert cluster_env.requeues() == [], output
    fetched = [line.split()[:2] for line in fetch_log.read_text().splitlines()]
    test_samples = [sum(1 for r, size in fetched if (r, size) == (rank, "800")) for rank in ("0", "1")]
    # Two epochs' 400 each; both stop after their first batch of 100 (the loop has fetched the second).
    assert test_samples == [600, 600], test_samples

    code, output = train_in_process("05_ddp_slurm", [*SYNTHETIC, "--batch-size", "64", "--epochs", "2",
                                                     "--checkpoint", str(checkpoint)], capsys)
    assert code == 0, output
    assert f"at epoch 2 step {STEPS_PER_EPOCH}" in output, output
    [resumed] = [line for line in output.splitlines() if line.startswith("epoch 2/2 |")]
    [uninterrupted] = [line for line in reference.run2.output.splitlines() if line.startswith("epoch 2/2 |")]
    assert resumed.split("|")[1:3] == uninterrupted.split("|")[1:3], (resumed, uninterrupted)  # loss, accuracy
    assert max_abs_diff(weights(checkpoint), weights(reference.epoch2)) <= TOLERANCE


def test_05_without_a_checkpoint_a_stop_ends_the_run_and_asks_for_no_requeue(cluster_env, tmp_path):
    """Without --checkpoint there is nothing to resume from: SIGUSR2 (rank 1 signals itself at its 1000th
    training sample, of 1600 in the epoch) ends the run with one line that says so and exit code 1, so that
    submit.sh requeues nothing (a requeued job would start over) and the job ends as failed, not as a whole run."""
    signal_on_rank_1 = lambda **kw: cluster_env(**kw, **(  # noqa: E731
        {"TEST_SIGNAL_AT_FETCH": "3200:1000"} if kw["SLURM_PROCID"] == "1" else {}))
    procs = start_05([*TRAIN_05, "--workers", "0", "--epochs", "1"], signal_on_rank_1, cwds=[tmp_path] * 2)
    codes, output = finish_all(procs, timeout=60)
    assert codes == [1, 1], output
    stops = [line for line in output.splitlines() if line.startswith("stopped at")]
    assert len(stops) == 1 and re.fullmatch(r"stopped at epoch 1 step \d+ on SIGUSR2 [\d.]+ s after the signal was "
                                            r"seen, nothing saved: exit code 1, not requeued: no --checkpoint", stops[0]), output
    assert "epoch 1/1 |" not in output and cluster_env.requeues() == [], output
    assert not list(tmp_path.glob("*.pt")), list(tmp_path.iterdir())


@pytest.mark.parametrize("requeue_on_144", ["", "1"])
def test_05_stop_line_says_whether_anything_requeues(monkeypatch, capsys, tmp_path, requeue_on_144):
    """05 tried under torchrun, as its page suggests before a Slurm job, or started by hand with srun inside an
    allocation: a stop saves the step, and the stop line says that nothing requeues it and how to resume, where it
    said "exit code 144 to be requeued". submit.sh (and 06's launcher) export REQUEUE_ON_144=1: then it is."""
    monkeypatch.setattr(signal, "sigpending", lambda: {signal.SIGUSR2})  # as scancel --signal=USR2 sends it
    monkeypatch.setenv("REQUEUE_ON_144", requeue_on_144)
    code, output = train_in_process("05_ddp_slurm", [*SYNTHETIC, "--checkpoint", str(tmp_path / "ckpt.pt")], capsys)
    stops = [line for line in output.splitlines() if line.startswith("stopped")]
    outcome = "to be requeued" if requeue_on_144 else "started without submit.sh: the same command resumes"
    assert code == REQUEUE_CODE and len(stops) == 1 and re.fullmatch(
        r"stopped at epoch 1 step 0 on SIGUSR2 [\d.]+ s after the signal was seen, saved in [\d.]+ s: exit code 144, "
        + re.escape(outcome), stops[0]), output


def test_05_a_save_that_one_rank_finds_due_is_made_by_all(cluster_env, reference, tmp_path):
    """--save-every is a term of the ranks' vote: only rank 1's clock runs (4 s a step, TEST_STEP_CLOCK), rank 0's is
    the real one (a run of seconds: never due), and both save at rank 1's steps 15, 30 and 45 of --save-every 1
    (the clock starts again at each save); a vote on rank 0's clock alone would save nothing. The saves change
    nothing of the training: the run ends with the uninterrupted run's weights."""
    checkpoint = tmp_path / "ckpt.pt"
    clock_on_rank_1 = lambda **kw: cluster_env(**kw, TEST_STEP_CLOCK=STEP_CLOCK if kw["SLURM_PROCID"] == "1" else "")  # noqa: E731
    procs = start_05([*TRAIN_05, "--workers", "0", "--epochs", "1", "--save-every", "1", "--checkpoint",
                      str(checkpoint)], clock_on_rank_1)
    codes, output = finish_all(procs, timeout=60)
    assert codes == [0, 0], output
    saves = re.findall(r"^saved at epoch (\d+) step (\d+) \(--save-every 1\)$", output, re.M)
    assert saves == [("1", "15"), ("1", "30"), ("1", "45")], output
    assert max_abs_diff(weights(checkpoint), weights(reference.epoch1)) <= TOLERANCE
