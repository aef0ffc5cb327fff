"""A Python that has imported torch, and torch._dynamo (which an optimizer or DDP imports as it is built), once, and
then forks a process for each script the tests start in it: such a process starts in a tenth of a second of CPU time
instead of three and a half (the imports are most of a short run's cost). conftest.run() and conftest.Task use it
for `python script.py` (01, 02, 03's and 06's launchers, 05's tasks as srun starts them, copies of 05); the
children of launchers (mp.spawn, torchrun, submitit), the data-loader workers that spawn or forkserver start, and
every process of a Slurm job begin as fresh interpreters, as they would anyway.

The forked process sets what a fresh interpreter would have from its command line and environment before it runs
the script: its own session, working directory, environment, stdin/stdout/stderr, sys.argv, sys.path (the script's
folder and PYTHONPATH's) and a sitecustomize found on PYTHONPATH (the tests' hooks; an error there ends the
process, where a fresh Python would print it and go on), then the script as __main__, and exits through the
interpreter's normal exit (atexit handlers, SystemExit's code). What differs: the variables a fresh Python or torch
reads at its start (PYTHON*, *_NUM_THREADS) come from this server's environment, so conftest.Task starts a fresh
process where a task's differ; and the forked processes share this one's hash seed (str hashes, set order) and
NumPy's random state, where srun's tasks each have their own. TESTS_FRESH_PROCESSES=1 makes every Task a fresh
process, to tell a difference of this kind from a bug.

Protocol, over the Unix socket given as fd argv[1], each message a length and a pickle: ("start", argv, env, cwd)
with the child's stdin, stdout and stderr as three file descriptors (socket.send_fds), answered ("started", pid);
when a child ends, ("ended", pid, returncode) (as Popen's: -N for signal N), and it stays a zombie, as a Popen's
child does until waited for, so that its pid is not reused and its process group still found; ("release", pid)
collects it, answered ("released", pid, its CPU seconds and those of the children it waited for)."""
import importlib.util
import os
import pickle
import runpy
import select
import signal
import socket
import struct
import sys

import torch
import torch._dynamo  # noqa: F401  what building an optimizer or DDP imports: 1.5 s of a process's start


def send(sock, message):
    data = pickle.dumps(message)
    sock.sendall(struct.pack("!I", len(data)) + data)


def run_child(argv, env, cwd, fds):
    """In the forked process: become what `python argv...` started with env in cwd would be, and run it."""
    os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    script = os.path.abspath(argv[0])
    extra = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    sys.path[:] = [os.path.dirname(script), *extra, *sys.path[1:]]
    sys.argv = [argv[0], *argv[1:]]
    for folder in extra:  # as site does at a start: the first sitecustomize on the path, imported (sys.argv kept)
        if os.path.exists(os.path.join(folder, "sitecustomize.py")):
            spec = importlib.util.spec_from_file_location("sitecustomize", os.path.join(folder, "sitecustomize.py"))
            sys.modules["sitecustomize"] = module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            break
    try:
        runpy.run_path(script, run_name="__main__")
    except Exception as error:  # printed as Python prints it, from the script's frames on (not this server's), exit 1
        frames = error.__traceback__
        while frames and frames.tb_frame.f_code.co_filename != script:
            frames = frames.tb_next
        error.with_traceback(frames or error.__traceback__)
        sys.excepthook(type(error), error, error.__traceback__)
        sys.exit(1)


def main():
    sock = socket.socket(fileno=int(sys.argv[1]))
    running = set()  # children whose exit this server has not reported yet
    woken_r, woken_w = os.pipe()
    os.set_blocking(woken_w, False)
    signal.set_wakeup_fd(woken_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() through the wakeup fd
    while True:
        ready = select.select([sock, woken_r], [], [])[0]
        if woken_r in ready:
            os.read(woken_r, 4096)
            for pid in list(running):  # an exit is reported but not collected (WNOWAIT): as with Popen, the process
                ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # stays until the test waits
                if ended:  # for it (its pid and process group stay its own: killpg() still finds it)
                    running.discard(pid)
                    exited = ended.si_code == os.CLD_EXITED
                    send(sock, ("ended", pid, ended.si_status if exited else -ended.si_status))
        if sock in ready:
            header, fds, _, _ = socket.recv_fds(sock, 4, 3)
            if not header:
                return  # the tests' process ended
            size = struct.unpack("!I", header)[0]
            data = b""
            while len(data) < size:
                data += sock.recv(size - len(data))
            request = pickle.loads(data)
            if request[0] == "release":  # the test has its exit code: collect it, with its CPU time
                _, _, usage = os.wait4(request[1], 0)
                send(sock, ("released", request[1], usage.ru_utime + usage.ru_stime))
                continue
            _, argv, env, cwd = request
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                sock.close()
                os.close(woken_r)
                os.close(woken_w)
                run_child(argv, env, cwd, fds)
                sys.exit(0)
            for fd in fds:
                os.close(fd)
            running.add(pid)
            send(sock, ("started", pid))


if __name__ == "__main__":
    main()
