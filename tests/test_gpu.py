"""Every step on CUDA with NCCL, at the largest power-of-two world size this machine's GPUs allow (marked gpu;
skipped, with the reason, where no CUDA device is present: such a run proves nothing about the GPU path).

TF32 is turned off in every process (a sitecustomize on PYTHONPATH), so that the steps' weights can be
compared with 01's on the same GPU. GPU_TOLERANCE is a first guess, not yet measured on a GPU: the first run
on one prints each step's difference, and the bound should then be set from what it shows."""
import os
import sys

import pytest
import torch

from conftest import SYNTHETIC, Result, child_env, max_abs_diff, run, run_slurm_tasks, submitit_logs, weights

GPUS = torch.cuda.device_count()
WORLD = 1 << (min(GPUS, 16).bit_length() - 1) if GPUS else 0  # a power of two, so that 64 splits evenly
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA device here: the GPU path did not run"),
              pytest.mark.timeout(1800)]  # the first test also waits for the six runs of gpu_runs
GLOBAL_BATCH = 64
GPU_TOLERANCE = 1e-4
NO_TF32 = """
import torch
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
"""


@pytest.fixture(scope="module")
def gpu_env(tmp_path_factory):
    """child_env, in which every process started (05's tasks too) finds the sitecustomize."""
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(NO_TF32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(site), prepend=os.pathsep)  # child_env copies this process's environment
        yield child_env


def run_on_gpus(step, args, folder, env):
    """One step on WORLD GPUs (01: one), with the same global batch as 01."""
    per_process = ["--batch-size", str(GLOBAL_BATCH // WORLD)]
    if step in ("01_single_gpu", "02_dataparallel"):
        return run([sys.executable, f"{step}/train.py", *args, "--batch-size", str(GLOBAL_BATCH)], 600, env=env())
    if step == "03_ddp_mpspawn":
        return run([sys.executable, f"{step}/train.py", "--world-size", str(WORLD), *args, *per_process], 600,
                   env=env())
    if step == "04_ddp_torchrun":
        return run(["bash", f"{step}/run.sh", *args, *per_process], 600, env=env(NPROC_PER_NODE=str(WORLD)))
    if step == "05_ddp_slurm":
        return run_slurm_tasks([*args, *per_process], world_size=WORLD, timeout=600)
    log_dir = folder / "submitit"
    result = run([sys.executable, f"{step}/train.py", "--local", "--tasks-per-node", str(WORLD), "--gpus-per-node",
                  str(WORLD), "--log-dir", str(log_dir), *args, *per_process], 600, env=env())
    return Result(result.returncode, result.output + submitit_logs(log_dir), result.stderr, result.seconds)


STEPS = ["01_single_gpu", "02_dataparallel", "03_ddp_mpspawn", "04_ddp_torchrun", "05_ddp_slurm", "06_ddp_submitit"]


@pytest.fixture(scope="module")
def gpu_runs(gpu_env, tmp_path_factory):
    runs = {}
    for step in STEPS:
        folder = tmp_path_factory.mktemp(step)
        result = run_on_gpus(step, [*SYNTHETIC, "--epochs", "1", "--checkpoint", str(folder / "ckpt.pt")], folder,
                             gpu_env)
        runs[step] = dict(result=result, checkpoint=folder / "ckpt.pt")
    return runs


@pytest.mark.parametrize("step", STEPS)
def test_step_trains_on_the_gpu_like_01(step, gpu_runs):
    result = gpu_runs[step]["result"]
    assert result.returncode == 0, result
    epochs = result.epochs()
    assert len(epochs) == 1 and epochs[0]["acc"] > 50, result
    if step in ("01_single_gpu", "02_dataparallel"):
        assert " device cuda" in result.output, result
        assert step == "01_single_gpu" or f" GPUs {GPUS}" in result.output, result  # DataParallel over all
    else:
        launches = result.launches()  # (rank, world, local rank, host, pid, device, backend, ...)
        assert len(launches) == WORLD and {launch[6] for launch in launches} == {"nccl"}, result
        devices = sorted((launch[5] for launch in launches), key=lambda device: int(device.split(":")[1]))
        assert devices == [f"cuda:{i}" for i in range(WORLD)], result
    diff = max_abs_diff(weights(gpu_runs[step]["checkpoint"]), weights(gpu_runs["01_single_gpu"]["checkpoint"]))
    figures = (f"{step} on {WORLD} of {GPUS} GPU(s): {epochs[0]['samples_per_s']:.0f} samples/s, "
               f"max abs diff to 01 {diff:.2e}")
    print(figures)
    assert diff <= GPU_TOLERANCE, figures


def test_a_gpu_checkpoint_resumes_in_another_step(gpu_env, gpu_runs, tmp_path):
    """01's GPU checkpoint, resumed by 04 for a second epoch, ends where 01 ends after two epochs."""
    checkpoint = tmp_path / "ckpt.pt"
    checkpoint.write_bytes(gpu_runs["01_single_gpu"]["checkpoint"].read_bytes())
    resumed = run_on_gpus("04_ddp_torchrun", [*SYNTHETIC, "--epochs", "2", "--checkpoint", str(checkpoint)],
                          tmp_path, gpu_env)
    assert resumed.returncode == 0 and "resumed from" in resumed.output, resumed
    two = tmp_path / "two.pt"
    straight = run_on_gpus("01_single_gpu", [*SYNTHETIC, "--epochs", "2", "--checkpoint", str(two)], tmp_path, gpu_env)
    assert straight.returncode == 0, straight
    assert max_abs_diff(weights(checkpoint), weights(two)) <= GPU_TOLERANCE
