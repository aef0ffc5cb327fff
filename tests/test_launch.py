"""How each process finds its GPU and its rendezvous. setup() of 03-06 under the layouts that real sites give
a task (all of its node's GPUs, or one bound to it), with CUDA and the process group replaced by recorders,
and 03's rendezvous port, which no other program can take."""
import os
import signal
import socket
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, STALE_RENDEZVOUS, child_env, free_port, load_step_module, train_in_process


@pytest.mark.parametrize("step, visible, local_rank, expected", [
    ("03_ddp_mpspawn", 4, 2, "cuda:2"),  # 03 and 04: one process per GPU of the node, by its local rank
    ("05_ddp_slurm", 4, 2, "cuda:2"),  # --gpus-per-node: every task sees the node's 4 GPUs, takes its local rank's
    ("05_ddp_slurm", 1, 3, "cuda:0"),  # --gpus-per-task=1, --gpu-bind or a container: the task sees its GPU alone
    ("05_ddp_slurm", 1, 0, "cuda:0"),
])  # setup() is the same in 03 and 04, and in 05 and 06; check_launch() below refuses any other layout
def test_each_process_finds_its_gpu(monkeypatch, capsys, step, visible, local_rank, expected):
    module = load_step_module(step)
    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.update(set_device=str(device)))
    monkeypatch.setattr(module.dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(module.dist, "new_group", lambda backend, timeout: backend)  # the Gloo group setup() makes
    # 05 and 06 check there that no two tasks share a GPU (test_tasks_that_share_a_gpu_end_with_one_line)
    monkeypatch.setattr(module, "check_gpus_not_shared", lambda device, group: None, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "n1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(visible))))
    device, gloo_group = module.setup(5, local_rank, 8, 600)
    assert str(device) == calls["set_device"] == expected and gloo_group == "gloo"
    assert (calls["backend"], calls["rank"], calls["world_size"]) == ("nccl", 5, 8)
    assert calls["timeout"].total_seconds() == 600  # --collective-timeout reaches the process group
    printed = capsys.readouterr().out
    assert f"rank 5/8 local_rank {local_rank} " in printed and f" device {expected} backend nccl " in printed, printed


def test_03_holds_its_rendezvous_port_from_the_start(ladder):
    """A program that tries to take 03's port just before mp.spawn starts the ranks (THIEF in conftest.py, in
    03's first ladder run) finds it taken, and the run goes on."""
    first = ladder("03_ddp_mpspawn").first
    assert "thief found the port taken" in first.output, first
    assert first.returncode == 0 and len(first.epochs()) == 1, first


def test_06_submits_from_a_shell_that_has_rendezvous_variables(ladder):
    """A shell inside an allocation, or one that ran torchrun before, has MASTER_ADDR, RANK and the like set,
    and Slurm passes them on to the job: 06's first ladder run starts from such a shell (STALE_RENDEZVOUS in
    conftest.py), and the job's own values replace them."""
    first = ladder("06_ddp_submitit").first
    assert first.returncode == 0, first
    launches = first.launches()  # (rank, world size, local rank, host, pid, device, backend, addr, port)
    assert sorted((launch[0], launch[1], launch[2]) for launch in launches) == [("0", "2", "0"), ("1", "2", "1")]
    assert all(launch[7] != STALE_RENDEZVOUS["MASTER_ADDR"] and launch[8] != "1" for launch in launches), first
    assert len(first.epochs()) == 1, first


# What Slurm sets in a task (SLURM_GPUS_ON_NODE, SLURM_STEP_TASKS_PER_NODE, SLURM_NODEID; the test cluster shows
# them: test_slurm_gpus.py) and what CUDA sees, for task 5 (local rank 1) on the third node.
@pytest.mark.parametrize("gpus, tasks_per_node, visible, refused", [
    (4, "4(x3)", 4, False),       # --gpus-per-node=4 --ntasks-per-node=4: every task sees the node's 4
    (4, "2,2,4(x2)", 1, False),   # --gpus-per-task=1 or --gpu-bind: each sees its own; this node has 4 tasks
    (0, "2(x3)", 0, False),       # a CPU job
    (4, "4,4,2", 4, True),        # 2 tasks for 4 GPUs: 2 idle
    (1, "2(x3)", 1, True),        # 2 tasks on 1 GPU: NCCL's "Duplicate GPU"
    (4, "4(x3)", 2, True),        # 2 of the 4 visible (a site's binding): local rank 3 would have none
    (4, "4(x3)", 0, True),        # CUDA finds none (driver down, CUDA_VISIBLE_DEVICES emptied): not the CPU
    (None, "4(x3)", 4, False),    # a site without GPU gres: the node's GPUs as CUDA counts them
    (None, "8(x3)", 4, True),     # there, 8 tasks on a node of 4 GPUs: local ranks 4-7 would have none
])
@pytest.mark.parametrize("step", ["05_ddp_slurm", "06_ddp_submitit"])
def test_a_wrong_gpu_launch_is_refused_in_one_line(monkeypatch, tmp_path, step, gpus, tasks_per_node, visible, refused):
    module = load_step_module(step)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    for name, value in dict(SLURM_GPUS_ON_NODE=gpus, SLURM_STEP_TASKS_PER_NODE=tasks_per_node, SLURM_NODEID=2,
                            SLURM_JOB_ID=42, CUDA_VISIBLE_DEVICES="0,1,2,3"[:2 * visible - 1]).items():
        monkeypatch.setenv(name, str(value)) if value is not None else monkeypatch.delenv(name, raising=False)
    gpus = visible if gpus is None else gpus
    if not refused:
        module.check_launch(5)
        return
    with pytest.raises(SystemExit) as stopped:
        module.check_launch(5)
    tasks = int(tasks_per_node.split(",")[-1].split("(")[0])
    assert str(stopped.value) == (
        f"error: task 5 on {socket.gethostname()}: {tasks} tasks, {gpus} GPUs, and CUDA sees {visible}: run one "
        "task per working GPU (--ntasks-per-node as --gpus-per-node; nvidia-smi)")


# The GPU (host, UUID) of each task of a job of 4 tasks on 2 nodes, as setup() gathers them after init_process_group.
# Each task's GPU as CUDA shows it: (host, UUID, PCI domain, bus, device); the tasks named as sharing one.
@pytest.mark.parametrize("gpus, shared", [
    ([("n1", "GPU-a", 0, 1, 0), ("n1", "GPU-b", 0, 2, 0), ("n2", "GPU-c", 0, 1, 0), ("n2", "GPU-d", 0, 2, 0)],
     None),  # one GPU each
    # a cloud VM's GPUs on one bus, told apart by their device numbers (00:04.0, 00:05.0)
    ([("n1", "GPU-a", 0, 0, 4), ("n1", "GPU-b", 0, 0, 5)], None),
    # the same bus number in two PCI domains: two GPUs
    ([("n1", "GPU-a", 0, 1, 0), ("n1", "GPU-b", 1, 1, 0)], None),
    # --gpu-bind=map_gpu:0 on n2 (or under ConstrainDevices, where each task's GPU is its cuda:0 and indices tell
    # nothing): tasks 2 and 3 on one GPU, which NCCL refuses with a traceback on every rank
    ([("n1", "GPU-a", 0, 1, 0), ("n1", "GPU-b", 0, 2, 0), ("n2", "GPU-c", 0, 1, 0), ("n2", "GPU-c", 0, 1, 0)],
     "[2, 3]"),
    ([("n1", "GPU-a", 0, 1, 0), ("n1", "GPU-a", 0, 1, 0), ("n2", "GPU-c", 0, 1, 0), ("n2", "GPU-d", 0, 2, 0)],
     "[0, 1]"),
    # two MIG slices of one GPU: UUIDs of their own, one PCI address (stood-in properties: no MIG here)
    ([("n1", "MIG-a", 0, 1, 0), ("n1", "MIG-b", 0, 1, 0)], "[0, 1]"),
])
@pytest.mark.parametrize("step", ["05_ddp_slurm", "06_ddp_submitit"])
def test_tasks_that_share_a_gpu_end_with_one_line(monkeypatch, capsys, step, gpus, shared):
    """Every task ends (none waits in a collective for the others), and rank 0 names those that share a GPU in one
    line; the GPUs' identities (PCI addresses: a MIG slice has a UUID of its own) travel over setup()'s Gloo group,
    as NCCL itself fails on a shared GPU."""
    module = load_step_module(step)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # each task's own GPU, as cuda:0
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(module.dist, "init_process_group", lambda backend, **kw: None)
    monkeypatch.setattr(module.dist, "new_group", lambda backend, timeout: backend)
    monkeypatch.setattr(module.dist, "get_world_size", lambda group=None: len(gpus))
    monkeypatch.setenv("MASTER_ADDR", "n1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    sent = [(host, *address) for host, _, *address in gpus]  # what each rank sends
    for rank, (host, uuid, domain, bus, device) in enumerate(gpus):
        properties = Namespace(uuid=uuid, pci_domain_id=domain, pci_bus_id=bus, pci_device_id=device)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, p=properties: p)

        def all_gather_object(found, mine, group, expected=(socket.gethostname(), domain, bus, device)):
            assert mine == expected and group == "gloo"
            found[:] = sent
        monkeypatch.setattr(module.dist, "all_gather_object", all_gather_object)
        monkeypatch.setattr(module.dist, "get_rank", lambda group=None, rank=rank: rank)  # who prints the line
        capsys.readouterr()
        if shared is None:  # past the shared-GPU check: setup() returns, and the run goes on
            assert module.setup(rank, rank % 2, len(gpus), 600) == (torch.device("cuda", 0), "gloo")
            assert capsys.readouterr().err == ""
            continue
        with pytest.raises(SystemExit) as exited:
            module.setup(rank, rank % 2, len(gpus), 600)
        # Every rank exits with code 1 (exit_with_error); rank 0 alone prints the line, on stderr.
        assert exited.value.code == 1 and capsys.readouterr().err == ("" if rank else (
            f"error: tasks {shared} share a GPU: give each task its own\n")), rank


def test_06_writes_the_account_no_wckey_the_signal_and_the_requeue_into_its_job(tmp_path):
    """The batch script that submitit writes for 06 (an sbatch that keeps it and refuses to submit): the sbatch
    options a site requires (--sbatch, repeated: an account, a QOS, memory per GPU, --exclusive), no wckey unless
    asked for (submitit's own, "submitit", is rejected where wckeys are enforced), the stop signal and the requeue.
    The checkpoint's folder (checkpoints/ without --checkpoint) is made here, on the host, in the folder that will be
    the job's submit folder."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sbatch").write_text('#!/bin/sh\nfor last; do :; done\ncp "$last" "$KEEP"\nexit 1\n')
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    scripts = []
    for extra in (["--sbatch", "qos=high", "--sbatch", "mem-per-gpu=32G", "--sbatch=--exclusive"],
                  ["--sbatch", "wckey=ml", "--checkpoint", "mine/ckpt.pt"]):
        keep = tmp_path / f"job{len(scripts)}.sh"
        subprocess.run([sys.executable, REPO / "06_ddp_submitit/train.py", "--nodes", "2", "--gpus-per-node", "4",
                        "--sbatch", "account=proj42", "--log-dir", str(tmp_path / "logs"), *extra], cwd=tmp_path, timeout=120, capture_output=True,
                       env=child_env(KEEP=str(keep), PATH=f"{tmp_path / 'bin'}:{child_env()['PATH']}"))
        scripts.append(keep.read_text())
    assert "#SBATCH --account=proj42\n" in scripts[0] and "wckey" not in scripts[0]
    assert all(f"#SBATCH --{option}\n" in scripts[0] for option in ("qos=high", "mem-per-gpu=32G", "exclusive"))
    assert "#SBATCH --requeue\n" in scripts[0] and "#SBATCH --signal=USR2@120\n" in scripts[0]
    assert "qos" not in scripts[1]
    assert "#SBATCH --wckey=ml\n" in scripts[1]
    assert (tmp_path / "checkpoints").is_dir() and (tmp_path / "mine").is_dir()


def test_06_refuses_tasks_that_do_not_match_the_gpus():
    done = subprocess.run([sys.executable, "06_ddp_submitit/train.py", "--nodes", "2", "--gpus-per-node", "8",
                           "--tasks-per-node", "4"], cwd=REPO, capture_output=True, text=True, timeout=60, env=child_env())
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        "train.py: error: --tasks-per-node 4 for --gpus-per-node 8: one per GPU"), done.stderr


class Started(Exception):
    """Raised by the stand-in setup() with (rank, local_rank, world_size): the task got that far."""


def stop_at_setup(monkeypatch, module):
    def setup(rank, local_rank, world_size, timeout):
        raise Started(rank, local_rank, world_size)
    monkeypatch.setattr(module, "setup", setup)


def test_05_under_torchrun_inside_an_allocation_runs_no_slurm_check(monkeypatch):
    """A copy of 05 tried with the page's torchrun command in a shell of an allocation with 2 GPUs (`srun --pty
    --gres=gpu:2 bash`: Slurm's variables say 1 task and 2 GPUs) starts under torchrun's layout; Slurm's task counts
    describe no torchrun, and check_launch() took them for a wrong launch ("1 tasks and 2 GPUs")."""
    module = load_step_module("05_ddp_slurm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name, value in dict(SLURM_JOB_ID="9", SLURM_STEP_ID="0", SLURM_GPUS_ON_NODE="2", SLURM_STEP_TASKS_PER_NODE="1",
                            SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="1", LOCAL_RANK="1", RANK="1",
                            WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                            TORCHELASTIC_RUN_ID="none").items():  # what torchrun's agent sets in every worker
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["05_ddp_slurm/train.py", "--dataset", "synthetic"])
    monkeypatch.setattr(module, "catch_stop_signals", lambda: None)  # not in the test's own process
    stop_at_setup(monkeypatch, module)
    with pytest.raises(Started) as started:
        module.main()
    assert started.value.args == (1, 1, 2)  # torchrun's place, not Slurm's (rank 0 of 1)


def test_05_started_by_srun_with_torchrun_like_variables_is_checked(monkeypatch):
    """srun's tasks can carry RANK, LOCAL_RANK and WORLD_SIZE too (enroot's PyTorch hook in NGC images, a site's
    wrapper): they are srun's tasks all the same, and check_launch() refuses a wrong launch (1 task, 2 GPUs)."""
    module = load_step_module("05_ddp_slurm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for name, value in dict(SLURM_JOB_ID="9", SLURM_STEP_ID="0", SLURM_GPUS_ON_NODE="2", SLURM_STEP_TASKS_PER_NODE="1",
                            SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="1", LOCAL_RANK="0", RANK="0",
                            WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["05_ddp_slurm/train.py", "--dataset", "synthetic"])
    monkeypatch.setattr(module, "catch_stop_signals", lambda: None)  # not in the test's own process
    monkeypatch.setattr(module, "setup", lambda *args: pytest.fail("trained past check_launch"))
    with pytest.raises(SystemExit) as exited:
        module.main()
    assert "1 tasks, 2 GPUs" in str(exited.value.code), exited.value.code


def start_task_in_a_container(monkeypatch, tmp_path, step, **env):
    """A one-task job of step on the CPU, in this process: its task starts in a working folder that is not the
    submit folder (a container's: NGC images start in /workspace), with a stop signal pending from the start, so
    that it stops before its first step and saves. Returns (the submit folder, the working folder, the module)."""
    module = load_step_module(step)
    submit, workdir = tmp_path / "submit", tmp_path / "workspace"
    (submit / "checkpoints").mkdir(parents=True)  # made on the host: submit.sh, 06's launcher
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_GPUS_ON_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_LOCALID="0",
                            SLURM_NODEID="0", SLURM_NTASKS="1", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="127.0.0.1",
                            SLURM_SUBMIT_DIR=str(submit), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                            **env).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(module, "catch_stop_signals", lambda: None)  # not in the test's own process
    monkeypatch.setattr(signal, "sigpending", lambda: {signal.SIGUSR2})  # what stop_signal_received() finds
    return submit, workdir, module


def stopped(call):
    """call()'s exit code; the process group it left, if any, destroyed."""
    try:
        with pytest.raises(SystemExit) as exited:
            call()
        return exited.value.code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_05_saves_a_relative_checkpoint_in_the_submit_folder(monkeypatch, capsys, tmp_path):
    """A relative --checkpoint (a user's, through submit.sh's "$@") is the submit folder's, not the working folder's
    of a container, whose files are thrown away with it: every requeue would start over."""
    submit, workdir, module = start_task_in_a_container(monkeypatch, tmp_path, "05_ddp_slurm")
    monkeypatch.setattr(sys, "argv", ["05_ddp_slurm/train.py", "--dataset", "synthetic", "--epochs", "1",
                                      "--checkpoint", "checkpoints/mine.pt"])
    code = stopped(module.main)
    output = capsys.readouterr().out
    assert code == 144, (code, output)
    assert "stopped at epoch 1 step 0 on SIGUSR2 " in output, output
    assert (submit / "checkpoints" / "mine.pt").exists() and not list(workdir.iterdir())


def test_04_under_slurm_takes_a_relative_checkpoint_as_the_submit_folders(monkeypatch, capsys, tmp_path):
    """04's processes in submit.sh's job (torchrun's, in a container's working folder) resolve a relative
    --checkpoint against the submit folder, and refuse a folder missing there: made by the task in a container that
    lacks its mount, it would keep every save in the image's throwaway files, and a requeue would start over."""
    module = load_step_module("04_ddp_torchrun")
    submit, workdir = tmp_path / "submit", tmp_path / "workspace"
    submit.mkdir()
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_SUBMIT_DIR", str(submit))
    monkeypatch.setattr(sys, "argv", ["04_ddp_torchrun/train.py", "--checkpoint", "checkpoints/ddp-torchrun-7.pt"])
    with pytest.raises(SystemExit) as exited:
        module.parse_args()
    assert str(exited.value) == (
        f"error: no checkpoint folder {submit}/checkpoints on {socket.gethostname()}: make it first, and "
        "mount it in a container")
    (submit / "checkpoints").mkdir()  # as submit.sh makes it, on the host
    assert module.parse_args().checkpoint == f"{submit}/checkpoints/ddp-torchrun-7.pt"

def test_06_checkpoints_in_the_submit_folder_by_default_one_per_job(monkeypatch, capsys, tmp_path):
    """06 on Slurm without --checkpoint: its tasks save in checkpoints/ddp-submitit-JOBID.pt of the submit folder (as
    05's submit.sh names it: a requeue, under the same job id, resumes it) and exit to be requeued, where they used to
    save nothing and end the job as COMPLETED; a relative --checkpoint is the submit folder's, resolved in the task
    (the launcher's shell is no job), not the working folder's of a container."""
    submit, workdir, module = start_task_in_a_container(monkeypatch, tmp_path, "06_ddp_submitit",
                                                        SUBMITIT_EXECUTOR="slurm", SLURM_JOB_NAME="ddp-submitit")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # run() exports them: undone at the end
        monkeypatch.setenv(name, "0")
    for extra in ([], ["--checkpoint", "checkpoints/mine.pt"]):
        monkeypatch.setattr(sys, "argv", ["06_ddp_submitit/train.py", "--dataset", "synthetic", "--epochs", "1",
                                          "--gpus-per-node", "0", *extra])
        monkeypatch.delenv("SLURM_SUBMIT_DIR")  # the launcher's shell, on a login node
        args = module.parse_args()
        monkeypatch.setenv("SLURM_SUBMIT_DIR", str(submit))  # the job's tasks
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        code = stopped(lambda: module.run(args))
        output = capsys.readouterr().out
        assert code == 144 and "stopped at epoch 1 step 0 on SIGUSR2 " in output, (code, output)
    assert sorted(path.name for path in (submit / "checkpoints").iterdir()) == ["ddp-submitit-4242.pt", "mine.pt"]
    assert not list(workdir.iterdir())



@pytest.mark.parametrize("gpus_per_node, visible", [(0, 0), (2, 2)])
def test_06_local_on_a_gpu_machine_runs_no_slurm_check(monkeypatch, tmp_path, gpus_per_node, visible):
    """06 --local on a machine with 4 GPUs, asked for none (CUDA_VISIBLE_DEVICES= ) or for 2 of them (submitit's
    local runner shows the tasks GPUs 0 and 1): the task starts its process group. check_launch() judges a Slurm
    job's layout; --local has none (it drops SLURM_*), and it counted the machine's 4 device files against 2 tasks
    and refused both runs ("2 tasks and 4 GPUs on it")."""
    module = load_step_module("06_ddp_submitit")
    for index in range(4):
        (tmp_path / f"nvidia{index}").touch()
    monkeypatch.setenv("GPU_DEVICES", f"{tmp_path}/nvidia")
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(visible))))
    monkeypatch.setattr(sys, "argv", ["06_ddp_submitit/train.py", "--local", "--dataset", "synthetic",
                                      "--tasks-per-node", "2", "--gpus-per-node", str(gpus_per_node)])
    args = module.parse_args()
    monkeypatch.setattr(module, "catch_stop_signals", lambda: None)  # not in the test's own process
    task = Namespace(rank=1, local_rank=1, world_size=2)  # what submitit's local runner gives task 1
    monkeypatch.setattr(module.submitit.helpers, "TorchDistributedEnvironment",
                        lambda: Namespace(export=lambda **_: task))
    stop_at_setup(monkeypatch, module)
    with pytest.raises(Started) as started:
        module.run(args)
    assert started.value.args == (1, 1, 2)


def test_06_a_run_cut_short_without_a_checkpoint_exits_1(monkeypatch, capsys):
    """06 --local has no default --checkpoint: a stop (its time limit's SIGUSR2) at the first step saves nothing,
    and the task exits 1 with its line, so that submitit's launcher reports a failed job instead of "job N
    finished" and exit code 0 as after a whole run."""
    module = load_step_module("06_ddp_submitit")
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["06_ddp_submitit/train.py", "--local", "--dataset", "synthetic",
                                      "--epochs", "1", "--tasks-per-node", "1"])
    args = module.parse_args()
    monkeypatch.setattr(module, "catch_stop_signals", lambda: None)  # not in the test's own process
    monkeypatch.setattr(signal, "sigpending", lambda: {signal.SIGUSR2})  # what stop_signal_received() finds
    task = Namespace(rank=0, local_rank=0, world_size=1)
    monkeypatch.setattr(module.submitit.helpers, "TorchDistributedEnvironment",
                        lambda: Namespace(export=lambda **_: task))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    code = stopped(lambda: module.run(args))
    output = capsys.readouterr().out
    assert code == 1 and "nothing saved: exit code 1, not requeued: no --checkpoint" in output, (
        code, output)


@pytest.mark.parametrize("restart_count", ["0", "1"])
def test_05_says_where_it_starts_when_it_finds_no_checkpoint(monkeypatch, capsys, tmp_path, restart_count):
    """A job that should resume and finds no file (a mistyped --checkpoint in a resubmission; a relative one under
    salloc + torchrun, taken from another folder) says so with the absolute path it looked at, where it trained
    from epoch 1 without a line; in a requeued job too."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_RESTART_COUNT", restart_count)
    monkeypatch.delenv("SLURM_SUBMIT_DIR", raising=False)
    monkeypatch.setattr(signal, "sigpending", lambda: {signal.SIGUSR2})  # a stop at once: no training needed
    code, output = train_in_process("05_ddp_slurm", ["--dataset", "synthetic", "--checkpoint", "ckpt-typo.pt"],
                                    capsys)
    assert code == 144 and output.splitlines()[0] == (
        f"no checkpoint at {tmp_path}/ckpt-typo.pt: starting at epoch 1"), output


def test_05_under_torchrun_in_a_slurm_job_refuses_a_missing_checkpoint_folder(monkeypatch, tmp_path):
    """05 started by torchrun inside a Slurm job (its page's try-out, in an allocation or a container): a relative
    --checkpoint is the submit folder's, and a folder missing there ends the launch with one line, as in 04.
    check_launch() runs under srun only, so 05 saved into a folder it made itself (in a container, in files
    thrown away with it), and every requeue started over without a line."""
    module = load_step_module("05_ddp_slurm")
    monkeypatch.setenv("SLURM_SUBMIT_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(sys, "argv", ["05_ddp_slurm/train.py", "--checkpoint", "missing/ckpt.pt"])
    with pytest.raises(SystemExit) as refused:
        module.parse_args()
    assert str(refused.value).startswith(f"error: no checkpoint folder {tmp_path}/missing on ")  # one line
    (tmp_path / "missing").mkdir()
    assert module.parse_args().checkpoint == f"{tmp_path}/missing/ckpt.pt"


def test_06_without_slurm_and_without_local_says_so_in_one_line(monkeypatch, capsys, tmp_path):
    """06 started where there is no Slurm (no srun on PATH: a laptop, a container) and without --local: one line
    from argparse, where submitit raised "Did not found an available executor" in a traceback."""
    module = load_step_module("06_ddp_submitit")
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun here
    monkeypatch.setattr(sys, "argv", ["06_ddp_submitit/train.py", "--gpus-per-node", "0"])
    with pytest.raises(SystemExit) as refused:
        module.parse_args()
    assert refused.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == (
        "train.py: error: no Slurm here (srun is not on PATH): submit from a login node, or --local")
    monkeypatch.setattr(sys, "argv", ["06_ddp_submitit/train.py", "--local"])
    assert module.parse_args().local
