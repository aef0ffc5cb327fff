"""Each task gets the cores it asked for, and its threads plus its data-loader workers fit in them, on the
test cluster with CPU binding on (task/affinity), for 04's and 05's submit.sh and 06's generated job.

Slurm 22.05 (Debian 12's) is the first version whose srun does not take --cpus-per-task from sbatch, so the
scripts pass it again. With two cores a node this cluster cannot show the difference (one task a node gets
the node's cores with or without it), but it shows the split: the old scripts ran OMP_NUM_THREADS=2 plus
the workers on two cores. A sitecustomize on PYTHONPATH records, in every training process of the job, the
cores it may run on (its affinity) and OMP_NUM_THREADS, and the same in every data-loader worker as it starts
its loop (workers started by fork, Linux's default before Python 3.14, run no sitecustomize of their own).
The cases without --workers read the jobs of test_slurm.py's uninterrupted runs (05 and 06 on 2 nodes x 1
task), which run with this sitecustomize."""
import json
import re
import subprocess

import pytest

from conftest import REPO, SLURM_NODES, TOLERANCE, max_abs_diff, weights
from test_slurm import (CORES_SITECUSTOMIZE, cores_env, finish, job_id_of, launch_06, read, sbatch_05,  # noqa: F401
                        submit_sh_runs, submitit_runs)  # (the runs: fixtures)
from test_slurm_gpus import sbatch as sbatch_gpus, without_cpus_per_task
from test_slurm_torchrun import Job

pytestmark = pytest.mark.slurm  # on this worker's own pair of nodes (conftest.py)
CPUS = 2  # per task, all the cores a node of the test cluster has
TRAIN_ARGS = ["--dataset", "synthetic", "--batch-size", "32", "--epochs", "1"]  # --workers: the script's choice
def trainers_and_workers(log_path):
    """The training processes, each with the data-loader workers it started."""
    records = [json.loads(line) for line in read(log_path).splitlines()]
    trainers = [r for r in records if r["kind"] == "trainer"]
    for trainer in trainers:
        trainer["workers"] = [r for r in records if r["kind"] == "worker" and r["ppid"] == trainer["pid"]]
    return trainers


def check(trainers, count, workers_per_loader, log):
    """count training processes on two nodes; each may run on CPUS cores, and its threads and its workers
    fit in them (counted per loader: the training and the evaluation loaders' workers take turns). Without
    --workers a loader has CPUS // 2 workers; with it, that many, and the threads shrink or grow to match."""
    summary = [(t["host"], t["cores"], t["omp"], len(t["workers"])) for t in trainers]
    print(f"training processes (host, cores, OMP_NUM_THREADS, workers): {summary}")
    assert len(trainers) == count and len({t["host"] for t in trainers}) == 2, (summary, log)
    for trainer in trainers:
        assert len(trainer["cores"]) == CPUS, (summary, log)  # the task's cores (here also without srun -c)
        assert len(trainer["workers"]) == 2 * workers_per_loader, (summary, log)
        assert int(trainer["omp"]) == max(1, CPUS - workers_per_loader), (summary, log)  # nothing runs on top
        assert all(worker["cores"] == trainer["cores"] for worker in trainer["workers"]), (summary, log)


WORKERS = {"default": ([], 1), "--workers 0": (["--workers", "0"], 0), "--workers=2": (["--workers=2"], 2)}


def test_submit_sh_05_fits_threads_and_workers_in_the_task_cores(submit_sh_runs):
    """Without --workers: the uninterrupted 05 job on 2 nodes x 1 task of test_slurm.py."""
    run = submit_sh_runs["2x1"]
    check(trainers_and_workers(run["cores_log"]), 2, WORKERS["default"][1], run["log"])


def test_submit_sh_05_honours_an_explicit_workers(slurm, reference, tmp_path):
    flags, per_loader = WORKERS["--workers=2"]
    env = cores_env(tmp_path)
    proc = sbatch_05(tmp_path, 2, 1, [*TRAIN_ARGS, *flags, "--checkpoint", f"{tmp_path}/ckpt.pt"],
                     sbatch_args=[f"--cpus-per-task={CPUS}"], env=env)
    job_id = job_id_of(proc)
    assert finish(proc, 180) == 0
    log = read(tmp_path / f"ddp-slurm-{job_id}.out")
    check(trainers_and_workers(env["TEST_CORES_LOG"]), 2, per_loader, log)
    assert max_abs_diff(weights(tmp_path / "ckpt.pt"), weights(reference.epoch1)) <= TOLERANCE


