"""Every step on CUDA with NCCL, at the largest power-of-two world size this machine's GPUs allow (marked gpu;
skipped, with the reason, where no CUDA device is present: such a run proves nothing about the GPU path); 05 stopped
and resumed on the GPU; checkpoints moved between the GPU and the CPU; the memory a resume takes on the GPU.

TF32 is turned off in every process (a sitecustomize on PYTHONPATH), so that the steps' weights can be
compared with 01's on the same GPU. GPU_TOLERANCE: on one H200 (2026-11-26) the steps differed from 01 by at
most 6e-8 and a checkpoint moved between the CPU and the GPU by 4.5e-7; 1e-5, the CPU tests' bound, leaves room
for NCCL's reduction order across several GPUs, which one GPU cannot show."""
import os
import re
import sys

import pytest
import torch

from conftest import (SYNTHETIC, Result, child_env, max_abs_diff, run, run_slurm_tasks, submitit_logs, weights)
from test_preemption import REQUEUE_CODE, SITECUSTOMIZE, STEP_CLOCK, STOPPED, finish_all, start_05

GPUS = torch.cuda.device_count()
WORLD = 1 << (min(GPUS, 16).bit_length() - 1) if GPUS else 0  # a power of two, so that 64 splits evenly
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA device here: the GPU path did not run"),
              pytest.mark.timeout(1800)]  # the first test also waits for the six runs of gpu_runs
GLOBAL_BATCH = 64
GPU_TOLERANCE = 1e-5
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


@pytest.fixture(scope="module")
def two_epochs(gpu_env, tmp_path_factory):
    """01 for two epochs on the GPU, uninterrupted: the weights that every resumed run must end with."""
    folder = tmp_path_factory.mktemp("two_epochs")
    result = run_on_gpus("01_single_gpu", [*SYNTHETIC, "--epochs", "2", "--checkpoint", str(folder / "ckpt.pt")],
                         folder, gpu_env)
    assert result.returncode == 0, result
    return folder / "ckpt.pt"


def test_a_gpu_checkpoint_resumes_in_another_step(gpu_env, gpu_runs, two_epochs, tmp_path):
    """01's GPU checkpoint, resumed by 04 for a second epoch, ends where 01 ends after two epochs."""
    checkpoint = tmp_path / "ckpt.pt"
    checkpoint.write_bytes(gpu_runs["01_single_gpu"]["checkpoint"].read_bytes())
    resumed = run_on_gpus("04_ddp_torchrun", [*SYNTHETIC, "--epochs", "2", "--checkpoint", str(checkpoint)],
                          tmp_path, gpu_env)
    assert resumed.returncode == 0 and "resumed from" in resumed.output, resumed
    diff = max_abs_diff(weights(checkpoint), weights(two_epochs))
    print(f"01's GPU checkpoint resumed by 04 on the GPU: max abs diff to 01 for two epochs {diff:.2e}")
    assert diff <= GPU_TOLERANCE


# At the Nth optimizer step of the process, the signal to every process of its task (its process group: the
# tests start each task in a session of its own), data-loader workers and their forkserver included, as Slurm
# signals a task: a stop at a step the test chooses, whatever the machine's speed.
SIGNAL_AT_STEP = """
if os.environ.get("TEST_SIGNAL_AT_STEP"):  # "N:SIGNAME"
    import signal
    nth, name = os.environ["TEST_SIGNAL_AT_STEP"].split(":")
    sgd_step, sgd_steps = torch.optim.SGD.step, [0]  # names of their own: the sitecustomize is one module
    def signalling_step(self, *args, **kwargs):
        sgd_steps[0] += 1
        if sgd_steps[0] == int(nth):
            os.killpg(os.getpgrp(), getattr(signal, name))
        return sgd_step(self, *args, **kwargs)
    torch.optim.SGD.step = signalling_step
"""


@pytest.fixture(scope="module")
def task_env(tmp_path_factory):
    """env(**extra) for 05's tasks on the GPU: TF32 off, the preemption tests' hooks (a start method for the
    data-loader workers) and SIGNAL_AT_STEP."""
    site = tmp_path_factory.mktemp("task_site")
    (site / "sitecustomize.py").write_text(NO_TF32 + SITECUSTOMIZE + SIGNAL_AT_STEP)
    return lambda **extra: child_env(PYTHONPATH=str(site), TEST_START_METHOD="forkserver", TEST_STEP_CLOCK=STEP_CLOCK,
                                     **extra)  # the step clock


TRAIN_05 = [*SYNTHETIC[:2], "--batch-size", str(GLOBAL_BATCH), "--workers", "2", "--epochs", "2"]


