"""Helpers for the tests: start each step the way its launcher would, on the CPU with Gloo, read
what it printed and compare the weights in its checkpoints. Every process has a time limit."""
import importlib.util
import os
import pickle
import re
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from argparse import Namespace
from datetime import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from filelock import FileLock

# What the tests train in their own process (parse_args and train called here) runs on one thread, as every process
# they start does (child_env): four pytest-xdist workers share two cores, and two threads each would spin-wait on
# each other's cores (a third of the CPU time of such a run is its one thread's).
torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent
STEPS = ["01_single_gpu", "02_dataparallel", "03_ddp_mpspawn", "04_ddp_torchrun", "05_ddp_slurm", "06_ddp_submitit"]
SYNTHETIC = ["--dataset", "synthetic", "--workers", "0"]
GLOBAL_BATCH = 64  # the same in every step: 64 in one process, 2 x 32 with two ranks
STEPS_PER_EPOCH = 50  # the synthetic set's 3200 training samples in steps of the global batch
TEST_SAMPLES = 800  # its test set
TOLERANCE = 1e-5  # max abs difference between weights that the steps must meet
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+) \| train loss ([\d.]+) \| test loss ([\d.]+) \| test accuracy ([\d.]+) of "
                        r"(\d+) \| (\d+) samples/s \| ([\d.]+) s$", re.M)
LAUNCH_LINE = re.compile(r"^rank (\d+)/(\d+) local_rank (\d+) host (\S+) pid (\d+) device (\S+) backend (\S+) "
                         r"(?:cores \d+ )?master (\S+):(\d+)$", re.M)  # 05 on: the task's cores


