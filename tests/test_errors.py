"""Wrong launches and bad arguments end at once, with a clear one-line error and a non-zero exit. Bad arguments are
checked by each step's own parse_args in this process (argparse prints the line and exits 2); the wrong launches,
and one bad argument, by running the script as a user would."""
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import STEPS, child_env, load_step_module, run

PY = sys.executable
NO_SLURM = {name: "" for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_JOB_ID")}
SRUN_TASK = dict(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="2", SLURM_STEP_ID="0", SLURM_JOB_ID="1")
FAKE_SLURM = Path(tempfile.mkdtemp(prefix="fake-slurm-"))  # an `srun` on the PATH: submitit then picks Slurm
(FAKE_SLURM / "srun").write_text("#!/bin/sh\nexit 1\n")
(FAKE_SLURM / "srun").chmod(0o755)
ON_A_LOGIN_NODE = {"PATH": f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}"}

# (what is wrong, step, its arguments, the flag the one error line must name)
BAD_ARGUMENTS = [
    *[(f"{step} --epochs 0", step, ["--epochs", "0"], "--epochs") for step in STEPS],
    ("--lr -1", "01_single_gpu", ["--lr", "-1"], "--lr"),
    ("--collective-timeout nan", "05_ddp_slurm", ["--collective-timeout", "nan"], "--collective-timeout"),
    ("--collective-timeout inf", "04_ddp_torchrun", ["--collective-timeout", "inf"], "--collective-timeout"),
    ("--batch-size x", "02_dataparallel", ["--batch-size", "x"], "--batch-size"),
    ("--test-batch-size 0", "05_ddp_slurm", ["--test-batch-size", "0"], "--test-batch-size"),
    ("--save-every -1", "06_ddp_submitit", ["--save-every", "-1"], "--save-every"),
    ("--dataset imagenet", "01_single_gpu", ["--dataset", "imagenet"], "--dataset"),
    ("--world-size 0", "03_ddp_mpspawn", ["--world-size", "0"], "--world-size"),
    ("--nodes 0", "06_ddp_submitit", ["--nodes", "0"], "--nodes"),
    ("--workers -1", "06_ddp_submitit", ["--local", "--workers", "-1"], "--workers"),  # its default: None
    ("--local on 2 nodes", "06_ddp_submitit", ["--local", "--nodes", "2"], "--local"),
    ("--accumulate 0", "03_ddp_mpspawn", ["--accumulate", "0"], "--accumulate"),  # before mp.spawn: exit 2 too
    ("--warmup 1 (the whole run)", "05_ddp_slurm", ["--warmup", "1"], "--warmup"),
    ("--warmup -0.1", "01_single_gpu", ["--warmup", "-0.1"], "--warmup"),
    ("--clip-grad -1", "04_ddp_torchrun", ["--clip-grad", "-1"], "--clip-grad"),
]


@pytest.mark.parametrize("case", BAD_ARGUMENTS, ids=[case[0] for case in BAD_ARGUMENTS])
def test_bad_arguments_give_one_line(case, monkeypatch, capsys):
    _, step, argv, flag = case
    module = load_step_module(step)
    monkeypatch.setattr(sys, "argv", [f"{step}/train.py", *argv])
    with pytest.raises(SystemExit) as exited:
        module.parse_args()
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert exited.value.code == 2 and len(errors) == 1 and flag in errors[0], err


# (what is wrong, command, extra environment, exit code, text the one error line must hold)
WRONG_LAUNCHES = [
    ("01 --epochs 0, as a user runs it", [PY, "01_single_gpu/train.py", "--epochs", "0"], {}, 2, "--epochs"),
    ("06 on Slurm without --gpus-per-node", [PY, "06_ddp_submitit/train.py", "--nodes", "2"], ON_A_LOGIN_NODE, 2,
     "--gpus-per-node"),
    ("04 without torchrun", [PY, "04_ddp_torchrun/train.py"], {"LOCAL_RANK": ""}, 1, "torchrun"),
    ("05 without srun", [PY, "05_ddp_slurm/train.py"], NO_SLURM, 1, "sbatch 05_ddp_slurm/submit.sh"),
    ("05 without MASTER_ADDR", [PY, "05_ddp_slurm/train.py"], {**SRUN_TASK, "MASTER_ADDR": ""}, 1, "submit.sh"),
]


def launch(case):
    _, cmd, extra, _, _ = case
    env = child_env(**extra)
    for name in [name for name, value in extra.items() if value == ""]:
        del env[name]  # "" marks a variable that must be absent
    return run(cmd, timeout=60, env=env)


@pytest.fixture(scope="session")
def results(shared):
    """Every wrong launch once, whichever pytest-xdist worker asks first."""
    def compute(folder):
        with ThreadPoolExecutor(2) as pool:  # two at a time: each is mostly torch's import
            return dict(zip([case[0] for case in WRONG_LAUNCHES], pool.map(launch, WRONG_LAUNCHES)))
    return shared("wrong-launches", compute)


@pytest.mark.parametrize("case", WRONG_LAUNCHES, ids=[case[0] for case in WRONG_LAUNCHES])
def test_clear_one_line_error(results, case):
    name, _, _, code, must_hold = case
    result = results[name]
    assert result.returncode == code, result
    assert "Traceback" not in result.stderr, result
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and must_hold in errors[0], result
    assert result.seconds < 30, result
