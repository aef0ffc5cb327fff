"""The GPU lines of 04's and 05's submit.sh on the test cluster, whose nodes declare 4 GPUs each as Slurm gres
(tests/slurm_cluster.sh), so that Slurm itself sets SLURM_GPUS_ON_NODE and CUDA_VISIBLE_DEVICES by the layout.
CUDA is stood in for in the tasks by a sitecustomize that counts the CUDA_VISIBLE_DEVICES Slurm set and stops the
task once it has chosen its device (before set_device and NCCL): each task records the GPU it would take. Without
the stand-in, CUDA finds no GPU here, as on a node whose driver is down. The batch scripts run with a python that
exists only inside job steps, as where Python lives in the container alone; except the CPU job on GPU nodes, whose
log test_slurm_torchrun.py's uninterrupted job gives."""
import glob
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SLURM_NODES, STAND_INS, SYNTHETIC, Result, child_env, read_line, wait_for
from test_slurm import accounted_runs, job_state, read
from test_slurm_torchrun import torchrun_run  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm")]  # on this worker's pair (conftest.py)
N1, N2 = SLURM_NODES  # this worker's pair of nodes
WIDE = [f"{os.environ.get('SLURM_TEST_NODE_PREFIX', 'n')}w{i}" for i in (1, 2)]  # partition wide: 4 CPUs a node


def without_cpus_per_task(script):
    """A copy of a submit.sh whose #SBATCH --cpus-per-task line is commented out, as a site's template has none."""
    assert script.count("#SBATCH --cpus-per-task=") == 1
    return script.replace("#SBATCH --cpus-per-task=", "##SBATCH --cpus-per-task=")


def without_gpus_per_node(script):
    """A copy of a submit.sh whose #SBATCH --gpus-per-node line is commented out: a job that asks Slurm nothing about
    GPUs, as at a site without GPU gres (a job with --gpus-per-node=0 asked for none: SLURM_GPUS_PER_NODE=0)."""
    assert script.count("#SBATCH --gpus-per-node=") == 1
    return script.replace("#SBATCH --gpus-per-node=", "##SBATCH --gpus-per-node=")

FAKE_CUDA = '''
import os
if os.environ.get("SLURM_STEP_ID") and os.environ.get("TEST_GPU_LOG"):  # a task of a job step, not the batch script
    import socket, sys, torch
    visible = [index for index in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if index]  # what Slurm set
    torch.cuda.is_available = lambda: bool(visible)
    torch.cuda.device_count = lambda: len(visible)
    def set_device(device):  # the device the task chose: record it and the node's GPU behind it, and stop
        index = torch.device(device).index
        checkpoint = sys.argv[sys.argv.index("--checkpoint") + 1] if "--checkpoint" in sys.argv else "-"
        line = (f"{socket.gethostname()} {os.environ.get('RANK', os.environ['SLURM_PROCID'])} "
                f"{os.environ['CUDA_VISIBLE_DEVICES']} {index} {visible[index]} {checkpoint}\\n")
        with open(os.environ["TEST_GPU_LOG"], "a") as log:
            log.write(line)
        os._exit(0)
    torch.cuda.set_device = set_device
'''