def child_env(**extra):
    """The environment of every process the tests start: one thread each (two ranks share two cores)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.update(extra)
    return env


class Result:
    def __init__(self, returncode, output, stderr, seconds):
        self.returncode, self.output, self.stderr, self.seconds = returncode, output, stderr, seconds

    def epochs(self):
        """The epoch lines as dicts of numbers."""
        keys = ("epoch", "epochs", "loss", "test_loss", "accuracy", "total", "samples_per_s", "seconds")
        epochs = [dict(zip(keys, map(float, m.groups()))) for m in EPOCH_LINE.finditer(self.output)]
        for epoch in epochs:  # the test accuracy in percent, and as the number of test samples right
            epoch.update(acc=100 * epoch["accuracy"], correct=round(epoch["accuracy"] * epoch["total"]))
        return epochs

    def launches(self):
        return [m.groups() for m in LAUNCH_LINE.finditer(self.output)]

    def __repr__(self):
        return (f"exit {self.returncode} after {self.seconds:.1f} s\n--- output\n{self.output}\n"
                f"--- stderr\n{self.stderr}")


def run(cmd, timeout=120, env=None, cwd=REPO):
    """Runs cmd in a session of its own (a Python script in the preloaded Python: Task); past timeout the whole
    session is killed and the test fails."""
    start = time.monotonic()
    if cmd[0] == sys.executable and str(cmd[1]).endswith(".py"):  # `python script.py ...`: in the preloaded Python
        proc = Task(cmd[1:], env or child_env(), cwd)
    else:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env or child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {cmd}\n{out}\n{err}")
    return Result(proc.returncode, out, err, time.monotonic() - start)


def server_env():
    """The preloaded Python's environment: the tests' own (child_env), without PYTHONPATH (a sitecustomize there would
    run in the server and stay in every process it forks)."""
    env = child_env()
    env.pop("PYTHONPATH", None)
    return env


def read_at_start(env):
    """What a fresh Python, or torch at its import, reads from its environment (the server read its own)."""
    return {name: value for name, value in env.items()
            if name.startswith("PYTHON") and name not in ("PYTHON", "PYTHONPATH") or name.endswith("_NUM_THREADS")}


class Preloaded:
    """The client of tests/preloaded.py: a Python with torch imported that forks a process for each script (one
    server per pytest process, started at its first use; its stderr in preloaded-PID.log under the temporary folder)."""
    server = None
    cpu = 0.0  # CPU seconds of the processes it ran that the tests have waited for (their waited children included)

    def __init__(self):
        ours, theirs = socket.socketpair()
        self.log = Path(tempfile.gettempdir()) / f"preloaded-{os.getpid()}.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, str(REPO / "tests" / "preloaded.py"), str(theirs.fileno())],
                                            pass_fds=[theirs.fileno()], env=server_env(), stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=log)
        theirs.close()
        self.sock, self.ended, self.lock = ours, {}, threading.Lock()

    @classmethod
    def get(cls):
        if cls.server is None or cls.server.process.poll() is not None:
            cls.server = cls()
        return cls.server

    def _send(self, message, fds=()):
        data = pickle.dumps(message)
        socket.send_fds(self.sock, [len(data).to_bytes(4, "big")], list(fds))
        self.sock.sendall(data)

    def _receive(self, timeout):
        """The next message, or None at the timeout; an ended process's exit code goes to self.ended."""
        if not select.select([self.sock], [], [], max(timeout, 0))[0]:
            return None
        try:
            header = self.sock.recv(4, socket.MSG_WAITALL)
            message = pickle.loads(self.sock.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL)) if header else None
        except BaseException:  # a test's timeout between the two reads: the stream is out of step, start anew
            Preloaded.server = None
            raise
        if message is None:
            Preloaded.server = None
            pytest.fail(f"tests/preloaded.py ended (exit {self.process.wait()}):\n{self.log.read_text()[-3000:]}")
        if message[0] == "ended":
            self.ended[message[1]] = message[2]
        return message

    def _reply(self, kind, pid=None, timeout=60):
        while (message := self._receive(timeout)) is None or message[0] != kind or pid not in (None, message[1]):
            if message is None:
                pytest.fail(f"tests/preloaded.py sent no {kind!r} in {timeout} s:\n{self.log.read_text()[-3000:]}")
        return message

    def start(self, argv, env, cwd, fds):
        with self.lock:
            self._send(("start", argv, env, str(cwd)), fds)
            return self._reply("started")[1]

    def returncode(self, pid, timeout):
        """pid's exit code, waiting up to timeout seconds; None while it runs. The first time it is known, the server
        collects the process (as Popen.wait does) and its CPU time counts."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while pid not in self.ended and self._receive(deadline - time.monotonic()) is not None:
                pass
            if pid not in self.ended:
                return None
            self._send(("release", pid))
            Preloaded.cpu += self._reply("released", pid)[2]
            return self.ended.pop(pid)


class Task:
    """A script run as `python script args` in the preloaded Python (tests/preloaded.py), with Popen's interface as
    the tests use it (pid, poll, wait, communicate, stdout in text, returncode): what srun or a shell starts. A fresh
    process (Popen) where env differs from the server's in what a Python reads at its start, or where
    TESTS_FRESH_PROCESSES=1."""

    def __new__(cls, argv, env, cwd, stderr=subprocess.PIPE):
        if os.environ.get("TESTS_FRESH_PROCESSES") == "1" or read_at_start(env) != read_at_start(server_env()):
            return subprocess.Popen([sys.executable, *map(str, argv)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                    stderr=stderr, text=True, start_new_session=True)
        return super().__new__(cls)

    def __init__(self, argv, env, cwd, stderr=subprocess.PIPE):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe() if stderr == subprocess.PIPE else (None, out_w)
        devnull = os.open(os.devnull, os.O_RDONLY)
        self.args, self.returncode, self.preloaded = argv, None, Preloaded.get()
        self.pid = self.preloaded.start([str(a) for a in argv], env, cwd, [devnull, out_w, err_w])
        for fd in {devnull, out_w, err_w}:
            os.close(fd)
        self.stdout = open(out_r, "r", encoding="utf-8", errors="replace")
        self.stderr = open(err_r, "r", encoding="utf-8", errors="replace") if err_r is not None else None
        self._read = {self.stdout: [], **({self.stderr: []} if self.stderr else {})}

    def poll(self):
        if self.returncode is None:
            self.returncode = self.preloaded.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = self.preloaded.returncode(self.pid, 3600 if timeout is None else timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout=None):
        """Reads stdout and stderr to their ends, then waits; past timeout raises TimeoutExpired (call it again)."""
        deadline = time.monotonic() + (3600 if timeout is None else timeout)
        open_files = [f for f in self._read if not f.closed]
        while open_files:
            ready = select.select(open_files, [], [], max(deadline - time.monotonic(), 0))[0]
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for f in ready:
                chunk = os.read(f.fileno(), 65536)
                if chunk:
                    self._read[f].append(chunk)
                else:
                    f.close()
                    open_files.remove(f)
        self.wait(max(deadline - time.monotonic(), 0))
        text = {f: b"".join(chunks).decode(errors="replace") for f, chunks in self._read.items()}
        return text[self.stdout], text.get(self.stderr)


def read_line(proc, deadline):
    """The next line proc writes, or "" at its end; fails the test at the deadline (time.monotonic()) even
    when proc hangs without a word, where a plain readline() would wait for ever."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no output from {proc.args} before the deadline")
        return proc.stdout.readline()


