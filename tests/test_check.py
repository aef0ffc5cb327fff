"""--check (05 and 06): a job of a minute that meets what the full job would, at its size, and says whether it
would run: one line per node (its address, and each rank's device, cores, workers and threads), the speed of a few
steps of the model, an all-reduce of its size and a save, timed, and a verdict. It writes no checkpoint, never exits
144, and fails with one line where a stop could not fit in the signal's lead."""
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import SLURM_NODES, SYNTHETIC, load_step_module, run_step, train_in_process

NODE_LINE = re.compile(r"^node (\S+) \(its name resolves to (\S+)\): \(rank, device, cores, workers, threads\) "
                       r"(\[.*\])$", re.M)
CHECK_LINE = re.compile(r"^check: (\d+) ranks, (\d+) nodes, (\d+) samples/s, peak GPU memory \(PyTorch's\) [\d.]+ GiB, all-reduce "
                        r"of DDP's 25 MiB bucket in ([\d.]+) ms \(([\d.]+) GB/s bus\), a save in ([\d.]+) s$", re.M)
VERDICT = re.compile(r"^check passed: a stop takes up to (\d+) s; the time limit's signal gives 120 s, a preemption the "
                     r"partition's GraceTime$", re.M)


def check_output(output, hosts, ranks):
    nodes = NODE_LINE.findall(output)
    assert [host for host, _, _ in nodes] == hosts, output
    tasks = [task for _, _, listed in nodes for task in eval(listed)]  # (rank, device, cores, workers, threads)
    assert [task[0] for task in tasks] == list(range(ranks)) and all(task[1] == "cpu" for task in tasks), output
    check = CHECK_LINE.search(output)
    assert check and (int(check[1]), int(check[2])) == (ranks, len(hosts)), output
    assert int(check[3]) > 0 and float(check[4]) > 0 and float(check[5]) > 0, output
    assert len(VERDICT.findall(output)) == 1, output
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
    """05's train() --check in this process (world size 1), whose save the clock sees take 200 s: over the 120 s lead,
    one line and exit code 1. The same run with the save as fast as it is passes, and resumes the checkpoint first
    (--check tries the resume: a file the job could not resume ends it as it would end the job)."""
    module = load_step_module("05_ddp_slurm")
    for name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS"):  # --check sets them here: gone after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    checkpoint = tmp_path / "ckpt.pt"
    flags = [*SYNTHETIC, "--log-interval", "0", "--epochs", "1", "--checkpoint", str(checkpoint)]
    assert train_in_process("05_ddp_slurm", flags, capsys)[0] == 0
    code, output = train_in_process("05_ddp_slurm", [*flags, "--check"], capsys)
    assert code == 0 and f"resumed from {checkpoint} at epoch 2 step 0\n" in output, output  # no "--check" flag
    assert VERDICT.search(output), output
    clock = {"offset": 0.0}
    real_clock, real_save = time.perf_counter, module.save_checkpoint
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + clock["offset"])

    def slow_save(*args):  # the clock sees the save take 200 s
        real_save(*args)
        clock["offset"] += 200
    monkeypatch.setattr(module, "save_checkpoint", slow_save)
    code, output = check_in_process(module, [*flags, "--check"], capsys)
    failed = re.search(r"^error: a stop would take (\d+) s \(the stop check, a step, two saves, the exit\), more than "
                       r"the signal's 120 s lead: raise SIGNAL_LEAD_SECONDS \(05: and submit.sh's --signal=USR2@N to "
                       r"match\)$", output, re.M)
    assert code == 1 and failed and int(failed[1]) >= 2 * 200 + 30, output  # two saves of 200 s, the exit
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt.pt"]  # the check's save removed


def check_in_process(module, argv, capsys):
    """train_in_process with a module already loaded (and patched): (exit code, what it printed)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["train.py", *argv])
        args = module.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        code = module.train(args, 0, 1, torch.device("cpu"), dist.new_group(backend="gloo"))
    except SystemExit as exited:
        code = exited.code
    finally:
        dist.destroy_process_group()
    printed = capsys.readouterr()
    return code, printed.out + printed.err
