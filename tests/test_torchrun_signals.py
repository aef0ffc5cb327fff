"""What torchrun's agent does with the signals a cluster sends it (what 04_ddp_torchrun/submit.sh and the
README say): SIGTERM it passes on to its workers, SIGKILLs those still running after --shutdown-timeout and
exits without a restart; SIGUSR2 it does not catch, so it dies of it at once and its workers get nothing.
The worker is a few lines without torch, so that each case takes about two seconds."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, child_env, read_line

WORKER = """
import os, signal, time
signal.signal(signal.SIGTERM, lambda *_: print("worker got SIGTERM", flush=True))  # and goes on running
signal.signal(signal.SIGUSR2, lambda *_: print("worker got SIGUSR2", flush=True))
print(f"worker {os.getpid()} ready", flush=True)
while True:
    time.sleep(0.1)
"""
SHUTDOWN_TIMEOUT = 2  # torchrun's default is 30 s


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2], ids=["SIGTERM", "SIGUSR2"])
def test_torchrun_agent_on_a_signal(tmp_path, sig):
    (tmp_path / "worker.py").write_text(WORKER)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                             "--max-restarts=3", f"--shutdown-timeout={SHUTDOWN_TIMEOUT}", str(tmp_path / "worker.py")],
                            cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline, lines = time.monotonic() + 60, []
    while not (ready := re.search(r"worker (\d+) ready", "".join(lines))):
        lines.append(read_line(proc, deadline))
        assert lines[-1], "".join(lines)  # torchrun ended before its worker was ready
    worker = int(ready.group(1))
    os.kill(proc.pid, sig)  # the agent only: torchrun starts each worker in a session of its own
    signalled = time.monotonic()
    try:
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"torchrun still running 30 s after {sig.name}")
        seconds = time.monotonic() - signalled
        worker_alive = alive(worker)
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)  # after SIGUSR2 it is an orphan that holds the pipe open
    output = "".join(lines) + proc.stdout.read()
    if sig == signal.SIGTERM:
        assert code == 1 and "worker got SIGTERM" in output, output  # passed on, then SignalException
        assert SHUTDOWN_TIMEOUT <= seconds < SHUTDOWN_TIMEOUT + 10 and not worker_alive, output  # SIGKILL after it
    else:
        assert code == -signal.SIGUSR2 and seconds < SHUTDOWN_TIMEOUT, output  # killed at once: no handler
        assert "worker got" not in output and worker_alive, output  # the worker left running, untouched
    assert output.count("ready") == 1, output  # no restart, whatever --max-restarts says