@pytest.fixture(scope="module")
def stopped_on_the_gpu(task_env, tmp_path_factory):
    """05 as srun starts one task on the GPU (NCCL), with two data-loader workers started by forkserver (Python
    3.14's default), signalled at its 55th step (epoch 2, step 5) with SIGUSR2 (the time-limit warning) or SIGTERM
    (a preemption), then resumed; and the same run uninterrupted."""
    folder = tmp_path_factory.mktemp("stopped")
    runs = {}
    for name in ("SIGUSR2", "SIGTERM", None):
        checkpoint = folder / f"{name}.pt"
        procs = start_05([*TRAIN_05, "--checkpoint", str(checkpoint)],
                         lambda **kw: task_env(**kw, **({"TEST_SIGNAL_AT_STEP": f"55:{name}"} if name else {})),
                         world_size=1)
        codes, stopped = finish_all(procs, timeout=300)
        mid_epoch = folder / f"{name}-mid-epoch.pt"
        if name:
            mid_epoch.write_bytes(checkpoint.read_bytes())
            codes_resumed, resumed = finish_all(start_05([*TRAIN_05, "--checkpoint", str(checkpoint)], task_env,
                                                         world_size=1), timeout=300)
        else:
            codes_resumed, resumed = codes, ""
        runs[name] = dict(codes=codes, stopped=stopped, codes_resumed=codes_resumed, resumed=resumed,
                          checkpoint=checkpoint, mid_epoch=mid_epoch)
    return runs


@pytest.mark.parametrize("name", ["SIGUSR2", "SIGTERM"])
def test_05_on_the_gpu_stops_inside_an_epoch_and_resumes_like_an_uninterrupted_run(name, stopped_on_the_gpu):
    run_ = stopped_on_the_gpu[name]
    stopped = STOPPED.search(run_["stopped"])
    assert run_["codes"] == [REQUEUE_CODE] and stopped, run_["stopped"]
    assert "device cuda:0 backend nccl" in run_["stopped"], run_["stopped"]
    assert "killed by signal" not in run_["stopped"] and "Traceback" not in run_["stopped"], run_["stopped"]
    step = int(stopped.group(2))
    assert stopped.group(1) == "2" and step == 5 and stopped.group(3) == name, run_["stopped"]  # the next check
    assert torch.load(run_["mid_epoch"], map_location="cpu")["step"] == step
    assert run_["codes_resumed"] == [0] and f"at epoch 2 step {step}" in run_["resumed"], run_["resumed"]
    uninterrupted = stopped_on_the_gpu[None]
    assert uninterrupted["codes"] == [0], uninterrupted["stopped"]
    diff = max_abs_diff(weights(run_["checkpoint"]), weights(uninterrupted["checkpoint"]))
    print(f"05 on the GPU stopped by {name} at epoch 2 step {step}, resumed: max abs diff to uninterrupted {diff:.2e}")
    assert diff <= GPU_TOLERANCE


def test_checkpoints_move_between_the_gpu_and_the_cpu(gpu_env, stopped_on_the_gpu, two_epochs, tmp_path):
    """05's mid-epoch checkpoint written on the GPU resumes on the CPU (CUDA_VISIBLE_DEVICES empty, Gloo), and 01's
    written on the CPU resumes on the GPU in 05: both end within GPU_TOLERANCE of the uninterrupted GPU run."""
    on_cpu = tmp_path / "on_cpu.pt"
    on_cpu.write_bytes(stopped_on_the_gpu["SIGTERM"]["mid_epoch"].read_bytes())
    # A CPU job on a GPU node says so with CUDA_VISIBLE_DEVICES= (05's check_launch counts no GPU then).
    resumed = run_slurm_tasks([*TRAIN_05, "--checkpoint", str(on_cpu)], world_size=1, timeout=300,
                              CUDA_VISIBLE_DEVICES="")
    assert resumed.returncode == 0 and "device cpu backend gloo" in resumed.output, resumed
    assert "at epoch 2 step " in resumed.output, resumed
    from_cpu = tmp_path / "from_cpu.pt"
    first = run([sys.executable, "01_single_gpu/train.py", *SYNTHETIC, "--epochs", "1", "--checkpoint",
                 str(from_cpu)], 300, env=gpu_env(CUDA_VISIBLE_DEVICES=""))
    assert first.returncode == 0 and " device cpu" in first.output, first
    on_gpu = run_slurm_tasks([*SYNTHETIC, "--epochs", "2", "--checkpoint", str(from_cpu)], world_size=1,
                             timeout=300)
    assert on_gpu.returncode == 0 and "device cuda:0 backend nccl" in on_gpu.output, on_gpu
    diffs = [max_abs_diff(weights(path), weights(two_epochs)) for path in (on_cpu, from_cpu)]
    print(f"GPU checkpoint resumed on the CPU: {diffs[0]:.2e}; CPU checkpoint resumed on the GPU: {diffs[1]:.2e} "
          "(max abs diff to two epochs on the GPU)")
    assert max(diffs) <= GPU_TOLERANCE


GPU_MEMORY = """
import os, torch
if os.environ.get("TEST_MEMORY"):
    def _vm(field):
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) // 1024 for line in status if line.startswith(field + ":"))
    _init, _load = torch.optim.SGD.__init__, torch.optim.Optimizer.load_state_dict
    def init(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self._before = _vm("VmRSS"), torch.cuda.memory_allocated() // 2**20
        torch.cuda.reset_peak_memory_stats()
    def load_state_dict(self, *args, **kwargs):
        _load(self, *args, **kwargs)
        os.write(1, (f"memory: host {self._before[0]} MB before the resume, peak {_vm('VmHWM')} MB; GPU "
                     f"{self._before[1]} MB before, peak {torch.cuda.max_memory_allocated() // 2**20} MB\\n").encode())
    torch.optim.SGD.__init__, torch.optim.Optimizer.load_state_dict = init, load_state_dict
"""