def python_in_steps_only(folder):
    """A `python` that exists only inside job steps (srun), as where Python lives in the container alone: on the
    batch host, as the script runs it, it fails as a missing command does (127)."""
    wrapper = Path(folder) / "python-in-steps-only"
    wrapper.write_text(f'#!/bin/sh\n[ -n "$SLURM_STEP_ID" ] || {{ echo "python: not found" >&2; exit 127; }}\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def sbatch(folder, script, sbatch_args, train_args=(), fake_cuda=True, timeout=120, site="", env=(), copy=None):
    """sbatch REPO/script from folder (the submit folder) with its #SBATCH lines, overriding sbatch_args only (or a
    copy of it in folder that copy(text) returns); site: more sitecustomize, env: more environment; returns (exit
    code, the job's log, the GPUs recorded: [(host, rank, CUDA_VISIBLE_DEVICES, index, the node's GPU,
    --checkpoint)]), seconds."""
    folder.mkdir(exist_ok=True)
    (folder / "site").mkdir(exist_ok=True)
    (folder / "site" / "sitecustomize.py").write_text(FAKE_CUDA + site)
    env = child_env(PYTHON=str(python_in_steps_only(folder)), TRAIN_PY=str(REPO / script.replace("submit.sh", "train.py")),
                    PYTHONPATH=str(folder / "site"), **({"TEST_GPU_LOG": str(folder / "gpus.log")} if fake_cuda else {}),
                    **dict(env))
    path = REPO / script
    if copy:
        path = folder / "submit.sh"
        path.write_text(copy((REPO / script).read_text()))
    cmd = ["sbatch", "--parsable", "--wait", "--time=5", f"--output={folder}/%j.out", *sbatch_args, str(path),
           *SYNTHETIC, *train_args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = int(read_line(proc, time.monotonic() + 60).strip())
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"job {job_id} still running after {timeout} s\n{job_state(job_id)}")
    gpus = [tuple(line.split()) for line in read(folder / "gpus.log").splitlines()]
    return proc.returncode, read(folder / f"{job_id}.out"), gpus, time.monotonic() - start


# 05: two tasks on each node (the nodes have two cores, and Slurm refuses 4 tasks on them even with --overcommit
# when --ntasks-per-node is given), each with its own GPU, in each layout that sites use.
LAYOUTS_05 = {
    "per-node": ["--gpus-per-node=2"],  # every task sees the node's GPUs and takes its local rank's
    "per-task": ["--gpus-per-node=0", "--gpus-per-task=1"],  # each task sees its own GPU alone
    "gpu-bind": ["--gpus-per-node=2", "--gpu-bind=single:1"],
}


@pytest.mark.parametrize("layout", LAYOUTS_05)
def test_05_gives_each_gpu_one_task(tmp_path, layout):
    code, log, gpus, _ = sbatch(tmp_path / "job", "05_ddp_slurm/submit.sh",
                                ["--ntasks-per-node=2", "--cpus-per-task=1", *LAYOUTS_05[layout]])
    assert code == 0, log
    assert sorted((host, rank) for host, rank, *_ in gpus) == [(N1, "0"), (N1, "1"), (N2, "2"), (N2, "3")], log
    assert sorted((host, gpu) for host, _, _, _, gpu, _ in gpus) == [(N1, "0"), (N1, "1"), (N2, "0"), (N2, "1")]
    assert {(visible, index) for _, _, visible, index, _, _ in gpus} == (
        {("0,1", "0"), ("0,1", "1")} if layout == "per-node" else {("0", "0"), ("1", "0")})
    # The checkpoint: by absolute path, under the submit folder, in a folder that submit.sh made on the host.
    checkpoints = {checkpoint for *_, checkpoint in gpus}
    assert len(checkpoints) == 1 and Path(checkpoints.pop()).parent == tmp_path / "job" / "checkpoints", gpus
    assert (tmp_path / "job" / "checkpoints").is_dir()


def test_04_starts_one_process_per_gpu_with_its_lines_as_shipped(tmp_path):
    code, log, gpus, _ = sbatch(tmp_path / "job", "04_ddp_torchrun/submit.sh", ["--cpus-per-task=2"])
    assert code == 0, log
    assert sorted((host, gpu) for host, _, _, _, gpu, _ in gpus) == [(node, str(g)) for node in (N1, N2) for g in range(4)]
    assert sorted(int(rank) for _, rank, *_ in gpus) == list(range(8)), log
    assert "4 processes per node" in log


def test_05_as_shipped_gives_each_of_4_gpus_a_node_a_task(tmp_path):
    """05's #SBATCH lines as shipped, 2 nodes x 4 tasks x 4 GPUs, with only the cores (1 a task) and the time
    overridden, on the pair that declares 4 CPUs a node: every task reaches check_launch and takes its GPU."""
    code, log, gpus, _ = sbatch(tmp_path / "job", "05_ddp_slurm/submit.sh", ["--partition=wide", "--cpus-per-task=1"])
    assert code == 0, log
    assert sorted((host, int(rank), visible, index, gpu) for host, rank, visible, index, gpu, _ in gpus) == [
        (WIDE[rank // 4], rank, "0,1,2,3", str(rank % 4), str(rank % 4)) for rank in range(8)], log
    assert "8 tasks of 1 cores" in log, log


def test_04_takes_its_gpus_and_cores_from_a_step_under_exclusive(tmp_path):
    """--exclusive --gpus-per-node=2, without --cpus-per-task: Slurm 22.05 gives the batch script all 4 GPUs of its
    node (SLURM_GPUS_ON_NODE=4, CUDA_VISIBLE_DEVICES=0,1,2,3) and each step the 2 asked for. 04 starts a process
    per GPU of the step (its check refused "CUDA finds 2 of its 4 GPUs for 4 processes"), on the node's cores."""
    code, log, gpus, _ = sbatch(tmp_path / "job", "04_ddp_torchrun/submit.sh", ["--exclusive", "--gpus-per-node=2"],
                                copy=without_cpus_per_task)
    assert code == 0, log
    assert sorted((host, gpu) for host, _, _, _, gpu, _ in gpus) == [(N1, "0"), (N1, "1"), (N2, "0"), (N2, "1")], log
    assert sorted(int(rank) for _, rank, *_ in gpus) == list(range(4)), log
    assert "2 processes per node (2 GPUs, 2 cores)" in log, log


def test_04_counts_the_gpus_of_a_node_without_gres_by_its_device_files(tmp_path):
    """A site that declares no GPU gres: a job that asks Slurm nothing about GPUs has no SLURM_GPUS* variable (nor
    CUDA_VISIBLE_DEVICES), so 04 counts the device files (GPU_DEVICES: the stand-ins') and, where CUDA finds none,
    stops with one line a node. It took 2 processes a node and trained on the CPU."""
    code, log, gpus, _ = sbatch(tmp_path / "job", "04_ddp_torchrun/submit.sh", ["--cpus-per-task=2"],
                                ["--epochs", "1"], fake_cuda=False, env={"GPU_DEVICES": STAND_INS},
                                copy=without_gpus_per_node)
    assert code != 0 and not gpus, log
    for node in (N1, N2):
        assert f"error: {node}: CUDA finds 0 of its 4 GPUs for 4 processes: one process per working GPU" in log, log
    assert "rendezvous" not in log and "epoch" not in log, log  # torchrun never started


def test_04_runs_a_job_that_asked_for_no_gpus_on_the_cpu_beside_the_device_files(torchrun_run):
    """--gpus-per-node=0 on GPU nodes (the pages' CPU examples): Slurm sets SLURM_GPUS_PER_NODE=0, so 04 counts
    no device files and starts 2 processes a node on the CPU (it counted the stand-ins and refused the node). The
    job: test_slurm_torchrun.py's uninterrupted one, which runs beside the stand-ins (GPU_DEVICES)."""
    log = torchrun_run["log"]
    assert torchrun_run["gpu_devices"] == STAND_INS, "the job did not run beside the stand-in device files"
    assert len(glob.glob(f"{STAND_INS}[0-9]*")) == 4, f"no stand-in device files at {STAND_INS}0-3"
    assert torchrun_run["code"] == 0, torchrun_run["details"]
    # No node refused (submit.sh's "error: " line). Not "error" anywhere: an agent whose rendezvous host has left
    # first warns "... failed to shutdown the rendezvous ... due to an error of type RendezvousConnectionError".
    assert "2 processes per node (0 GPUs, 2 cores)" in log and not re.search(r"^error: ", log, re.M), log
    assert {(launch[5], launch[6]) for launch in Result(0, log, "", 0).launches()} == {("cpu", "gloo")}, log


def test_04_refuses_nodes_whose_cuda_finds_no_gpu(tmp_path):
    code, log, gpus, seconds = sbatch(tmp_path / "job", "04_ddp_torchrun/submit.sh", ["--cpus-per-task=2"],
                                      fake_cuda=False)
    assert code != 0 and not gpus
    for node in (N1, N2):
        assert f"error: {node}: CUDA finds 0 of its 4 GPUs for 4 processes: one process per working GPU" in log, log
    assert "rendezvous" not in log, log  # torchrun never started: the check comes first


def test_05_without_cuda_every_rank_says_so_in_seconds(tmp_path):
    code, log, gpus, seconds = sbatch(tmp_path / "job", "05_ddp_slurm/submit.sh",
                                      ["--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=2"], fake_cuda=False)
    assert code != 0 and not gpus, log
    for rank, node in enumerate([N1, N1, N2, N2]):
        assert f"error: task {rank} on {node}: 2 tasks, 2 GPUs, and CUDA sees 0: run one task per working GPU" in log, (
            log)
    assert "local_rank" not in log, log  # no rank joined the process group, nor trained on the CPU
    print(f"the job took {seconds:.1f} s")
    assert seconds < 60, log


@pytest.mark.parametrize("gpus_per_node", [4, 1])  # the shipped line with 2 tasks: 2 GPUs idle; 2 tasks on 1 GPU
def test_05_refuses_tasks_that_do_not_match_the_gpus(tmp_path, gpus_per_node):
    code, log, gpus, _ = sbatch(tmp_path / "job", "05_ddp_slurm/submit.sh",
                                ["--ntasks-per-node=2", "--cpus-per-task=1",
                                 *([] if gpus_per_node == 4 else ["--gpus-per-node=1"])])
    assert code != 0 and not gpus, log
    for rank, node in enumerate([N1, N1, N2, N2]):
        assert (f"error: task {rank} on {node}: 2 tasks, {gpus_per_node} GPUs, and CUDA sees {gpus_per_node}: run one "
                "task per working GPU") in log, log


@pytest.mark.parametrize("flags", [[], ["--batch"], ["--full"]])
def test_scancel_signal_usr2_reaches_the_tasks_and_with_batch_or_full_kills_the_batch_shell(tmp_path, flags):
    """What 05's page tells users to try: `scancel --signal=USR2 JOBID` signals the tasks only (the stop that 05
    turns into a save and a requeue); -b signals the batch shell alone and --full the shell and the tasks, and
    either way the shell dies of it (the job FAILED on signal 12: no requeue). A site template's
    `--signal=B:USR2@...` is the same as -b."""
    script = tmp_path / "job.sh"
    # The task's trap writes a file of its own: its echo, forwarded by slurmstepd as the task exits, can be lost.
    # It waits in a loop: Slurm signals a task's children before its shell, and after a bare `sleep & wait` the
    # shell could exit 0 before its own signal came.
    script.write_text(f"#!/bin/bash\nsrun bash -c 'trap \"echo SIGUSR2 > {tmp_path}/task-signal; exit 0\" USR2; "
                      "echo task: started; while :; do sleep 1 & wait; done'\necho \"batch shell: srun returned $?\"\n")
    done = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks=1", "--cpus-per-task=1", "--time=2",
                           f"--output={tmp_path}/%j.out", str(script)], capture_output=True, text=True, timeout=30)
    job_id = int(done.stdout.strip())
    log = tmp_path / f"{job_id}.out"
    wait_for(lambda: "task: started" in read(log), 60, "the task to start", lambda: job_state(job_id))
    subprocess.run(["scancel", "--signal=USR2", *flags, str(job_id)], check=True, timeout=30)
    if not flags:  # a task without the signal would loop to the time limit: say so before sacct's wait ends
        wait_for(lambda: read(tmp_path / "task-signal"), 30, "the task's USR2 trap", lambda: job_state(job_id))
    states = accounted_runs(job_id)
    if not flags:
        assert states == ["COMPLETED"] and "batch shell: srun returned 0" in read(log), read(log)
        assert read(tmp_path / "task-signal") == "SIGUSR2\n"  # the task had the signal, and left by its trap
    else:
        assert states == ["FAILED"] and "batch shell" not in read(log), read(log)
        assert sacct_exit(job_id) == "0:12"  # the batch shell died of SIGUSR2


def sacct_exit(job_id):
    done = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "ExitCode", "-j", str(job_id)], capture_output=True,
                          text=True, timeout=30)
    return done.stdout.strip()
