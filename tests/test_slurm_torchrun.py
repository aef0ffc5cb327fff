"""Step 04 on the two-node Slurm cluster of tests/slurm_cluster.sh: the unchanged 04_ddp_torchrun/submit.sh
through sbatch, one torchrun per node and two processes under each as shipped; a worker killed mid-run, a job
requeued mid-run, and two jobs at once whose ports would collide by their job ids, with one process under each
torchrun (NPROC_PER_NODE=1): what they prove is between nodes, and a second process a node only costs."""
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import (GLOBAL_BATCH, REPO, SLURM_NODES, STAND_INS, STEPS_PER_EPOCH, SYNTHETIC, TOLERANCE, Result,
                      SharedRuns, child_env, max_abs_diff, wait_for, weights)
from test_preemption import hold_env
from test_slurm import job_id_of, job_state, read, site_env, squeue

pytestmark = pytest.mark.slurm  # on this worker's own pair of nodes (conftest.py)
NODES, NPROC = 2, 2  # what submit.sh gives a CPU node: two processes
TRAIN_ARGS = [*SYNTHETIC, "--batch-size", str(GLOBAL_BATCH // (NODES * NPROC))]
# The interrupted and colliding jobs: one process a node, with the global batch's half, and no data-loader
# worker (submit.sh would give it one of the task's two cores).
ONE_A_NODE = {"NPROC_PER_NODE": "1"}
ONE_A_NODE_ARGS = [*SYNTHETIC, "--batch-size", str(GLOBAL_BATCH // NODES), "--workers", "0"]
RENDEZVOUS = re.compile(r"^job (\d+) restart (\d+): .* rendezvous (\S+):(\d+)$", re.M)


class Job:
    """sbatch --wait 04_ddp_torchrun/submit.sh with CPU overrides on the command line only."""

    def __init__(self, folder, train_args, cpus=2, env=None, sbatch_args=()):
        folder.mkdir(parents=True, exist_ok=True)  # Slurm does not create the folder of --output
        cmd = ["sbatch", "--parsable", "--wait", "--gpus-per-node=0", f"--cpus-per-task={cpus}", "--time=10",
               f"--output={folder}/%x-%j.out", *sbatch_args, "04_ddp_torchrun/submit.sh", *train_args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(**(env or {})), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.id = job_id_of(self.proc)
        self.log_path = folder / f"ddp-torchrun-{self.id}.out"

    def log(self):
        return read(self.log_path)

    def details(self):
        return f"--- job log\n{self.log()}\n--- scontrol\n{job_state(self.id)}"

    def wait_log(self, pattern, timeout, what):
        """Waits until the job log matches pattern (a string or a regex); returns the match."""
        find = pattern.search if hasattr(pattern, "search") else lambda text: pattern in text
        return wait_for(lambda: find(self.log()), timeout, what, self.details)

    def finish(self, timeout):
        """sbatch --wait's exit status; a job still running after timeout is cancelled and the test fails."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            subprocess.run(["scancel", str(self.id)])
            self.proc.kill()
            pytest.fail(f"job {self.id} still running after {timeout} s\n{self.details()}")
        return self.proc.returncode


def rounds(log, nproc=NPROC):
    """The launch lines in groups of one rendezvous round (NODES x nproc lines), in order."""
    launches = Result(0, log, "", 0).launches()  # (rank, world, local rank, host, pid, device, backend, addr, port)
    return [launches[i:i + NODES * nproc] for i in range(0, len(launches), NODES * nproc)]


def check_round(launches, log, pair=SLURM_NODES, nproc=NPROC):
    """Ranks 0 to NODES x nproc - 1 once each, nproc per node (of the pair that ran the job) with local ranks
    0 to nproc - 1, one master address for all."""
    assert sorted(int(launch[0]) for launch in launches) == list(range(NODES * nproc)), log
    assert {int(launch[1]) for launch in launches} == {NODES * nproc}, log
    for host in pair:
        assert sorted(int(launch[2]) for launch in launches if launch[3] == host) == list(range(nproc)), log
    assert len({(launch[7], launch[8]) for launch in launches}) == 1, log


def epoch_lines(log):
    return [int(e["epoch"]) for e in Result(0, log, "", 0).epochs()]


def check_weights(checkpoint, uninterrupted, reference, what):
    """Within TOLERANCE of the uninterrupted run (torchrun_run, which must have ended well) and of 01. Not bit for
    bit: the interrupted jobs run one process a node (2 ranks), the uninterrupted one two (4 ranks), and sums
    over another number of ranks round differently. (With four ranks a resumed run also ended about 1e-7 away from an
    uninterrupted one of the same layout: probably the order of the allreduce's additions, which follows a
    gradient's place in DDP's bucket, and DDP orders the bucket anew after a new process's first step.)"""
    assert uninterrupted["code"] == 0, f"the uninterrupted run failed:\n{uninterrupted['details']}"
    resumed = weights(checkpoint)
    diffs = max_abs_diff(resumed, weights(uninterrupted["checkpoint"])), max_abs_diff(resumed, weights(reference))
    print(f"{what}: max abs diff {diffs[0]:.2e} to the uninterrupted run, {diffs[1]:.2e} to 01")
    assert max(diffs) <= TOLERANCE


@pytest.fixture(scope="session")
def torchrun_run(slurm, shared):
    """2 nodes x 2 processes, two epochs without interruption: the reference of the other tests here, made once
    for the whole session when a test first reads it (SharedRuns). Beside the test cluster's stand-in GPU device
    files, as a CPU job on GPU nodes (test_slurm_gpus.py reads its log)."""
    def compute(folder):
        start = time.monotonic()
        env = {"GPU_DEVICES": STAND_INS}
        job = Job(folder, [*TRAIN_ARGS, "--epochs", "2", "--checkpoint", f"{folder}/ckpt.pt"], env=env)
        code = job.finish(180)
        return dict(code=code, job_id=job.id, details=job.details(), log=job.log(), checkpoint=folder / "ckpt.pt",
                    seconds=time.monotonic() - start, pair=SLURM_NODES,  # the nodes of the worker that made it
                    gpu_devices=env.get("GPU_DEVICES"))
    return SharedRuns(shared, "torchrun-2x2", compute)


def test_submit_sh_one_torchrun_per_node(torchrun_run, reference):
    """Four ranks over n1 and n2 from one c10d rendezvous on the first node; the weights of 01 at the same
    global batch."""
    run = {key: torchrun_run[key] for key in ("code", "job_id", "details", "log", "checkpoint", "seconds", "pair")}
    log = run["log"]
    assert run["code"] == 0, run["details"]
    (launches,) = rounds(log)  # one round: no restart
    check_round(launches, log, run["pair"])
    job_id, restart, host, port = RENDEZVOUS.search(log).groups()
    assert (int(job_id), restart, host) == (run["job_id"], "0", run["pair"][0]), log
    assert 20000 <= int(port) < 32000, log
    assert launches[0][7] == run["pair"][0], log  # node rank 0, and so the workers' master, is on the first node
    assert epoch_lines(log) == [1, 2], log
    diff = max_abs_diff(weights(run["checkpoint"]), weights(reference.epoch2))
    print(f"04 submit.sh on 2 nodes x 2 processes: {run['seconds']:.1f} s, max abs diff to 01: {diff:.2e}")
    assert diff <= TOLERANCE


def test_more_than_one_task_per_node_is_refused(slurm, tmp_path):
    """--ntasks-per-node=2, as 05 wants it, would start two torchruns per node: the job says why in one line
    and starts nothing."""
    job = Job(tmp_path, TRAIN_ARGS, cpus=1, sbatch_args=["--ntasks-per-node=2"])
    assert job.finish(60) != 0, job.details()
    log = job.log()
    assert log.startswith("error: 4 tasks on 2 nodes: ") and log.count("\n") == 1, log


def interrupt_in_epoch_2(folder, interrupt):
    """Submits a 2-epoch job whose workers hold after epoch 2's step 10 (hold_env), runs interrupt(job, log) then,
    and returns the job. The restarted or requeued workers hold nowhere: they have held once already."""
    hold, held, _ = hold_env(folder, STEPS_PER_EPOCH + 10)
    job = Job(folder, [*ONE_A_NODE_ARGS, "--epochs", "2", "--checkpoint", f"{folder}/ckpt.pt"],
              env={**site_env(folder), **hold, **ONE_A_NODE})
    wait_for(lambda: len(held()) == NODES, 120, "every worker held in epoch 2", job.details)
    interrupt(job, job.log())
    return job


def test_killed_worker_restarts_the_round_on_both_nodes(slurm, torchrun_run, reference, tmp_path):
    """SIGKILL to the worker on n2 in epoch 2: torchrun restarts the workers of both nodes in a new round,
    which resumes after epoch 1 and ends with the weights of the uninterrupted run."""
    killed = {}

    def kill_rank_1(job, log):
        (launches,) = rounds(log, nproc=1)
        rank1 = next(launch for launch in launches if launch[0] == "1")
        killed.update(host=rank1[3], pid=int(rank1[4]))
        os.kill(killed["pid"], signal.SIGKILL)  # pids are global on this machine, namespaces or not

    start = time.monotonic()
    job = interrupt_in_epoch_2(tmp_path, kill_rank_1)
    assert job.finish(180) == 0, job.details()
    log = job.log()
    print(f"04 worker killed and restarted: {time.monotonic() - start:.1f} s")
    assert killed["host"] == SLURM_NODES[1], log
    first, second = rounds(log, nproc=1)  # exactly two rounds: the first one and its restart
    check_round(first, log, nproc=1)
    check_round(second, log, nproc=1)
    # Every worker is new in the second round, those on n1 too, whose processes had not failed.
    assert not {launch[4] for launch in first} & {launch[4] for launch in second}, log
    assert "restart 1:" not in log, log  # torchrun restarted, not Slurm
    assert log.count("resumed from") == 1 and f"resumed from {job.log_path.parent}/ckpt.pt after epoch 1" in log, log
    assert log.count("epoch 1/2 |") == 1 and log.count("epoch 2/2 |") == 1, log
    check_weights(job.log_path.parent / "ckpt.pt", torchrun_run, reference.epoch2, "restarted")


def test_requeued_job_resumes_from_the_last_epoch(slurm, torchrun_run, reference, tmp_path):
    """`scontrol requeue` in epoch 2 (what a site that preempts by requeueing does): Slurm sends SIGTERM, each
    torchrun passes it on and exits without restarting, and the job, requeued under the same id, resumes
    after epoch 1, so epoch 2 is done again from its start, and ends with the uninterrupted run's weights."""
    requeued = {}

    def requeue(job, _):
        # Incomplete: only while the job runs; a job that has just ended is not run again.
        subprocess.run(["scontrol", "requeue", "Incomplete", str(job.id)], check=True)
        requeued["at"] = time.monotonic()

    job = interrupt_in_epoch_2(tmp_path, requeue)
    job.wait_log("resumed from", 120, "the requeued job to resume")
    requeue_to_resume = time.monotonic() - requeued["at"]
    assert job.finish(120) == 0, job.details()
    log = job.log()
    print(f"04 requeue to resume: {requeue_to_resume:.1f} s")
    before, after = re.split(r"^job \d+ restart 1: .*$", log, flags=re.M)  # the requeued job's first line
    # Before: one round, stopped by SIGTERM in each torchrun (no restart of its own) before epoch 2 ended.
    (first,) = rounds(before, nproc=1)
    check_round(first, log, nproc=1)
    assert before.count("death signal, shutting down workers") == NODES, log
    assert epoch_lines(before) == [1], log
    # After: the same job id, one new round that resumes after epoch 1 and does epoch 2.
    (second,) = rounds(after, nproc=1)
    check_round(second, log, nproc=1)
    assert f"resumed from {job.log_path.parent}/ckpt.pt after epoch 1" in after, log
    assert epoch_lines(after) == [2], log
    check_weights(job.log_path.parent / "ckpt.pt", torchrun_run, reference.epoch2, "requeued")


def test_two_jobs_at_once_do_not_collide(slurm, reference, tmp_path):
    """Job b would start at the port that job a holds (as jobs 12000 ids apart would): b takes the next free
    one. Both run at once on both nodes (1 CPU per node each) and both end with the right weights."""
    start = time.monotonic()
    b = Job(tmp_path / "b", [*ONE_A_NODE_ARGS, "--epochs", "1", "--checkpoint", f"{tmp_path}/b.pt"], cpus=1,
            env=ONE_A_NODE, sbatch_args=["--hold"])  # held until a's rendezvous is up
    port, next_port = (20000 + (b.id + i) % 12000 for i in (0, 1))  # where submit.sh starts looking for b
    hold, held, release = hold_env(tmp_path, 10)  # job a's workers wait at step 10 until b has its port
    try:
        a = Job(tmp_path / "a", [*ONE_A_NODE_ARGS, "--epochs", "1", "--checkpoint", f"{tmp_path}/a.pt"], cpus=1,
                env={"RDZV_PORT": str(port), **site_env(tmp_path), **hold, **ONE_A_NODE})
        wait_for(lambda: len(held()) == NODES, 120, "job a held", a.details)  # its store holds the port
        subprocess.run(["scontrol", "release", str(b.id)], check=True)
        b.wait_log(re.compile(r"^rank 1/2 ", re.M), 120, "job b's rendezvous")
        assert squeue(a.id) == squeue(b.id) == "RUNNING", a.details() + b.details()  # together
    except BaseException:
        subprocess.run(["scancel", str(b.id)])
        raise
    finally:
        release()
    codes = [a.finish(180), b.finish(180)]
    logs = {"a": a.log(), "b": b.log()}
    assert codes == [0, 0], logs
    ports = {name: int(RENDEZVOUS.search(log).group(4)) for name, log in logs.items()}
    assert ports == {"a": port, "b": next_port}, logs
    for name, log in logs.items():
        (launches,) = rounds(log, nproc=1)
        check_round(launches, log, nproc=1)
        assert max_abs_diff(weights(f"{tmp_path}/{name}.pt"), weights(reference.epoch1)) <= TOLERANCE
    print(f"04 two jobs at once: {time.monotonic() - start:.1f} s, ports {ports}")
