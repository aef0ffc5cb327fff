"""check_launch() of 05 and 06 where the site does not declare its GPUs as Slurm gres (many do not): Slurm sets no
SLURM_GPUS_ON_NODE, so the node's GPU device files count them (GPU_DEVICES and a number; here files of the test's
own; test_slurm_gpus.py shows Slurm without gres and 04's submit.sh on the test cluster). A node whose driver
is down keeps its files while CUDA finds no GPU: one line, not a CPU run beside the other nodes' NCCL."""
import socket

import pytest
import torch

from conftest import load_step_module


# GPU device files on the node, GPUs that CUDA sees, Slurm's tasks per node (this is the third node), refused.
@pytest.mark.parametrize("files, visible, tasks_per_node, refused", [
    (4, 0, "4(x3)", True),    # the driver is down: CUDA sees none of the node's 4 GPUs
    (4, 4, "4(x3)", False),   # one task per GPU
    (4, 4, "2(x3)", True),    # 2 tasks for 4 GPUs: 2 idle
    (4, 1, "4(x3)", False),   # a site's binding: each task sees its own
    (0, 0, "2(x3)", False),   # a CPU node
    ("", 0, "2(x3)", False),  # CUDA_VISIBLE_DEVICES= on a node with 4 GPUs: a CPU job, asked for
])
@pytest.mark.parametrize("step", ["05_ddp_slurm", "06_ddp_submitit"])
def test_a_node_without_gres_counts_its_gpus_by_their_device_files(monkeypatch, tmp_path, step, files, visible,
                                                                   tasks_per_node, refused):
    module = load_step_module(step)
    for index in range(4 if files == "" else files):
        (tmp_path / f"nvidia{index}").touch()
    (tmp_path / "nvidiactl").touch()  # not a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if files == "":
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for name, value in dict(SLURM_STEP_TASKS_PER_NODE=tasks_per_node, SLURM_NODEID="2", SLURM_JOB_ID="42",
                            GPU_DEVICES=f"{tmp_path}/nvidia").items():
        monkeypatch.setenv(name, value)
    if not refused:
        module.check_launch(5)
        return
    with pytest.raises(SystemExit) as stopped:
        module.check_launch(5)
    tasks = tasks_per_node.split("(")[0]
    assert str(stopped.value) == (
        f"error: task 5 on {socket.gethostname()}: {tasks} tasks, {files} GPUs, and CUDA sees {visible}: run one task "
        "per working GPU (--ntasks-per-node as --gpus-per-node; nvidia-smi)")


@pytest.mark.parametrize("step", ["05_ddp_slurm", "06_ddp_submitit"])
def test_a_job_that_asked_for_no_gpus_is_not_probed_and_trains_on_the_cpu(monkeypatch, tmp_path, step):
    """At a gres site, a CPU job on a GPU node (--gpus-per-node=0: Slurm sets SLURM_GPUS_PER_NODE=0 and no
    SLURM_GPUS_ON_NODE) is not counted by the node's device files: a job that asked Slurm about GPUs has what
    SLURM_GPUS_ON_NODE says (unset: 0). Only a job that asked nothing (no SLURM_GPUS* variable) is probed."""
    module = load_step_module(step)
    for index in range(4):
        (tmp_path / f"nvidia{index}").touch()
    probed, exists = [], module.os.path.exists
    monkeypatch.setattr(module.os.path, "exists", lambda path: probed.append(path) or exists(path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    for name, value in dict(SLURM_GPUS_PER_NODE="0", SLURM_STEP_TASKS_PER_NODE="2(x3)", SLURM_NODEID="2",
                            SLURM_JOB_ID="42", GPU_DEVICES=f"{tmp_path}/nvidia").items():
        monkeypatch.setenv(name, value)
    module.check_launch(5)  # no SystemExit: 2 tasks of a CPU job
    assert not [path for path in probed if path.startswith(f"{tmp_path}/nvidia")]


@pytest.mark.parametrize("step", ["05_ddp_slurm", "06_ddp_submitit"])
def test_a_job_without_gpus_where_cuda_sees_some_ends_with_one_line(monkeypatch, tmp_path, step):
    """A job that has no GPUs (it asked for none) on a node where nothing fences the
    GPUs off (no gres, no ConstrainDevices) would have setup() take cuda:local_rank unchecked: one line instead."""
    module = load_step_module(step)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    for name, value in dict(SLURM_GPUS_PER_NODE="0", SLURM_STEP_TASKS_PER_NODE="2", SLURM_NODEID="0",
                            SLURM_JOB_ID="42").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stopped:
        module.check_launch(1)
    assert str(stopped.value).startswith(f"error: task 1 on {socket.gethostname()}: 2 tasks, 0 GPUs, and CUDA sees "
                                         "2: "), stopped.value