def wait_for(predicate, timeout, what, details=lambda: ""):
    """Polls predicate until it returns something true; at the timeout fails with details()."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout} s waiting for {what}\n{details()}")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slurm_task_env(rank, world_size, port, job_id="4242", **extra):
    """What srun gives each task of a one-node job, plus what submit.sh exports (and extra)."""
    return child_env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(world_size),
                     SLURM_STEP_TASKS_PER_NODE=str(world_size), SLURM_NODEID="0", SLURM_STEP_ID="0", SLURM_JOB_ID=job_id, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     REQUEUE_ON_144="1", **extra)


def run_slurm_tasks(args, world_size=2, timeout=120, **env):
    """Step 05 started as srun would start it on one node: one process per task with its SLURM_* variables (and
    env)."""
    port, start = free_port(), time.monotonic()
    procs = [Task(["05_ddp_slurm/train.py", *args], slurm_task_env(rank, world_size, port, **env), REPO)
             for rank in range(world_size)]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=max(1, timeout - (time.monotonic() - start))))
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"05 timed out after {timeout} s")
    code = next((p.returncode for p in procs if p.returncode), 0)
    return Result(code, "".join(o for o, _ in outs), "".join(e for _, e in outs), time.monotonic() - start)


def submitit_logs(log_dir):
    """All task logs that submitit wrote under log_dir, rank 0 first."""
    files = sorted(Path(log_dir).glob("*/*_log.out"), key=lambda p: (p.parent.name, p.name.split("_")[1]))
    return "".join(p.read_text() for p in files)


def run_step(step, args, tmp_path, timeout=120, **env):
    """Runs one step on the CPU: 01 and 02 in one process, 03 to 06 with two ranks (env: more variables)."""
    if step in ("01_single_gpu", "02_dataparallel"):
        return run([sys.executable, f"{step}/train.py", *args], timeout, env=child_env(**env))
    if step == "03_ddp_mpspawn":
        return run([sys.executable, f"{step}/train.py", "--world-size", "2", *args], timeout, env=child_env(**env))
    if step == "04_ddp_torchrun":
        return run(["bash", f"{step}/run.sh", *args], timeout, env=child_env(NPROC_PER_NODE="2", **env))
    if step == "05_ddp_slurm":
        return run_slurm_tasks(args, timeout=timeout)
    log_dir = Path(tmp_path) / f"submitit-{time.monotonic_ns()}"
    result = run([sys.executable, f"{step}/train.py", "--local", "--tasks-per-node", "2", "--log-dir",
                  str(log_dir), *args], timeout, env=child_env(**env))
    result.output += submitit_logs(log_dir)
    return result


def batch_args(step):
    """--batch-size per process that gives every step the same global batch."""
    return ["--batch-size", str(GLOBAL_BATCH if step in ("01_single_gpu", "02_dataparallel") else GLOBAL_BATCH // 2)]


def weights(path):
    return torch.load(path, map_location="cpu")["model"]


def max_abs_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def load_step_module(step, path=None):
    """Imports a step's train.py (or the one at path) as a module, to call its functions in this process."""
    spec = importlib.util.spec_from_file_location(f"train_{step}", path or REPO / step / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_in_process(step, argv, capsys):
    """step's own parse_args(argv) and train() in this process, on the CPU, for what no launcher takes part in (a
    checkpoint refused or resumed under a layout): from 03 on as rank 0 of a world of one, over a store in memory.
    It costs no process start (torch's import is most of a short run's time). Returns (the exit code, or the
    message that sys.exit was given, and what it printed: stdout, then stderr, where exit_with_error prints)."""
    module = load_step_module(step)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [f"{step}/train.py", *argv])
        args = module.parse_args()
    capsys.readouterr()
    try:
        if step in ("01_single_gpu", "02_dataparallel"):
            code = module.train(args, torch.device("cpu"))
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:  # the Gloo group for waiting on rank 0, as setup() makes it
                code = module.train(args, 0, 1, torch.device("cpu"), dist.new_group(backend="gloo"))
            finally:
                dist.destroy_process_group()
    except SystemExit as exited:
        code = exited.code
    printed = capsys.readouterr()
    return code or 0, printed.out + printed.err


