"""conftest.Task, which forks the processes the tests start from a Python with torch imported (tests/preloaded.py),
behaves as `python script.py` for what the tests rely on: the same output, exit codes and signals as a fresh
process, and, as with Popen, a process that has ended keeps its pid and process group until the test waits for it."""
import os
import signal
import subprocess
import sys
import time

from conftest import Task, child_env

SCRIPT = '''
import os, signal, sys
import torch
print(sys.argv[1:], os.getcwd(), os.environ["TEST_VALUE"], os.environ.get("HOOKED"), __name__, sys.path[0],
      os.getsid(0) == os.getpid(), sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])), torch.get_num_threads(),
      [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2, signal.SIGCHLD)], flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGTERM)
if sys.argv[1] == "raise":
    raise ValueError("raised")
sys.exit(f"error: {sys.argv[1]}")
'''


def test_a_task_is_a_fresh_python(tmp_path):
    """The same script, started by Popen and as a Task, prints the same (its arguments, working folder, environment,
    the sitecustomize's hook, __main__, its own session, no signal blocked or handled, one thread) and ends alike:
    sys.exit('message'), an uncaught exception (its traceback), death by SIGTERM."""
    script, site, work = tmp_path / "train.py", tmp_path / "site", tmp_path / "work"
    script.write_text(SCRIPT)
    site.mkdir()
    work.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['HOOKED'] = 'yes'\n")
    env = child_env(PYTHONPATH=str(site), TEST_VALUE="42")
    for case in ("exit", "raise", "kill"):
        fresh = subprocess.Popen([sys.executable, str(script), case], cwd=work, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
        task = Task([script, case], env, work)
        assert isinstance(task, Task)
        results = [(proc.communicate(timeout=60), proc.returncode) for proc in (fresh, task)]
        assert results[0] == results[1], results
    assert results[0][1] == -signal.SIGTERM


def test_an_ended_task_keeps_its_pid_until_waited_for(tmp_path):
    """As with Popen: a test may signal the process group of a task that has ended but that it has not waited for
    (finish_all kills every task's group when one hangs), and the pid is not reused meanwhile."""
    script = tmp_path / "train.py"
    script.write_text("print('done', flush=True)\n")
    task = Task([script], child_env(), tmp_path)
    assert task.stdout.readline() == "done\n"
    while not os.path.exists(f"/proc/{task.pid}/stat") or open(f"/proc/{task.pid}/stat").read().split()[2] != "Z":
        time.sleep(0.05)  # a zombie: ended, not collected
    os.killpg(task.pid, signal.SIGKILL)  # no ProcessLookupError
    assert task.wait(60) == 0
    assert not os.path.exists(f"/proc/{task.pid}/stat") or open(f"/proc/{task.pid}/stat").read().split()[2] != "Z"


def test_a_task_whose_start_up_environment_differs_starts_fresh(tmp_path):
    """A variable that Python or torch reads at its start (here OMP_NUM_THREADS) that differs from the preloaded
    Python's gives a fresh process: a forked one would keep the server's."""
    task = Task([tmp_path / "train.py"], child_env(OMP_NUM_THREADS="2"), tmp_path)
    assert isinstance(task, subprocess.Popen)
    task.communicate(timeout=60)
