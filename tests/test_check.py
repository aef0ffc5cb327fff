"""--check (05 and 06): a job of a minute that meets what the full job would, at its size, and says whether it
would run: one line per node (its address, and each rank's device, cores, workers and threads), the speed of a few
steps of the model, an all-reduce of its size and a save, timed, and a verdict. It writes no checkpoint, never exits
144, and fails with one line where a stop could not fit in the signal's lead."""
import re
import sys

import pytest
import torch.distributed as dist

from conftest import SLURM_NODES, SYNTHETIC, free_port, load_step_module, run_step

NODE_LINE = re.compile(r"^node (\S+) \((\S+)\): \(rank, device, cores, workers, threads\) (\[.*\])$", re.M)
CHECK_LINE = re.compile(r"^check: (\d+) ranks, (\d+) nodes, (\d+) samples/s, peak GPU memory [\d.]+ GiB, all-reduce "
                        r"of ([\d.]+) MB in ([\d.]+) ms \(([\d.]+) GB/s bus\), a save in ([\d.]+) s$", re.M)
MODEL_MB = 0.8  # Net's 206,922 float32 parameters


def check_output(output, hosts, ranks):
    nodes = NODE_LINE.findall(output)
    assert [host for host, _, _ in nodes] == hosts, output
    tasks = [task for _, _, listed in nodes for task in eval(listed)]  # (rank, device, cores, workers, threads)
    assert [task[0] for task in tasks] == list(range(ranks)) and all(task[1] == "cpu" for task in tasks), output
    check = CHECK_LINE.search(output)
    assert check and (int(check[1]), int(check[2])) == (ranks, len(hosts)), output
    assert int(check[3]) > 0 and float(check[4]) == MODEL_MB and float(check[6]) > 0, output
    assert output.count("check passed: the job would run") == 1, output
    return nodes


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm")
def test_05_check_on_two_nodes_says_the_job_would_run(tmp_path):
    """As the page shows it: sbatch --time=10 submit.sh --check, 2 nodes x 1 task; each node by the address the
    other reaches it at (the test cluster's bridge), the checkpoint folder seen by both, and nothing saved."""
    from test_slurm import finish, job_id_of, read, sbatch_05
    proc = sbatch_05(tmp_path, 2, 1, [*SYNTHETIC[:2], "--check", "--checkpoint", f"{tmp_path}/ckpt.pt"])
    job_id = job_id_of(proc)
    code = finish(proc, 120)
    log = read(tmp_path / f"ddp-slurm-{job_id}.out")
    assert code == 0 and "requeueing" not in log and f"job {job_id} restart 1" not in log, log
    nodes = check_output(log, SLURM_NODES, 2)
    assert all(address.startswith("10.") for _, address, _ in nodes), log
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"ddp-slurm-{job_id}.out"], log  # no checkpoint


def test_06_local_check_says_the_job_would_run(tmp_path):
    result = run_step("06_ddp_submitit", [*SYNTHETIC, "--check", "--checkpoint", str(tmp_path / "ckpt.pt")], tmp_path)
    assert result.returncode == 0 and re.search(r"^job \d+ finished$", result.output, re.M), result
    check_output(result.output, [result.launches()[0][3]], 2)
    assert not (tmp_path / "ckpt.pt").exists(), result


def test_check_fails_where_a_stop_does_not_fit_the_signals_lead(tmp_path, monkeypatch, capsys):
    """05's check_job in this process (world size 1), with a lead that nothing fits in: one line, exit code 1."""
    module = load_step_module("05_ddp_slurm")
    monkeypatch.setattr(module, "SIGNAL_LEAD_SECONDS", 0)
    monkeypatch.setattr(sys, "argv", ["train.py", *SYNTHETIC, "--check", "--checkpoint", str(tmp_path / "ckpt.pt")])
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(SystemExit) as exited:
        module.check_job(module.parse_args(), 0, 0, 1)
    if dist.is_initialized():
        dist.destroy_process_group()
    err = capsys.readouterr().err
    assert exited.value.code == 1 and re.fullmatch(
        r"error: a stop would take \d+ s \(the stop check, a step, the save\), more than the signal's 0 s lead: raise "
        r"it \(--signal=USR2@N\)\n", err), err
    assert list(tmp_path.iterdir()) == []