# The Slurm tests that take longest (in this order), started before the others so that none of them starts last.
SLURM_LONGEST = ["test_submitit_through_a_preemption_and_many_timeouts",
                 "test_submit_sh_through_a_time_limit_and_a_preemption", "test_submitit_job_ends_when_a_rank_dies"]


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (pytest.ini: --dist load --maxschedchunk 1) a free worker takes the next test of this
    order. The Slurm tests mostly wait (for the scheduler, time limits, grace times) while the rest keeps the cores
    busy, so they come early, longest first, each followed by one of the rest, and the rest after them."""
    slurm = [item for item in items if item.get_closest_marker("slurm")]
    slurm.sort(key=lambda item: SLURM_LONGEST.index(item.originalname) if item.originalname in SLURM_LONGEST
               else len(SLURM_LONGEST))  # stable: the files' order otherwise
    rest = [item for item in items if not item.get_closest_marker("slurm")]
    items[:] = [item for pair in zip(slurm, rest) for item in pair] + slurm[len(rest):] + rest[len(slurm):]


# --- the local Slurm cluster of tests/slurm_cluster.sh ---
# Its state folder (SLURM_TEST_DIR) and its slurm.conf, which every Slurm command the tests and their jobs run
# finds through SLURM_CONF. The cluster has pairs of nodes, each with partitions of its own (its high one preempts
# its low one and no other job): each pytest-xdist worker submits to a pair of its own (worker gwN to pair N), so
# that its tests, which run one after another, can preempt, requeue and time out their jobs while the other
# workers' jobs run beside them.
CLUSTER = REPO / "tests" / "slurm_cluster.sh"
SLURM_DIR = Path(os.environ.get("SLURM_TEST_DIR", "/tmp/ddp-ladder-slurm"))
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
SLURM_PARTITION, SLURM_HIGH = (f"low{WORKER or ''}", f"high{WORKER or ''}")  # pair 0's: low and high
_prefix = os.environ.get("SLURM_TEST_NODE_PREFIX", "n")
SLURM_NODES = [f"{_prefix}{2 * WORKER + 1}", f"{_prefix}{2 * WORKER + 2}"]  # the pair's nodes, in order
STARTED_BY = SLURM_DIR / "started-by-pytest"  # the run that started the cluster stops it at its end
STAND_INS = f"{SLURM_DIR}/gpu"  # the device files of the test cluster's GPUs (tests/slurm_cluster.sh)


def cpu_seconds():
    """CPU time of this process and of every process it started and waited for (their children included)."""
    return Preloaded.cpu + sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF,
                                                                                  resource.RUSAGE_CHILDREN)
                               for field in ("ru_utime", "ru_stime"))


def slurm_cpu_seconds(since):
    """The CPU time of the jobs submitted to this worker's partitions since since (a datetime), every run of a requeued
    job included (sacct -D; slurm_cluster.sh gathers it): what Slurm's daemons started for a test, which no process
    of the test waits for. The steps' records reach the database as each ends: waited for up to 10 s. The job on the
    shared partition wide (05's lines as shipped) is not in it."""
    partitions = f"{SLURM_PARTITION},{SLURM_HIGH},cancel{WORKER or ''}"
    query = ["sacct", "-n", "-D", "-P", "-a", "-o", "JobID,Submit,End,TotalCPU", "-S",
             since.isoformat(timespec="seconds"), "-r", partitions]
    deadline = time.monotonic() + 10
    while True:
        rows = [line.split("|") for line in subprocess.run(query, capture_output=True, text=True, timeout=30)
                .stdout.split()]
        began = since.isoformat(timespec="seconds")
        jobs = {job: end for job, submit, end, _ in rows if "." not in job and submit >= began}
        steps = [(job, cpu) for job, _, _, cpu in rows if job.split(".")[0] in jobs and "." in job]
        if all(end != "Unknown" for end in jobs.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    seconds = 0.0
    for _, text in steps:  # [DD-[HH:]]MM:SS.mmm
        days, _, clock = text.rpartition("-")
        seconds += int(days or 0) * 86400 + sum(float(part) * 60 ** i for i, part in enumerate(reversed(clock.split(":"))))
    return seconds


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.cpu_start, item.began = cpu_seconds(), datetime.now()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each report carries the CPU seconds its test has spent so far (set-up, call, teardown): the shared runs it
    made included, and for a Slurm test its jobs' (after the teardown, from the accounting)."""
    report = (yield).get_result()
    seconds = cpu_seconds() - item.cpu_start
    if call.when == "teardown" and item.get_closest_marker("slurm") and "SLURM_CONF" in os.environ:
        seconds += slurm_cpu_seconds(item.began)
    report.user_properties.append(("cpu_seconds", seconds))


CPU_REPORT = []


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        CPU_REPORT.append((dict(report.user_properties).get("cpu_seconds", 0), report.nodeid))


def pytest_terminal_summary(terminalreporter):
    """Beside --durations' wall times: the CPU seconds of the 15 most costly tests, set-up and teardown included."""
    report = sorted(CPU_REPORT, reverse=True)
    if report:
        terminalreporter.write_sep("=", "most CPU seconds (the test's processes, those they waited for, its Slurm jobs)")
        for seconds, nodeid in report[:15]:
            terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")
        terminalreporter.write_line(f"{sum(s for s, _ in report):8.1f} s  all {len(report)} tests")
    if report and os.environ.get("CPU_REPORT"):  # a file with every test's, to compare two runs
        Path(os.environ["CPU_REPORT"]).write_text("".join(f"{seconds:.1f} {nodeid}\n" for seconds, nodeid in report))


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or the one process without pytest-xdist)
        os.environ.setdefault("DDPL_TEST_RUN", f"{os.getpid()}-{time.time_ns()}")  # the workers inherit it


def pytest_sessionfinish(session):
    """The controller stops the cluster that a worker of this run started, once every worker is done."""
    if hasattr(session.config, "workerinput") or not STARTED_BY.exists():
        return
    if STARTED_BY.read_text() == os.environ["DDPL_TEST_RUN"]:
        subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def slurm():
    """A running cluster: the one already up (left running), or one started here (under a lock, as every worker
    asks) and stopped at the run's end. Every Slurm command of this worker then submits to its own pair."""
    def unavailable(reason):
        if os.environ.get("REQUIRE_SLURM") == "1":  # CI: a skipped Slurm test would be a silent pass
            pytest.fail(f"REQUIRE_SLURM=1 but {reason}")
        pytest.skip(f"no local Slurm cluster: {reason}")

    os.environ["SLURM_CONF"] = str(SLURM_DIR / "slurm.conf")
    with FileLock(f"{SLURM_DIR}.lock"):
        if subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True).returncode != 0:
            if os.geteuid() != 0:
                unavailable("tests/slurm_cluster.sh needs root")
            pairs = max(int(os.environ.get("SLURM_TEST_PAIRS", 4)), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))
            started = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=900,
                                     env=dict(os.environ, SLURM_TEST_PAIRS=str(pairs)))
            if started.returncode != 0:
                unavailable(f"tests/slurm_cluster.sh start failed:\n{started.stderr}")
            STARTED_BY.write_text(os.environ["DDPL_TEST_RUN"])
    shown = subprocess.run(["scontrol", "show", "hostnames", subprocess.run(
        ["sinfo", "-h", "-p", SLURM_PARTITION, "-o", "%N"], capture_output=True, text=True).stdout.strip()],
        capture_output=True, text=True)
    if shown.stdout.split() != SLURM_NODES:
        pytest.fail(f"worker {WORKER} needs partition {SLURM_PARTITION} on nodes {SLURM_NODES}, the cluster has "
                    f"{shown.stdout.split() or 'none'}: restart it with SLURM_TEST_PAIRS of at least the workers")
    os.environ["SBATCH_PARTITION"] = SLURM_PARTITION  # sbatch's default partition, also submitit's