@pytest.mark.parametrize("workers", ["default", "--workers 0"])
def test_submit_sh_04_fits_threads_and_workers_in_the_node_cores(slurm, reference, tmp_path, workers):
    """One process per node here (NPROC_PER_NODE=1), so that it has both of the task's cores to split."""
    flags, per_loader = WORKERS[workers]
    env = cores_env(tmp_path)
    job = Job(tmp_path, [*TRAIN_ARGS, *flags, "--checkpoint", f"{tmp_path}/ckpt.pt"],
              cpus=CPUS, env={**env, "NPROC_PER_NODE": "1"})
    assert job.finish(180) == 0, job.details()
    check(trainers_and_workers(env["TEST_CORES_LOG"]), 2, per_loader, job.log())
    assert max_abs_diff(weights(tmp_path / "ckpt.pt"), weights(reference.epoch1)) <= TOLERANCE


def test_submitit_takes_the_cores_that_slurm_set_and_fits_threads_and_workers_in_them(submitit_runs):
    """Without --workers and --cpus-per-task: the uninterrupted 06 job on 2 nodes x 1 task of test_slurm.py, under
    --sbatch exclusive (a whole node). The launcher wrote --cpus-per-task=1 always, and srun bound each task to one
    core."""
    run = submitit_runs["2x1"]
    assert re.search(rf"^job \d+: 2 tasks of {CPUS} cores, OMP_NUM_THREADS=1$", run["log"], re.M), run["log"]
    check(trainers_and_workers(run["cores_log"]), 2, WORKERS["default"][1], run["out"] + run["log"])


def test_submitit_honours_an_explicit_workers(slurm, reference, tmp_path):
    flags, per_loader = WORKERS["--workers 0"]
    env = cores_env(tmp_path)
    proc = launch_06(tmp_path / "logs", 2, 1, [*TRAIN_ARGS, *flags, "--cpus-per-task", str(CPUS),
                                               "--checkpoint", f"{tmp_path}/ckpt.pt"], env=env)
    try:
        out, err = proc.communicate(timeout=180)
    except BaseException:
        proc.kill()
        raise
    assert proc.returncode == 0, out + err
    check(trainers_and_workers(env["TEST_CORES_LOG"]), 2, per_loader, out + err)
    assert max_abs_diff(weights(tmp_path / "ckpt.pt"), weights(reference.epoch1)) <= TOLERANCE


def test_sbatch_refuses_cpus_per_gpu_beside_the_shipped_cpus_per_task(slurm):
    """Slurm 22.05 refuses --cpus-per-gpu on the command line beside the script's --cpus-per-task (submit.sh's
    comment says to delete that line instead)."""
    done = subprocess.run(["sbatch", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-gpu=2",
                           "--time=5", "05_ddp_slurm/submit.sh"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "--cpus-per-gpu is mutually exclusive with --cpus-per-task" in done.stderr, done


# Jobs of 05 without --cpus-per-task (the #SBATCH line commented out, as a site template has none): the cores that
# Slurm gives a task by --cpus-per-gpu, or by --exclusive (the node's share). submit.sh took 1.
CORES_WITHOUT_CPUS_PER_TASK = {"--cpus-per-gpu=2": ["--cpus-per-gpu=2"], "--exclusive": ["--exclusive"]}


@pytest.mark.parametrize("cores", CORES_WITHOUT_CPUS_PER_TASK)
def test_submit_sh_05_takes_the_cores_that_slurm_set(slurm, tmp_path, cores):
    """1 task and 1 GPU (stood in for: the task stops at its choice of device) a node, on both of its cores."""
    folder = tmp_path / "job"
    code, log, gpus, _ = sbatch_gpus(folder, "05_ddp_slurm/submit.sh",
                                     ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1",
                                      *CORES_WITHOUT_CPUS_PER_TASK[cores]],
                                     site=CORES_SITECUSTOMIZE, env={"TEST_CORES_LOG": str(folder / "cores.log")},
                                     copy=without_cpus_per_task)
    assert code == 0 and len(gpus) == 2, log
    assert f"2 tasks of {CPUS} cores" in log, log
    trainers = trainers_and_workers(folder / "cores.log")
    assert sorted((t["host"], len(t["cores"]), t["omp"]) for t in trainers) == [
        (node, CPUS, str(CPUS)) for node in SLURM_NODES], log  # sbatch_gpus passes --workers 0: all for threads
