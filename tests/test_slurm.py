"""Steps 05 and 06 on a real two-node Slurm cluster that tests/slurm_cluster.sh starts on this machine:
the user's own submit.sh and submitit's Slurm executor, on 1 node x 2 tasks and 2 nodes x 1 task,
preemption that requeues and resumes, Slurm's own time-limit warning, many time-outs in one submitit
job, two jobs at once on the same nodes, a rank that dies, and what accounting (sacct) records of each."""
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (REPO, SLURM_HIGH, SLURM_NODES, STEPS_PER_EPOCH, SYNTHETIC, TOLERANCE, Result, SharedRuns,
                      batch_args, child_env, max_abs_diff, read_line, submitit_logs, wait_for, weights)
from test_failures import ended_or_told_to
from test_preemption import SITECUSTOMIZE, hold_env

pytestmark = pytest.mark.slurm  # on this worker's own pair of nodes (conftest.py), beside the other workers
LAYOUTS = {"1x2": (1, 2), "2x1": (2, 1)}  # nodes x tasks per node
NODE_CPUS = 2  # what slurm_cluster.sh gives each node. Tasks are bound to cores, and both nodes share this
# machine's two, so a job asks for all of a node's cores (split among its tasks): 2 x 1 on one core would halve it.
# --workers left to the launchers (half a task's cores: one worker and one thread with 2 cores), so that a run
# that passes the same --workers has the same threads and the same weights to the last bit.
TRAIN_ARGS = [*SYNTHETIC[:2], *batch_args("05_ddp_slurm")]


# Records the cores of every training process and data-loader worker of a job (test_slurm_cores.py).
CORES_SITECUSTOMIZE = '''
import json, os, socket
def _record(kind):
    line = json.dumps(dict(kind=kind, host=socket.gethostname(), pid=os.getpid(), ppid=os.getppid(),
                           cores=sorted(os.sched_getaffinity(0)), omp=os.environ.get("OMP_NUM_THREADS")))
    with open(os.environ["TEST_CORES_LOG"], "a") as log:
        log.write(line + "\\n")  # one short write in append mode: lines of several processes do not mix
_loop = None
def _recorded_loop(*args, **kwargs):  # what each data-loader worker runs first; spawn and forkserver workers
    _record("worker")                 # find it by name here, and run the worker loop that they have
    import torch.utils.data._utils.worker as worker
    return (_loop or worker._worker_loop)(*args, **kwargs)
if os.environ.get("TEST_CORES_LOG"):
    with open("/proc/self/cmdline", "rb") as cmdline:
        cmd = " ".join(part.decode() for part in cmdline.read().split(b"\\0"))
    # A training process of a job step: 04's (not torchrun's agent) and 05's train.py, 06's task (submitit's _submit).
    if (os.environ.get("SLURM_STEP_ID") and ("train.py" in cmd or "submitit.core._submit" in cmd)
            and "torch.distributed.run" not in cmd):
        _record("trainer")
        import torch.utils.data._utils.worker as _worker
        _loop, _worker._worker_loop = _worker._worker_loop, _recorded_loop
'''


def cores_env(folder):
    """The job environment that records the cores of every training process and worker in folder/cores.log."""
    site = folder / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(CORES_SITECUSTOMIZE)
    return dict(PYTHONPATH=str(site), TEST_CORES_LOG=str(folder / "cores.log"))


def job_state(job_id):
    """What Slurm says of a job, for failure messages."""
    shown = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True)
    return shown.stdout + shown.stderr


def read(path):
    path = Path(path)
    return path.read_text() if path.exists() else ""


def squeue(job_id):
    states = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True)
    return states.stdout.strip()


