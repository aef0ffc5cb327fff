"""A stop signal that comes while a task is still importing torch (seconds; tens of seconds from a cold shared
filesystem) waits for the stop handlers instead of ending the task. Each case is a fresh Python (the tests'
preloaded one has torch imported already) whose import hook sends the signal to its own process exactly as
`import torch` begins: 05 as srun or torchrun runs it (__main__), 06 as submitit's task imports it (a module, with
SUBMITIT_FOLDER set). Without the block both died of the signal: srun returned 143, not 144, and nothing requeued."""
import re
import signal
import subprocess
import sys

import pytest

from conftest import REPO, SYNTHETIC, child_env, free_port

# Sends SIG to this process when `import torch` begins, then runs SCRIPT as the task would.
SIGNAL_AT_IMPORT = """
import importlib, os, runpy, signal, sys
class SignalAtTorchImport:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.{sig})
        return None
sys.meta_path.insert(0, SignalAtTorchImport())
{run}
"""
RUN_05 = "sys.argv = {argv!r}\nrunpy.run_path(sys.argv[0], run_name='__main__')"
# 06's task: submitit imports the module to unpickle run(); then run() would catch the pending signal.
IMPORT_06 = ("sys.path.insert(0, '06_ddp_submitit')\nmodule = importlib.import_module('train')\n"
             "print('pending:', sorted(s.name for s in signal.sigpending()))\n"
             "module.catch_stop_signals()\n"  # as run() starts
             "print('received:', signal.Signals(module.stop_signal_received()).name)")


@pytest.mark.parametrize("sig", ["SIGUSR2", "SIGTERM"])
def test_05_saves_and_exits_144_on_a_signal_during_its_imports(tmp_path, sig):
    """Under torchrun's variables (world size 1): the pending signal stops the run at its first check, step 0."""
    argv = ["05_ddp_slurm/train.py", *SYNTHETIC, "--checkpoint", str(tmp_path / "ckpt.pt")]
    code = SIGNAL_AT_IMPORT.format(sig=sig, run=RUN_05.format(argv=argv))
    env = child_env(TORCHELASTIC_RUN_ID="test", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 144, (done.returncode, output)  # it died of the signal: -12 or -15
    assert re.search(rf"^stopped at epoch 1 step 0 on {sig} [\d.]+ s after the signal was seen, saved in [\d.]+ s: exit code 144", output, re.M), output
    assert (tmp_path / "ckpt.pt").exists(), output


def test_06_task_keeps_a_signal_during_its_imports_pending(tmp_path):
    env = child_env(SUBMITIT_FOLDER=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", SIGNAL_AT_IMPORT.format(sig="SIGUSR2", run=IMPORT_06)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "pending: ['SIGUSR2']\nreceived: SIGUSR2\n" in done.stdout, (
        done.returncode, done.stdout, done.stderr)  # what run()'s first stop vote finds