@pytest.fixture(scope="session")
def shared(tmp_path_factory, worker_id):
    """once(name, compute): compute(folder) once for the whole run, whichever pytest-xdist worker asks first (the
    others wait for it and get its result, pickled), so that runs many tests read are not made once per worker."""
    root = tmp_path_factory.getbasetemp()
    root = (root.parent if worker_id != "master" else root) / "shared"
    root.mkdir(exist_ok=True)

    def once(name, compute):
        folder, result = root / name, root / f"{name}.pickle"
        with FileLock(str(root / f"{name}.lock")):
            if not result.exists():
                shutil.rmtree(folder, ignore_errors=True)  # what a worker whose compute failed left
                folder.mkdir()
                result.write_bytes(pickle.dumps(compute(folder)))
        return pickle.loads(result.read_bytes())
    return once


class SharedRuns:
    """runs[key]: the run that compute(folder, key) makes (compute(folder)[key] without keys), made once for the
    whole session (shared) by the first test that reads it, when it reads it: a test that compares its own job
    with such a run at its end runs its job first instead of waiting for the run, and the runs of several keys are
    made at the same time on several workers."""
    def __init__(self, shared, name, compute, keys=False):
        self.shared, self.name, self.compute, self.keys = shared, name, compute, keys

    def __getitem__(self, key):
        if not self.keys:
            return self.shared(self.name, self.compute)[key]
        return self.shared(f"{self.name}-{key}", lambda folder: self.compute(folder, key))


