"""Each task gets the cores it asked for, and its threads plus its data-loader workers fit in them, on the
two-node cluster with CPU binding on (task/affinity), for 04's and 05's submit.sh and 06's generated job.

Slurm 22.05 (Debian 12's) is the first version whose srun does not take --cpus-per-task from sbatch, so the
scripts pass it again. With two cores a node this cluster cannot show the difference (one task a node gets
the node's cores with or without it), but it shows the split: the old scripts ran OMP_NUM_THREADS=2 plus
the workers on two cores. A sitecustomize on PYTHONPATH
records, in every Python process of the job, the cores it may run on (its affinity) and OMP_NUM_THREADS,
and makes the data-loader workers start by spawn, so that each worker is a Python process that records
itself too, with the training process as its parent."""
import json

import pytest

from conftest import TOLERANCE, max_abs_diff, weights
from test_slurm import launch_06, read, sbatch_05, finish, job_id_of, slurm  # noqa: F401 (slurm: a fixture)
from test_slurm_torchrun import Job

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]
CPUS = 2  # per task, all the cores a node of the test cluster has
TRAIN_ARGS = ["--dataset", "synthetic", "--batch-size", "32", "--epochs", "1"]  # --workers: the script's choice
SITECUSTOMIZE = '''
import json, multiprocessing, os, socket
if os.environ.get("TEST_CORES_LOG"):
    multiprocessing.set_start_method("spawn", force=True)
    with open("/proc/self/cmdline", "rb") as cmdline:
        cmd = [part.decode() for part in cmdline.read().split(b"\\0") if part]
    line = json.dumps(dict(host=socket.gethostname(), pid=os.getpid(), ppid=os.getppid(), cmd=cmd,
                           cores=sorted(os.sched_getaffinity(0)), omp=os.environ.get("OMP_NUM_THREADS")))
    with open(os.environ["TEST_CORES_LOG"], "a") as log:
        log.write(line + "\\n")  # one short write in append mode: lines of several processes do not mix
'''


@pytest.fixture
def cores_env(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return dict(PYTHONPATH=str(site), TEST_CORES_LOG=str(tmp_path / "cores.log"))


def trainers_and_workers(log_path, is_trainer):
    """The training processes that is_trainer(cmd) picks, each with the data-loader workers it started."""
    records = [json.loads(line) for line in read(log_path).splitlines()]
    trainers = [r for r in records if is_trainer(r["cmd"])]
    for trainer in trainers:
        trainer["workers"] = [r for r in records if r["ppid"] == trainer["pid"]
                              and any("spawn_main" in part for part in r["cmd"])]
    return trainers


def check(trainers, count, workers_per_loader, log):
    """count training processes on n1 and n2; each may run on CPUS cores, and its threads and its workers
    fit in them (counted per loader: the training and the evaluation loaders' workers take turns). Without
    --workers a loader has CPUS // 2 workers; with it, that many, and the threads shrink or grow to match."""
    summary = [(t["host"], t["cores"], t["omp"], len(t["workers"])) for t in trainers]
    print(f"training processes (host, cores, OMP_NUM_THREADS, workers): {summary}")
    assert len(trainers) == count and {t["host"] for t in trainers} == {"n1", "n2"}, (summary, log)
    for trainer in trainers:
        assert len(trainer["cores"]) == CPUS, (summary, log)  # the task's cores (here also without srun -c)
        assert len(trainer["workers"]) == 2 * workers_per_loader, (summary, log)
        assert int(trainer["omp"]) == max(1, CPUS - workers_per_loader), (summary, log)  # nothing runs on top
        assert all(worker["cores"] == trainer["cores"] for worker in trainer["workers"]), (summary, log)


WORKERS = {"default": ([], 1), "--workers 0": (["--workers", "0"], 0), "--workers=2": (["--workers=2"], 2)}


@pytest.mark.parametrize("workers", ["default", "--workers=2"])
def test_submit_sh_05_fits_threads_and_workers_in_the_task_cores(slurm, cores_env, reference, tmp_path, workers):
    flags, per_loader = WORKERS[workers]
    proc = sbatch_05(tmp_path, 2, 1, [*TRAIN_ARGS, *flags, "--checkpoint", f"{tmp_path}/ckpt.pt"],
                     sbatch_args=[f"--cpus-per-task={CPUS}"], env=cores_env)
    job_id = job_id_of(proc)
    assert finish(proc, 180) == 0
    log = read(tmp_path / f"ddp-slurm-{job_id}.out")
    trainers = trainers_and_workers(cores_env["TEST_CORES_LOG"], lambda cmd: "05_ddp_slurm/train.py" in cmd)
    check(trainers, 2, per_loader, log)
    assert max_abs_diff(weights(tmp_path / "ckpt.pt"), weights(reference.epoch1)) <= TOLERANCE


@pytest.mark.parametrize("workers", ["default", "--workers 0"])
def test_submit_sh_04_fits_threads_and_workers_in_the_node_cores(slurm, cores_env, reference, tmp_path, workers):
    """One process per node here (NPROC_PER_NODE=1), so that it has both of the task's cores to split."""
    flags, per_loader = WORKERS[workers]
    job = Job(tmp_path, [*TRAIN_ARGS, *flags, "--checkpoint", f"{tmp_path}/ckpt.pt"],
              cpus=CPUS, env={**cores_env, "NPROC_PER_NODE": "1"})
    assert job.finish(180) == 0, job.details()
    is_trainer = lambda cmd: "04_ddp_torchrun/train.py" in cmd and "torch.distributed.run" not in cmd  # not the agent
    trainers = trainers_and_workers(cores_env["TEST_CORES_LOG"], is_trainer)
    check(trainers, 2, per_loader, job.log())
    assert max_abs_diff(weights(tmp_path / "ckpt.pt"), weights(reference.epoch1)) <= TOLERANCE


@pytest.mark.parametrize("workers", ["default", "--workers 0"])
def test_submitit_fits_threads_and_workers_in_the_task_cores(slurm, cores_env, reference, tmp_path, monkeypatch,
                                                             workers):
    flags, per_loader = WORKERS[workers]
    for name, value in cores_env.items():
        monkeypatch.setenv(name, value)  # launch_06 passes this process's environment on, and so the job's
    proc = launch_06(tmp_path / "logs", 2, 1, [*TRAIN_ARGS, *flags, "--cpus-per-task", str(CPUS),
                                               "--checkpoint", f"{tmp_path}/ckpt.pt"])
    try:
        out, err = proc.communicate(timeout=180)
    except BaseException:
        proc.kill()
        raise
    assert proc.returncode == 0, out + err
    trainers = trainers_and_workers(cores_env["TEST_CORES_LOG"], lambda cmd: "submitit.core._submit" in cmd)
    check(trainers, 2, per_loader, out + err)
    assert max_abs_diff(weights(tmp_path / "ckpt.pt"), weights(reference.epoch1)) <= TOLERANCE
