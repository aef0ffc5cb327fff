"""What sites run beside the test cluster's low and high partitions, on this worker's pair: a partition whose
preempted jobs are cancelled (PreemptMode=CANCEL), and 05's data-staging line (there the tasks are bash scripts that
stand in for train.py: what is under test is Slurm's behaviour and submit.sh's lines); nodes whose /etc/hosts maps
their own name to loopback, and a checkpoint folder on node-local storage, each made in a mount namespace of the
task's own (a wrapper that submit.sh starts as $PYTHON), where 05 must end in seconds with one line."""
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO, SLURM_HIGH, SLURM_NODES, SYNTHETIC, WORKER, child_env, read_line, wait_for
from test_slurm import accounted_runs, finish, job_id_of, job_state, read, sbatch_05

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm")]  # on this worker's pair (conftest.py)
N1, N2 = SLURM_NODES
CANCEL = f"cancel{WORKER or ''}"  # this pair's partition with PreemptMode=CANCEL and GraceTime=30

# Stands in for `python -u train.py ...` in 05's submit.sh: a task records that it started and, on SIGTERM, that it
# stopped, and exits 144 as train.py does after its save; a requeued run's tasks record that and end at once.
# Slurm (proctrack/linuxproc) signals a task's children before its shell: after a bare `sleep 300 & wait` the shell
# could exit 0 before its own SIGTERM came (1 run in 8 beside a CPU hog), so it waits in a loop only the trap leaves.
TASK = """#!/bin/bash
[[ -n ${SLURM_STEP_ID:-} ]] || { echo "python: not found" >&2; exit 127; }
events=$(dirname "$0")/events
if ((${SLURM_RESTART_COUNT:-0} > 0)); then echo "$SLURM_PROCID resumed" >>"$events"; exit 0; fi
trap 'echo "$SLURM_PROCID stopped" >>"$events"; exit 144' TERM
echo "$SLURM_PROCID started" >>"$events"
while :; do sleep 1 & wait; done
"""


def test_05_keeps_its_job_through_a_preemption_that_cancels(tmp_path):
    """On a PreemptMode=CANCEL partition (Slurm 22.05) the tasks get SIGTERM as under REQUEUE, and submit.sh's
    `scontrol requeue` inside the grace time keeps the job: it runs again and resumes."""
    task = tmp_path / "python"
    task.write_text(TASK)
    task.chmod(0o755)
    proc = subprocess.Popen(["sbatch", "--parsable", "--wait", f"--partition={CANCEL}", "--nodes=2",
                             "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=5",
                             f"--output={tmp_path}/%j.out", "05_ddp_slurm/submit.sh"], cwd=REPO,
                            env=child_env(PYTHON=str(task)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = int(read_line(proc, time.monotonic() + 60).strip())
    events = tmp_path / "events"
    wait_for(lambda: read(events).count("started") == 2, 60, "both tasks to start", lambda: job_state(job_id))
    subprocess.run(["sbatch", f"--partition={SLURM_HIGH}", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2",
                    "--gpus-per-node=0", "--output=/dev/null", "--wrap", "sleep 2"], check=True, timeout=30)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"job {job_id} still running after 90 s\n{job_state(job_id)}\n{read(events)}")
    log = read(tmp_path / f"{job_id}.out")
    assert sorted(read(events).splitlines()) == ["0 resumed", "0 started", "0 stopped", "1 resumed", "1 started",
                                                 "1 stopped"], log
    assert f"job {job_id}: its tasks stopped and saved: requeueing it" in log, log
    assert re.findall(rf"^job {job_id} restart (\d):", log, re.M) == ["0", "1"], log
    assert accounted_runs(job_id) == ["REQUEUED", "COMPLETED"], log


def test_05_staging_line_copies_once_per_node(tmp_path):
    """submit.sh's example that copies data to node-local disk, run in a job of 2 tasks a node whose TMPDIR is
    unset (under set -u): one copy per node, into /tmp. `srun --ntasks-per-node=1` alone inherited the job's 4
    tasks and copied 4 times, and "$TMPDIR" ended the script."""
    line = re.search(r"^# .*?(srun --ntasks-per-node=1 .*?cp -r data \S+)", (REPO / "05_ddp_slurm/submit.sh").read_text(),
                     re.M).group(1)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "cp").write_text(f'#!/bin/sh\necho "$(hostname) $*" >>{tmp_path}/copies\n')
    (tmp_path / "bin" / "cp").chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\nset -euo pipefail\nunset TMPDIR\nexport PATH={tmp_path}/bin:$PATH\n{line}\n"
                      "echo staged\n")
    done = subprocess.run(["sbatch", "--parsable", "--wait", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1",
                           "--gpus-per-node=0", "--time=2", f"--output={tmp_path}/job.out", str(script)], cwd=tmp_path,
                          env=child_env(), capture_output=True, text=True, timeout=90)
    log = read(tmp_path / "job.out")
    assert done.returncode == 0 and "staged" in log, (line, log)
    assert sorted(read(tmp_path / "copies").splitlines()) == [f"{N1} -r data /tmp/", f"{N2} -r data /tmp/"], (line, log)


