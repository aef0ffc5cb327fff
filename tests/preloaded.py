"""A Python that has imported torch, and torch._dynamo (which torch.optim imports at its first call), once, and then
forks a process for each script the tests start in it: such a process starts in a tenth of a second of CPU time
instead of three and a half (the imports are most of a short run's cost). conftest.start() uses it for what srun
or a shell would start (05's tasks, 01); launchers under test (mp.spawn, torchrun, submitit) and the data-loader
workers that spawn or forkserver start begin as fresh interpreters, as they would anyway.

The forked process sets what a fresh interpreter would have from its command line and environment before it runs
the script: its own session, working directory, environment, stdin/stdout/stderr, sys.argv, sys.path (the script's
folder and PYTHONPATH's) and a sitecustomize found on PYTHONPATH (the tests' hooks), then the script as __main__,
and exits through the interpreter's normal exit (atexit handlers, exit code of SystemExit). What a fresh process
reads at torch's import (OMP_NUM_THREADS) comes from this server's environment: the tests' own (child_env).

Protocol, over the Unix socket given as fd argv[1]: a request is a pickled (argv, env, cwd) with the child's stdin,
stdout and stderr as three file descriptors (socket.send_fds); the reply a pickled ("started", pid). When a child
ends, a pickled ("ended", pid, returncode, cpu_seconds) follows (returncode as Popen's: -N for signal N)."""
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
import torch._dynamo  # noqa: F401  what the first torch.optim call imports: 1.5 s of a process's start


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
    runpy.run_path(script, run_name="__main__")


def main():
    sock = socket.socket(fileno=int(sys.argv[1]))
    children = {}
    reaped_r, reaped_w = os.pipe()
    os.set_blocking(reaped_w, False)
    signal.set_wakeup_fd(reaped_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() through the wakeup fd
    while True:
        ready = select.select([sock, reaped_r], [], [])[0]
        if reaped_r in ready:
            os.read(reaped_r, 4096)
            while children:
                try:
                    pid, status, usage = os.wait4(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                children.pop(pid, None)
                send(sock, ("ended", pid, -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status),
                            usage.ru_utime + usage.ru_stime))
        if sock in ready:
            header, fds, _, _ = socket.recv_fds(sock, 4, 3)
            if not header:
                return  # the tests' process ended
            size = struct.unpack("!I", header)[0]
            data = b""
            while len(data) < size:
                data += sock.recv(size - len(data))
            argv, env, cwd = pickle.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                sock.close()
                os.close(reaped_r)
                os.close(reaped_w)
                run_child(argv, env, cwd, fds)
                sys.exit(0)
            for fd in fds:
                os.close(fd)
            children[pid] = True
            send(sock, ("started", pid))


if __name__ == "__main__":
    main()