def test_a_resume_on_the_gpu_holds_at_most_one_copy_of_the_state(tmp_path):
    """test_checkpoint.py's resume of a 537 MB state (weights and momentum), on the GPU: 03 copied with a wide model,
    one rank. The host's resident memory grows by at most one copy of the state and the GPU's by the momentum alone
    (the weights are there before): no second copy of the state on either."""
    from test_checkpoint import wide_03
    state_mb = wide_03(tmp_path, GPU_MEMORY)
    result = run([sys.executable, "03_ddp_mpspawn/train.py", "--world-size", "1", "--dataset", "synthetic",
                  "--epochs", "1", "--checkpoint", str(tmp_path / "ckpt.pt")], timeout=300, cwd=tmp_path,
                 env=child_env(PYTHONPATH=str(tmp_path / "site"), TEST_MEMORY="1"))
    assert result.returncode == 0 and "resumed from" in result.output and "device cuda:0" in result.output, result
    figures = re.search(r"memory: host (\d+) MB before the resume, peak (\d+) MB; GPU (\d+) MB before, peak (\d+) MB",
                        result.output)
    assert figures, result
    host_before, host_peak, gpu_before, gpu_peak = map(int, figures.groups())
    print(f"state {state_mb:.0f} MB; host {host_before} -> peak {host_peak} MB, GPU {gpu_before} -> peak {gpu_peak} MB")
    assert host_peak - host_before <= state_mb + state_mb / 2 + 64, figures.group(0)
    assert gpu_peak - gpu_before <= state_mb / 2 + 64, figures.group(0)


@pytest.fixture(scope="module")
def accumulated_on_the_gpu(tmp_path_factory):
    """05 as srun starts one task on the GPU, --amp, 4 micro-batches of 16 a step, warm-up + cosine, one epoch: with
    SIGTERM to itself in the second micro-batch of step 21 (forward 82), then resumed; and uninterrupted."""
    from test_accumulation import HOOKS
    folder = tmp_path_factory.mktemp("accumulated")
    (folder / "site").mkdir()
    (folder / "site" / "sitecustomize.py").write_text(NO_TF32 + SITECUSTOMIZE + HOOKS)
    args = [*SYNTHETIC, "--batch-size", "16", "--accumulate", "4", "--warmup", "0.1", "--cosine", "--amp", "--epochs",
            "1"]
    runs = {}
    for name, extra in (("stopped", {"TEST_SIGNAL_AT_FORWARD": "82"}), ("uninterrupted", {})):
        env = lambda **kw: child_env(PYTHONPATH=str(folder / "site"), TEST_STEP_CLOCK=STEP_CLOCK,  # noqa: E731
                                     TEST_DTYPE_LOG=str(folder / f"{name}.dtypes"), **kw, **extra)
        checkpoint = folder / f"{name}.pt"
        codes, output = finish_all(start_05([*args, "--checkpoint", str(checkpoint)], env, world_size=1), timeout=300)
        runs[name] = dict(codes=codes, output=output, checkpoint=checkpoint, dtypes=folder / f"{name}.dtypes")
        if name == "stopped":
            runs[name]["step"] = torch.load(checkpoint, map_location="cpu")["step"]
            runs[name]["resumed"] = finish_all(start_05([*args, "--checkpoint", str(checkpoint)],
                                                        lambda **kw: child_env(PYTHONPATH=str(folder / "site"), **kw),
                                                        world_size=1), timeout=300)
    return runs


def test_05_on_the_gpu_in_bf16_stops_between_micro_batches_on_the_next_step_and_resumes(accumulated_on_the_gpu):
    """On CUDA: --amp computes the Linear layers in bf16; SIGTERM between two micro-batches of step 21 stops the
    run after that step, and the resumed run ends like the uninterrupted one."""
    stopped, uninterrupted = accumulated_on_the_gpu["stopped"], accumulated_on_the_gpu["uninterrupted"]
    assert "device cuda:0 backend nccl" in stopped["output"], stopped["output"]
    assert stopped["codes"] == [REQUEUE_CODE] and STOPPED.findall(stopped["output"]) == [("1", "21", "SIGTERM")], \
        stopped["output"]
    assert stopped["step"] == 21
    codes, resumed = stopped["resumed"]
    assert codes == [0] and "at epoch 1 step 21" in resumed, resumed
    assert uninterrupted["codes"] == [0], uninterrupted["output"]
    assert stopped["dtypes"].read_text().split() == ["0", "torch.bfloat16"]
    diff = max_abs_diff(weights(stopped["checkpoint"]), weights(uninterrupted["checkpoint"]))
    print(f"05 on the GPU, bf16, stopped between two micro-batches of step 21, resumed: max abs diff {diff:.2e}")
    assert diff <= GPU_TOLERANCE