# Runs the task's python in a mount namespace of its own, where SETUP has changed a file or a folder first.
IN_A_NAMESPACE = """#!/bin/bash
exec unshare --mount bash -c '{setup} && exec "$@"' task {python} "$@"
"""


def namespace_python(tmp_path, setup):
    wrapper = tmp_path / "python"
    wrapper.write_text(IN_A_NAMESPACE.format(setup=setup, python=sys.executable))
    wrapper.chmod(0o755)
    return str(wrapper)


def test_05_a_hostname_on_loopback_ends_a_multi_node_job_with_one_line(tmp_path):
    """Debian's and Ubuntu's /etc/hosts map the machine's own name to 127.0.1.1: Gloo binds that address, and the
    other node connects to its own loopback until the timeout (before the check: no line; --collective-timeout 20
    bounds it here, an hour on NCCL runs). Each task ends in seconds, before the process group, naming
    GLOO_SOCKET_IFNAME."""
    hosts = 'grep -v "^#" /etc/hosts > {0}/hosts-$(hostname) && sed -i "1i 127.0.1.1 $(hostname)" {0}/hosts-$(hostname)'
    python = namespace_python(tmp_path, hosts.format(tmp_path) + f' && mount --bind {tmp_path}/hosts-$(hostname) '
                                                                 '/etc/hosts')
    proc = sbatch_05(tmp_path, 2, 1, [*SYNTHETIC[:2], "--collective-timeout", "20"], env={"PYTHON": python})
    job_id = job_id_of(proc)
    code = finish(proc, 90)
    log = read(tmp_path / f"ddp-slurm-{job_id}.out")
    assert code == 1, log
    errors = sorted(line for line in log.splitlines() if line.startswith("error:"))
    assert errors == [f"error: task {rank} on {node}: its hostname resolves to 127.0.1.1, which the other nodes cannot "
                      "reach: export GLOO_SOCKET_IFNAME=<the nodes' interface> (ip -br addr)"
                      for rank, node in enumerate(SLURM_NODES)], log
    assert "rank 0/2" not in log, log  # before the process group


def test_05_a_checkpoint_folder_that_another_node_cannot_see_ends_the_job_with_one_line(tmp_path):
    """The checkpoint folder on node-local or per-job storage ($TMPDIR, /tmp, job_container/tmpfs) exists on every
    node, so the folder check passes; a requeue whose first node is another would find no checkpoint and start
    over, at every requeue. Here each task has a tmpfs of its own over the folder: rank 0's file is not on the other
    node. Before the check the job trained and ended as if all was well."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    python = namespace_python(tmp_path, f"mount -t tmpfs tmpfs {folder}")
    proc = sbatch_05(tmp_path, 2, 1, [*SYNTHETIC[:2], "--epochs", "1", "--checkpoint", f"{folder}/ckpt.pt"],
                     env={"PYTHON": python})
    job_id = job_id_of(proc)
    code = finish(proc, 90)
    log = read(tmp_path / f"ddp-slurm-{job_id}.out")
    assert code == 1 and "epoch 1/1" not in log, log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cannot use the checkpoint {folder}/ckpt.pt (rank 1 on {SLURM_NODES[1]}): rank 0's "
                      f"files in {folder} are not here: put it on storage that every node mounts (a requeue would "
                      "start over)"], log