def control(*cmd):
    """Runs a Slurm command (scancel, scontrol) that must succeed."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{' '.join(cmd)} failed: {done.stdout}{done.stderr}"


def sacct_runs(job_id):
    """The state of each run of a job, oldest first (a requeued job has one per start), from accounting."""
    done = subprocess.run(["sacct", "--duplicates", "--allocations", "--noheader", "--parsable2", "--format=State",
                           f"--jobs={job_id}"], capture_output=True, text=True, timeout=30)
    return done.stdout.splitlines() if done.returncode == 0 else [f"sacct failed: {done.stderr.strip()}"]


def accounted_runs(job_id):
    """sacct_runs once the database has the end of the last run (slurmctld sends it a moment after the end)."""
    def ended():
        states = sacct_runs(job_id)
        return states if states and states[-1] not in ("PENDING", "RUNNING", "REQUEUED") else None
    return wait_for(ended, 30, f"sacct to record the end of job {job_id}", lambda: "\n".join(sacct_runs(job_id)))


STOP_LINE = re.compile(r"^stopped at epoch (\d+) step (\d+) on SIG(?:USR2|TERM)", re.M)
RESUME_LINE = re.compile(r"^resumed from \S+ at epoch (\d+) step (\d+)$", re.M)


def stops_and_resumes(log):
    """Where each run stopped and where the next one resumed, both as (epochs done, step in the next)."""
    return ([(int(epoch) - 1, int(step)) for epoch, step in STOP_LINE.findall(log)],
            [(int(epoch) - 1, int(step)) for epoch, step in RESUME_LINE.findall(log)])


# --- 05: the user's own submit.sh, with only command-line and environment overrides for the CPU ---

def sbatch_05(tmp_path, nodes, tasks, train_args, wait=True, sbatch_args=(), env=None, cpus=None, cwd=REPO):
    """sbatch 05_ddp_slurm/submit.sh as a user would (from cwd, the project's root), overriding what a CPU-only
    cluster needs."""
    cmd = ["sbatch", "--parsable", f"--nodes={nodes}", f"--ntasks-per-node={tasks}", "--gpus-per-node=0",
           f"--cpus-per-task={cpus or NODE_CPUS // tasks}", "--time=10", f"--output={tmp_path}/%x-%j.out",
           *(["--wait"] if wait else []), *sbatch_args, "05_ddp_slurm/submit.sh", *train_args]
    return subprocess.Popen(cmd, cwd=cwd, env=child_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def job_id_of(proc):
    return int(read_line(proc, time.monotonic() + 60).strip())  # sbatch --parsable prints it first


def finish(proc, timeout):
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"sbatch --wait still waiting after {timeout} s")
    return proc.returncode


def check_job_log(log, nodes, tasks, epochs, pair=SLURM_NODES):
    """One epoch line per epoch; one launch line per rank, on the first nodes of the pair that ran the job (this
    worker's, or, for a shared run, that of the worker that made it); one rendezvous."""
    result = Result(0, log, "", 0)
    assert [int(e["epoch"]) for e in result.epochs()] == list(range(1, epochs + 1)), log
    launches = result.launches()  # (rank, world, local rank, host, pid, device, backend, addr, port)
    assert sorted(int(launch[0]) for launch in launches) == list(range(nodes * tasks)), log
    assert {launch[3] for launch in launches} == set(pair[:nodes]), log
    assert len({(launch[7], launch[8]) for launch in launches}) == 1 and launches[0][7] == pair[0], log
    return launches


@pytest.fixture(scope="session")
def submit_sh_runs(slurm, shared):
    """runs[layout]: two epochs without interruption, the twins of the interrupted jobs below, each made when a
    test first reads it (SharedRuns). The 2 x 1 job also records its processes' cores (test_slurm_cores.py)."""
    def compute(folder, layout):
        env = cores_env(folder) if layout == "2x1" else {}
        start = time.monotonic()
        proc = sbatch_05(folder, *LAYOUTS[layout], [*TRAIN_ARGS, "--epochs", "2", "--checkpoint",
                                                    f"{folder}/ckpt.pt"], env=env)
        job_id = job_id_of(proc)
        code = finish(proc, 180)
        return dict(code=code, job_id=job_id, log=read(f"{folder}/ddp-slurm-{job_id}.out"), pair=SLURM_NODES,
                    checkpoint=folder / "ckpt.pt", seconds=time.monotonic() - start,
                    cores_log=env.get("TEST_CORES_LOG"))
    return SharedRuns(shared, "submit-sh", compute, keys=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_submit_sh(submit_sh_runs, reference, layout):
    run = submit_sh_runs[layout]
    print(f"sbatch --wait 05_ddp_slurm/submit.sh on {layout}: {run['seconds']:.1f} s")
    assert run["code"] == 0, run["log"]
    launches = check_job_log(run["log"], *LAYOUTS[layout], epochs=2, pair=run["pair"])
    assert int(launches[0][8]) == 20000 + run["job_id"] % 12000  # where the search for a free port starts
    assert max_abs_diff(weights(run["checkpoint"]), weights(reference.epoch2)) <= TOLERANCE
    assert accounted_runs(run["job_id"]) == ["COMPLETED"]  # what the site's accounting keeps of it


def python_without_slurm(folder):
    """A `python` whose tasks find no Slurm command, as in a container image without a Slurm client: it runs
    this interpreter with nothing but its own folder on PATH."""
    wrapper = Path(folder) / "python-without-slurm"
    wrapper.write_text(f'#!/bin/sh\nPATH={Path(sys.executable).parent} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


# After a stop, rank 1 takes 6 s longer than rank 0 to exit (atexit), longer than the test cluster's KillWait (5 s),
# as a rank whose data-loader workers, NCCL or CUDA take a while to shut down would: srun must not end it early.
SLOW_EXIT = "1:6"


def start_methods_env(folder, methods):
    """The environment of a job whose data-loader workers start by methods (one per rank, "forkserver,spawn") and
    whose rank 1 is slow to exit."""
    return {**site_env(folder), "TEST_START_METHOD": methods, "TEST_SLOW_EXIT": SLOW_EXIT}


def site_env(folder):
    """PYTHONPATH to test_preemption's sitecustomize, which the TEST_ variables of a job's environment drive."""
    site = Path(folder) / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"PYTHONPATH": str(site)}


def run_seconds(job_id):
    """How long the job's current run has run, from scontrol (RunTime=[days-]HH:MM:SS)."""
    days, hours, minutes, seconds = re.search(r"RunTime=(?:(\d+)-)?(\d+):(\d+):(\d+)", job_state(job_id)).groups()
    return ((int(days or 0) * 24 + int(hours)) * 60 + int(minutes)) * 60 + int(seconds)


def scontrol_that_restores_the_time_limit(folder, minutes):
    """A folder with an `scontrol` for the batch script's PATH that, before it requeues the job, sets its time limit
    to minutes: the requeued run starts with that limit, whenever the test would have set it. (A preempted job
    refuses the update, "Job has already finished", and still takes the requeue.)"""
    shims = Path(folder) / "shims"
    shims.mkdir()
    scontrol = shutil.which("scontrol")
    (shims / "scontrol").write_text(f'#!/bin/bash\nif [ "$1" = requeue ]; then {scontrol} update JobId="$2" '
                                    f'TimeLimit={minutes}; fi\nexec {scontrol} "$@"\n')
    (shims / "scontrol").chmod(0o755)
    return shims


def high_job():
    """A job of this worker's partition high that needs all of both its nodes for 2 s: it preempts what runs
    there, the test's own job, and nothing of the other workers."""
    done = subprocess.run(["sbatch", "--parsable", f"--partition={SLURM_HIGH}", "--nodes=2", "--ntasks-per-node=1",
                           f"--cpus-per-task={NODE_CPUS}", "--time=5", "--output=/dev/null", "--wrap", "sleep 2"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def sacct_times(job_id):
    """(state, start, end) of each run of a job, oldest first, from accounting (ISO times sort as text)."""
    done = subprocess.run(["sacct", "--duplicates", "--allocations", "--noheader", "--parsable2",
                           "--format=State,Start,End", f"--jobs={job_id}"], capture_output=True, text=True, timeout=30)
    return [tuple(line.split("|")) for line in done.stdout.splitlines()]


def check_runs_between(low, high):
    """Accounting shows the high job between two runs of the preempted job."""
    [(high_state, high_start, high_end)] = sacct_times(high)
    runs = sacct_times(low)
    assert high_state == "COMPLETED" and any(
        first[2] <= high_start <= high_end <= second[1] for first, second in zip(runs, runs[1:])), runs + [high_start]


def test_submit_sh_through_a_time_limit_and_a_preemption(slurm, submit_sh_runs, reference, tmp_path):
    """One 05 job stopped twice, as sites stop jobs, whose tasks have no Slurm command on their PATH (PYTHON runs
    them so, as a container image without a Slurm client would), with a data-loader worker per loader, started by
    fork (Linux's default before Python 3.14) in rank 0 and by spawn in rank 1 (forkserver: the emulated 05 test):
    - Slurm's own warning before the time limit (submit.sh's --signal=USR2@120), inside epoch 2;
    - in the requeued run, a job of the partition high needs the nodes (PreemptMode=REQUEUE, GraceTime=30, no
      SIGUSR2 first): every process of the tasks gets SIGTERM; Slurm would not requeue a job that ends inside
      its grace time, so submit.sh (on the host) does.
    Each time all ranks stop at one step, rank 0 saves, the tasks exit for a requeue, submit.sh requeues the job,
    and it resumes at that step; it ends bit for bit as if never stopped, and accounting records each run.
    Each stop comes at a step the test chooses: every rank holds after epoch 2's step 10 in the first run and 5
    steps after its resume in the second (hold_env) until the signal reaches it. Slurm looks at time limits every
    30 s, so the test then brings the limit near: 60 to 120 s after the run's present age, within the warning's
    120 s lead, so that the warning comes at the next check and the limit after the stop. Before the batch script
    requeues the job, its scontrol sets the limit back to 10 minutes, so that no warning can reach the next run."""
    start = time.monotonic()
    hold, held, _ = hold_env(tmp_path, STEPS_PER_EPOCH + 10, 5)
    shims = scontrol_that_restores_the_time_limit(tmp_path, 10)
    env = {"PYTHON": str(python_without_slurm(tmp_path)), **start_methods_env(tmp_path, "fork,spawn"), **hold,
           "PATH": f"{shims}{os.pathsep}{child_env()['PATH']}"}
    proc = sbatch_05(tmp_path, 2, 1, [*TRAIN_ARGS, "--workers", "1", "--epochs", "2", "--log-interval", "5",
                                      "--checkpoint", f"{tmp_path}/ckpt.pt"], env=env)
    job_id = job_id_of(proc)
    log_path = tmp_path / f"ddp-slurm-{job_id}.out"
    details = lambda: f"--- job log\n{read(log_path)}\n--- scontrol\n{job_state(job_id)}"  # noqa: E731
    try:
        wait_for(lambda: len(held()) == 2, 120, "both ranks held in epoch 2", details)
        control("scontrol", "update", f"JobId={job_id}", f"TimeLimit={run_seconds(job_id) // 60 + 2}")
        wait_for(lambda: len(held()) == 4, 180, "Slurm's warning, the requeue and the next run's ranks held", details)
        high = high_job()
        assert finish(proc, 180) == 0, details()
    except BaseException:
        subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=30)  # no held job left behind
        raise
    log = read(log_path)
    restarts = [int(n) for n in re.findall(rf"^job {job_id} restart (\d+):", log, re.M)]
    stops, resumes = stops_and_resumes(log)
    print(f"05 through a time limit and a preemption: {time.monotonic() - start:.1f} s, restarts {restarts}, "
          f"stopped at (epochs done, step) {stops}")
    assert restarts == [0, 1, 2], log  # submit.sh's line, once per run
    assert log.count(f"job {job_id}: its tasks stopped and saved: requeueing it") == 2, log
    assert stops == [(1, 10), (1, 15)] and resumes == stops, log
    assert re.findall(r"^stopped at epoch 2 step \d+ on (SIG\w+) [\d.]+ s after the signal was seen, saved in", log, re.M) == [
        "SIGUSR2", "SIGTERM"], log
    assert log.count("epoch 1/2 |") == 1 and log.count("epoch 2/2 |") == 1, log
    assert "killed by signal" not in log and "Traceback" not in log, log  # no data-loader worker died of a signal
    resumed, uninterrupted = weights(tmp_path / "ckpt.pt"), weights(submit_sh_runs["2x1"]["checkpoint"])
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed), "not bit for bit"  # same layout
    assert max_abs_diff(resumed, weights(reference.epoch2)) <= TOLERANCE
    assert accounted_runs(job_id) == ["REQUEUED", "REQUEUED", "COMPLETED"]
    check_runs_between(job_id, high)


def test_two_jobs_at_once_do_not_collide(slurm, reference, tmp_path):
    """Two jobs share both nodes at the same time. Job b would start its search at the port that job a
    holds (as jobs 12000 ids apart would, or, before, 10000 apart): it takes the next free one."""
    for name in "ab":
        (tmp_path / name).mkdir()  # Slurm does not create the folder of --output
    args = {name: [*TRAIN_ARGS, "--epochs", "1", "--checkpoint", f"{tmp_path}/{name}.pt"] for name in "ab"}
    held_b = sbatch_05(tmp_path / "b", 2, 1, args["b"], sbatch_args=["--hold"], cpus=1)  # room for both jobs
    b_id = job_id_of(held_b)
    port = 20000 + b_id % 12000
    hold, held, release = hold_env(tmp_path, 10)  # job a's ranks wait at step 10 until b has its port
    b_log = f"{tmp_path}/b/ddp-slurm-{b_id}.out"
    try:
        first = sbatch_05(tmp_path / "a", 2, 1, args["a"], env={"MASTER_PORT": str(port), **site_env(tmp_path),
                                                                **hold}, cpus=1)
        a_id = job_id_of(first)
        wait_for(lambda: len(held()) == 2, 120, "job a held", lambda: job_state(a_id))
        subprocess.run(["scontrol", "release", str(b_id)])
        wait_for(lambda: "rank 1/2 " in read(b_log), 120, "job b's rendezvous", lambda: read(b_log))
        assert squeue(a_id) == squeue(b_id) == "RUNNING"  # together, a holding its port
    finally:
        release()
        subprocess.run(["scontrol", "release", str(b_id)])
    procs, job_ids = [first, held_b], [a_id, b_id]
    assert [finish(proc, 120) for proc in procs] == [0, 0]
    logs = [read(f"{tmp_path}/{name}/ddp-slurm-{job_id}.out") for name, job_id in zip("ab", job_ids)]
    ports = [int(check_job_log(log, 2, 1, epochs=1)[0][8]) for log in logs]
    assert ports == [port, 20000 + (b_id + 1) % 12000], logs
    for name in "ab":
        assert max_abs_diff(weights(f"{tmp_path}/{name}.pt"), weights(reference.epoch1)) <= TOLERANCE


def test_scancel_saves_the_step_and_a_new_job_resumes_there(slurm, submit_sh_runs, reference, tmp_path):
    """scancel of a running 05 job sends SIGTERM to its tasks and to submit.sh: the tasks stop and save the step
    they reached (within KillWait), but submit.sh ends at once and requeues nothing, so the job stays cancelled;
    a new job given that --checkpoint resumes at the step and ends bit for bit as if never stopped."""
    checkpoint = tmp_path / "ckpt.pt"
    (tmp_path / "first").mkdir()  # Slurm does not create the folder of --output
    hold, held, _ = hold_env(tmp_path, STEPS_PER_EPOCH + 10)  # each rank holds after epoch 2's step 10
    proc = sbatch_05(tmp_path / "first", 2, 1, [*TRAIN_ARGS, "--epochs", "2", "--log-interval", "5",
                                                "--checkpoint", str(checkpoint)], env={**site_env(tmp_path), **hold})
    job_id = job_id_of(proc)
    log_path = tmp_path / "first" / f"ddp-slurm-{job_id}.out"
    details = lambda: f"--- job log\n{read(log_path)}\n--- scontrol\n{job_state(job_id)}"  # noqa: E731
    wait_for(lambda: len(held()) == 2, 120, "both ranks held in epoch 2", details)
    control("scancel", str(job_id))
    finish(proc, 60)
    log = read(log_path)
    stops = stops_and_resumes(log)[0]
    assert stops == [(1, 10)] and "requeueing" not in log, log
    step = 10
    # The tasks cannot tell a scancel from a preemption: the line says "to be requeued", and nothing requeues it.
    assert re.search(r"^stopped at epoch 2 step \d+ on SIGTERM .*: exit code 144, to be requeued$", log, re.M), log
    assert [state.split()[0] for state in accounted_runs(job_id)] == ["CANCELLED"], accounted_runs(job_id)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert (saved["epoch"], saved["step"]) == (1, step)

    again = sbatch_05(tmp_path, 2, 1, [*TRAIN_ARGS, "--epochs", "2", "--checkpoint", str(checkpoint)])
    again_id = job_id_of(again)
    assert finish(again, 120) == 0, read(tmp_path / f"ddp-slurm-{again_id}.out")
    again_log = read(tmp_path / f"ddp-slurm-{again_id}.out")
    assert f"at epoch 2 step {step}" in again_log and again_log.count("epoch 2/2 |") == 1, again_log
    resumed, uninterrupted = weights(checkpoint), weights(submit_sh_runs["2x1"]["checkpoint"])
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)  # bit for bit, same layout


def test_a_job_killed_without_warning_resumes_at_its_last_periodic_save(slurm, submit_sh_runs, reference, tmp_path):
    """No signal at all (a node fails, an out-of-memory kill): with --save-every, rank 0 saves inside the epoch
    every so often; SIGKILL to both tasks mid-epoch fails the job (sacct FAILED), and a new job with that
    --checkpoint resumes at the last save and ends bit for bit as if never stopped. On the test's step clock
    (hold_env: 4 s a step), --save-every 1 saves every 15 steps; the ranks are killed while held after epoch 2's
    step 20."""
    checkpoint = tmp_path / "ckpt.pt"
    hold, held, _ = hold_env(tmp_path, STEPS_PER_EPOCH + 20)
    proc = sbatch_05(tmp_path, 2, 1, [*TRAIN_ARGS, "--epochs", "2", "--save-every", "1", "--checkpoint",
                                      str(checkpoint)], env={**site_env(tmp_path), **hold})
    job_id = job_id_of(proc)
    log_path = tmp_path / f"ddp-slurm-{job_id}.out"
    details = lambda: f"--- job log\n{read(log_path)}\n--- scontrol\n{job_state(job_id)}"  # noqa: E731
    wait_for(lambda: len(held()) == 2, 120, "both ranks held in epoch 2", details)
    for _, pid in held():
        os.kill(pid, signal.SIGKILL)
    assert finish(proc, 60) != 0, details()
    log = read(log_path)
    saves = re.findall(r"^saved at epoch (\d+) step (\d+) \(--save-every 1\)$", log, re.M)
    assert saves == [("1", "15"), ("1", "30"), ("1", "45"), ("2", "15")], log
    assert "epoch 2/2 |" not in log and "stopped at" not in log, log
    assert accounted_runs(job_id) == ["FAILED"]
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    last = 15
    assert (saved["epoch"], saved["step"]) == (1, last), log

    again = sbatch_05(tmp_path, 2, 1, [*TRAIN_ARGS, "--epochs", "2", "--checkpoint", str(checkpoint)])
    again_id = job_id_of(again)
    assert finish(again, 120) == 0, read(tmp_path / f"ddp-slurm-{again_id}.out")
    assert f"at epoch 2 step {last}" in read(tmp_path / f"ddp-slurm-{again_id}.out")
    resumed, uninterrupted = weights(checkpoint), weights(submit_sh_runs["2x1"]["checkpoint"])
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)  # bit for bit, same layout


# --- 06: submitit's Slurm executor ---

def launch_06(log_dir, nodes, tasks, train_args, env=None, cores=None):
    """06 on the test cluster's CPUs, each task on NODE_CPUS // tasks cores: --cpus-per-task, or cores (say, --sbatch
    exclusive) that make Slurm give them."""
    cmd = [sys.executable, "06_ddp_submitit/train.py", "--nodes", str(nodes), "--tasks-per-node", str(tasks),
           "--gpus-per-node", "0", *(cores or ["--cpus-per-task", str(NODE_CPUS // tasks)]), "--timeout-min", "10",
           "--log-dir", str(log_dir), *train_args]
    return subprocess.Popen(cmd, cwd=REPO, env=child_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.fixture(scope="session")
def submitit_runs(slurm, shared):
    """runs[layout]: two epochs without interruption, made when a test first reads it (SharedRuns); the 2 x 1 job
    also records its processes' cores, and takes them as Slurm gives them (--sbatch exclusive: a whole node, without
    --cpus-per-task)."""
    def compute(folder, layout):
        env = cores_env(folder) if layout == "2x1" else {}
        start = time.monotonic()
        proc = launch_06(folder / "logs", *LAYOUTS[layout], [*TRAIN_ARGS, "--epochs", "2",
                                                             "--checkpoint", f"{folder}/ckpt.pt"], env=env,
                         cores=["--sbatch", "exclusive"] if layout == "2x1" else None)
        code = finish(proc, 180)
        return dict(code=code, out=proc.stdout.read(), err=proc.stderr.read(), log=submitit_logs(folder / "logs"),
                    pair=SLURM_NODES,
                    checkpoint=folder / "ckpt.pt", seconds=time.monotonic() - start,
                    cores_log=env.get("TEST_CORES_LOG"))
    return SharedRuns(shared, "submitit", compute, keys=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_submitit_on_slurm(submitit_runs, reference, layout):
    run = submitit_runs[layout]
    print(f"06 through submitit's Slurm executor on {layout}: {run['seconds']:.1f} s")
    assert run["code"] == 0, run["out"] + run["log"]
    job_id = int(re.search(r"^submitted job (\d+); logs in \S+", run["out"], re.M).group(1))
    launches = check_job_log(run["log"], *LAYOUTS[layout], epochs=2, pair=run["pair"])
    # submitit's own port, drawn from the job id (TorchDistributedEnvironment): no search of ours
    assert int(launches[0][8]) == random.Random(str(job_id)).randint(20000, 60000)
    assert max_abs_diff(weights(run["checkpoint"]), weights(reference.epoch2)) <= TOLERANCE
    assert "sacct error" not in run["err"], run["err"]  # submitit's state polling worked: no guessing


TIMEOUTS = 3  # time-limit stops after the preemption: four stops, more than submitit's own requeue allows (3)


def test_submitit_through_a_preemption_and_many_timeouts(slurm, submitit_runs, reference, tmp_path):
    """One 06 job stopped again and again, with a data-loader worker per loader (forkserver in rank 0, fork in
    rank 1): first a job of the partition high preempts it inside epoch 2 (SIGTERM to every process of its tasks),
    then its time limit stops it TIMEOUTS times (SIGUSR2, as Slurm's warning sends it). Every rank holds after epoch
    2's step 10 in the first run and 5 steps after its resume in the others (hold_env) until the signal reaches it.
    Each time all ranks stop at that step, rank 0 saves, and the batch script's last line requeues the job, with
    no cap; the launcher waits through every requeue and exits 0, and the job ends bit for bit as if never
    stopped."""
    start = time.monotonic()
    hold, held, _ = hold_env(tmp_path, STEPS_PER_EPOCH + 10, *[5] * TIMEOUTS)
    proc = launch_06(tmp_path / "logs", 2, 1, [*TRAIN_ARGS, "--workers", "1", "--epochs", "2", "--log-interval", "5",
                                               "--checkpoint", f"{tmp_path}/ckpt.pt"],
                     env={**start_methods_env(tmp_path, "forkserver,fork"), **hold})
    deadline = time.monotonic() + 60
    job_id = wait_for(lambda: re.search(r"submitted job (\d+)", read_line(proc, deadline)), 60, "submission").group(1)
    rank0_log = lambda: read(next(iter((tmp_path / "logs").glob(f"*/{job_id}_0_log.out")), "/nonexistent"))
    details = lambda: (f"--- task logs\n{submitit_logs(tmp_path / 'logs')}\n--- launcher exit\n{proc.poll()}\n"
                       f"--- scontrol\n{job_state(job_id)}")

    def holding(runs):
        if proc.poll() is not None:
            pytest.fail(f"the launcher ended before run {runs} held: {proc.stderr.read()}\n{details()}")
        return len(held()) == 2 * runs

    try:
        for run in range(1, 2 + TIMEOUTS):
            wait_for(lambda: holding(run), 120, f"run {run}'s ranks held", details)
            if run == 1:
                high = high_job()
            else:  # a time limit
                control("scancel", "--signal=USR2", job_id)
        assert finish(proc, 180) == 0, details()
    except BaseException:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)  # no job left behind
        raise
    log, err = rank0_log(), proc.stderr.read()
    stops, resumes = stops_and_resumes(log)
    print(f"06 through a preemption and {TIMEOUTS} time-outs: {time.monotonic() - start:.1f} s, stopped at "
          f"(epochs done, step) {stops}")
    assert stops == [(1, 10 + 5 * k) for k in range(1 + TIMEOUTS)] and resumes == stops, log
    signals = re.findall(r"^stopped at epoch \d+ step \d+ on (SIG\w+) [\d.]+ s after", log, re.M)
    assert signals == ["SIGTERM"] + ["SIGUSR2"] * TIMEOUTS, log
    assert log.count("epoch 1/2 |") == 1 and log.count("epoch 2/2 |") == 1, log
    assert "killed by signal" not in log and "Traceback" not in log, log  # no data-loader worker died of a signal
    resumed_weights, uninterrupted = weights(f"{tmp_path}/ckpt.pt"), weights(submitit_runs["2x1"]["checkpoint"])
    assert all(torch.equal(resumed_weights[k], uninterrupted[k]) for k in resumed_weights)  # bit for bit
    assert max_abs_diff(resumed_weights, weights(reference.epoch2)) <= TOLERANCE
    assert accounted_runs(job_id) == ["REQUEUED"] * (1 + TIMEOUTS) + ["COMPLETED"]
    check_runs_between(job_id, high)
    assert "sacct error" not in err, err


@pytest.mark.parametrize("method", ["forkserver"])
def test_submitit_requeue_survives_a_slow_controller(slurm, reference, tmp_path, method):
    """A busy slurmctld can have the job's processes sent SIGTERM for the requeue before the `scontrol
    requeue` that asked for it returns. submitit's own requeue ran in the task and failed then, writing an
    error result: with one task the launcher took it for the job's end and failed while the requeued job
    trained on. 06 requeues from the batch script, after its tasks have ended: a scontrol that lingers 1 s
    after the requeue (under the cluster's KillWait of 5 s) dies of that SIGTERM with the script, and the
    launcher still waits for the requeued job, which ends with 01's weights."""
    shims, site = tmp_path / "bin", tmp_path / "site"
    shims.mkdir()
    site.mkdir()
    (shims / "scontrol").write_text(f'#!/bin/bash\n{shutil.which("scontrol")} "$@"\nstatus=$?\n'
                                    '[ "$1" = requeue ] && sleep 1\nexit $status\n')
    (shims / "scontrol").chmod(0o755)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    hold, held, _ = hold_env(tmp_path, 10)  # the task holds after step 10 until the signal reaches it
    proc = launch_06(tmp_path / "logs", 1, 1, [*SYNTHETIC[:2], "--workers", "1", *batch_args("01_single_gpu"),
                                               "--epochs", "2", "--checkpoint", f"{tmp_path}/ckpt.pt"],
                     env=dict(PATH=f"{shims}{os.pathsep}{child_env()['PATH']}", PYTHONPATH=str(site),
                              TEST_START_METHOD=method, **hold))
    deadline = time.monotonic() + 60
    job_id = wait_for(lambda: re.search(r"submitted job (\d+)", read_line(proc, deadline)), 60, "submission").group(1)
    rank0_log = lambda: read(next(iter((tmp_path / "logs").glob(f"*/{job_id}_0_log.out")), "/nonexistent"))
    details = lambda: f"--- task log\n{rank0_log()}\n--- launcher exit\n{proc.poll()}\n--- scontrol\n{job_state(job_id)}"
    try:
        wait_for(lambda: held(), 120, "the rank held at step 10", details)
        control("scancel", "--signal=USR2", job_id)
        out, err = proc.communicate(timeout=180)
    except BaseException:
        proc.kill()
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)  # no job left behind
        raise
    log = rank0_log()
    assert proc.returncode == 0 and f"job {job_id} finished" in out, out + err + details()
    assert "triggered an exception" not in log, log  # the job never failed
    stops, resumes = stops_and_resumes(log)
    assert stops == [(0, 10)] and resumes == stops and log.count("epoch 2/2 |") == 1, log
    assert max_abs_diff(weights(f"{tmp_path}/ckpt.pt"), weights(reference.epoch2)) <= TOLERANCE
    assert accounted_runs(job_id) == ["REQUEUED", "COMPLETED"]


# --- a rank that dies: srun --wait ends the others soon after (05's submit.sh, and 06's job) ---

def stop_rank0_kill_rank1(log_of, what):
    """Once epoch 1 is done: SIGSTOP to rank 0, so that it cannot fail by itself (Gloo would fail it at once),
    and SIGKILL to rank 1. Returns how long it took until rank 0 had ended or been sent SIGTERM/SIGKILL."""
    wait_for(lambda: "epoch 1/50 |" in log_of(), 120, f"{what}: epoch 1", log_of)
    pids = {rank: int(pid) for rank, _, _, _, pid, *_ in Result(0, log_of(), "", 0).launches()}
    os.kill(pids["0"], signal.SIGSTOP)
    os.kill(pids["1"], signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: ended_or_told_to(pids["0"]), 60, f"{what}: srun to end the stopped rank 0", log_of)
    ended_in = time.monotonic() - killed
    print(f"{what}: srun ended the stopped rank 0 {ended_in:.1f} s after rank 1 died")
    return ended_in


def test_submit_sh_ends_the_job_when_a_rank_dies(slurm, tmp_path):
    proc = sbatch_05(tmp_path, 2, 1, [*TRAIN_ARGS, "--epochs", "50", "--checkpoint", f"{tmp_path}/ckpt.pt"])
    job_id = job_id_of(proc)
    try:
        stop_rank0_kill_rank1(lambda: read(tmp_path / f"ddp-slurm-{job_id}.out"), "05")
        assert finish(proc, 60) != 0
    finally:
        subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=30)
    assert accounted_runs(job_id) == ["FAILED"]


def test_submitit_job_ends_when_a_rank_dies(slurm, tmp_path):
    proc = launch_06(tmp_path / "logs", 2, 1, [*TRAIN_ARGS, "--epochs", "50"])
    job_id = int(re.search(r"submitted job (\d+)", read_line(proc, time.monotonic() + 60)).group(1))
    try:
        stop_rank0_kill_rank1(lambda: submitit_logs(tmp_path / "logs"), "06")
        out, err = proc.communicate(timeout=180)  # submitit polls sacct, then waits for a result file
    finally:
        proc.kill()
        subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=30)  # no stopped rank left behind
    assert proc.returncode != 0, out + err
    assert accounted_runs(job_id) == ["FAILED"]
