"""Wrong launches and bad arguments end at once, with a clear one-line error and a non-zero exit."""
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import STEPS, child_env, run

PY = sys.executable
NO_SLURM = {name: "" for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_JOB_ID")}
SRUN_TASK = dict(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="2", SLURM_STEP_ID="0", SLURM_JOB_ID="1")
FAKE_SLURM = Path(tempfile.mkdtemp(prefix="fake-slurm-"))  # an `srun` on the PATH: submitit then picks Slurm
(FAKE_SLURM / "srun").write_text("#!/bin/sh\nexit 1\n")
(FAKE_SLURM / "srun").chmod(0o755)
ON_A_LOGIN_NODE = {"PATH": f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}"}

# (what is wrong, command, extra environment, exit code, text the one error line must hold)
CASES = [
    *[(f"{step} --epochs 0", [PY, f"{step}/train.py", "--epochs", "0"], {}, 2, "--epochs") for step in STEPS],
    ("--lr -1", [PY, "01_single_gpu/train.py", "--lr", "-1"], {}, 2, "--lr"),
    ("--batch-size x", [PY, "02_dataparallel/train.py", "--batch-size", "x"], {}, 2, "--batch-size"),
    ("--dataset imagenet", [PY, "01_single_gpu/train.py", "--dataset", "imagenet"], {}, 2, "--dataset"),
    ("--world-size 0", [PY, "03_ddp_mpspawn/train.py", "--world-size", "0"], {}, 2, "--world-size"),
    ("--nodes 0", [PY, "06_ddp_submitit/train.py", "--nodes", "0"], {}, 2, "--nodes"),
    ("--local on 2 nodes", [PY, "06_ddp_submitit/train.py", "--local", "--nodes", "2"], {}, 2, "--local"),
    ("06 on Slurm without --gpus-per-node", [PY, "06_ddp_submitit/train.py", "--nodes", "2"], ON_A_LOGIN_NODE, 2,
     "--gpus-per-node"),
    ("04 without torchrun", [PY, "04_ddp_torchrun/train.py"], {"LOCAL_RANK": ""}, 1, "torchrun"),
    ("05 without srun", [PY, "05_ddp_slurm/train.py"], NO_SLURM, 1, "srun"),
    ("05 without MASTER_ADDR", [PY, "05_ddp_slurm/train.py"], {**SRUN_TASK, "MASTER_ADDR": ""}, 1, "submit.sh"),
]


def launch(case):
    _, cmd, extra, _, _ = case
    env = child_env(**extra)
    for name in [name for name, value in extra.items() if value == ""]:
        del env[name]  # "" marks a variable that must be absent
    return run(cmd, timeout=60, env=env)


@pytest.fixture(scope="module")
def results():
    with ThreadPoolExecutor(2) as pool:  # two at a time: each is mostly torch's import
        return dict(zip([case[0] for case in CASES], pool.map(launch, CASES)))


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_clear_one_line_error(results, case):
    name, _, _, code, must_hold = case
    result = results[name]
    assert result.returncode == code, result
    assert "Traceback" not in result.stderr, result
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and must_hold in errors[0], result
    assert result.seconds < 30, result
