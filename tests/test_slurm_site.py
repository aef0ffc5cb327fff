"""What sites run beside the test cluster's low and high partitions, on this worker's pair: a partition whose
preempted jobs are cancelled (PreemptMode=CANCEL), and 05's data-staging line. The tasks here are bash scripts that
stand in for train.py (no torch): what is under test is Slurm's behaviour and submit.sh's lines."""
import re
import subprocess
import time

import pytest

from conftest import REPO, SLURM_HIGH, SLURM_NODES, WORKER, child_env, read_line, wait_for
from test_slurm import accounted_runs, job_state, read

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm")]  # on this worker's pair (conftest.py)
N1, N2 = SLURM_NODES
CANCEL = f"cancel{WORKER or ''}"  # this pair's partition with PreemptMode=CANCEL and GraceTime=30

# Stands in for `python -u train.py ...` in 05's submit.sh: a task records that it started and, on SIGTERM, that it
# stopped, and exits 144 as train.py does after its save; a requeued run's tasks record that and end at once.
TASK = """#!/bin/bash
[[ -n ${SLURM_STEP_ID:-} ]] || { echo "python: not found" >&2; exit 127; }
events=$(dirname "$0")/events
if ((${SLURM_RESTART_COUNT:-0} > 0)); then echo "$SLURM_PROCID resumed" >>"$events"; exit 0; fi
trap 'echo "$SLURM_PROCID stopped" >>"$events"; exit 144' TERM
echo "$SLURM_PROCID started" >>"$events"
sleep 300 & wait
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