@pytest.fixture(scope="session")
def reference(shared):
    """Single-process runs of step 01 that the others are compared with: one epoch (its checkpoint is
    copied aside) and two epochs without interruption."""
    def compute(folder):
        runs = [run([sys.executable, "01_single_gpu/train.py", *SYNTHETIC, *batch_args("01_single_gpu"), "--epochs",
                     str(epochs), "--checkpoint", str(folder / f"{epochs}.pt")]) for epochs in (1, 2)]
        assert all(result.returncode == 0 for result in runs), runs
        return Namespace(epoch1=folder / "1.pt", epoch2=folder / "2.pt", run1=runs[0], run2=runs[1])
    return shared("reference", compute)


def copy(src, dst):
    shutil.copyfile(src, dst)
    return Path(dst)


# Between choosing the rendezvous port and binding it, another program may take it. This one tries, just
# before mp.spawn starts the ranks (a sitecustomize on PYTHONPATH puts it there): 03's first ladder run.
THIEF = '''
import os, socket, torch.multiprocessing as mp
spawn = mp.spawn
def spawn_after_a_thief(*args, **kwargs):
    thief = socket.socket()
    try:
        thief.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        thief.listen()
        print("thief took the port", flush=True)
    except OSError:
        print("thief found the port taken", flush=True)
    return spawn(*args, **kwargs)
mp.spawn = spawn_after_a_thief
'''
# A shell inside an allocation, or one that ran torchrun before, has these set: 06's first ladder run starts there.
STALE_RENDEZVOUS = dict(MASTER_ADDR="10.255.255.1", MASTER_PORT="1", RANK="7", WORLD_SIZE="9", LOCAL_RANK="3",
                        LOCAL_WORLD_SIZE="4",  # and 06 --local run inside an allocation's step, of 1 task on 4 GPUs:
                        SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_GPUS_ON_NODE="4", SLURM_STEP_TASKS_PER_NODE="1")


@pytest.fixture(scope="session")
def ladder(reference, shared):
    """runs(step): one epoch with a checkpoint, then the same command with --epochs 2, which resumes, and
    with progress lines every 15 steps (05's under torchrun, as a copy is tried without Slurm). 03's first run has a
    thief after its port, 06's starts from a shell with stale rendezvous variables (test_launch.py)."""
    def runs(step):
        def compute(folder):
            checkpoint = folder / "ckpt.pt"
            args = [*SYNTHETIC, *batch_args(step), "--checkpoint", str(checkpoint)]
            if step == "01_single_gpu":  # the reference is this very run
                first = reference.run1
                copy(reference.epoch1, checkpoint)
            else:
                (folder / "sitecustomize.py").write_text(THIEF)  # found by 03's run, on its PYTHONPATH
                env = {"06_ddp_submitit": STALE_RENDEZVOUS, "03_ddp_mpspawn": {"PYTHONPATH": str(folder)}}.get(step, {})
                first = run_step(step, [*args, "--epochs", "1"], folder, **env)
            epoch1 = copy(checkpoint, folder / "epoch1.pt")
            if step == "05_ddp_slurm":  # resumed as a copy is tried without Slurm: under torchrun (05's page)
                second = run(["torchrun", "--standalone", "--nproc-per-node", "2", f"{step}/train.py", *args, "--epochs",
                              "2", "--log-interval", "15"])
            else:
                second = run_step(step, [*args, "--epochs", "2", "--log-interval", "15"], folder)
            return Namespace(first=first, second=second, epoch1=epoch1, final=checkpoint)
        return shared(f"ladder-{step}", compute)
    return runs
