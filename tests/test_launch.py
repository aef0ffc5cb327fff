"""How each process finds its GPU and its rendezvous. setup() of 03-06 under the layouts that real sites give
a task (all of its node's GPUs, or one bound to it), with CUDA and the process group replaced by recorders,
and 03's rendezvous port, which no other program can take."""
import pytest
import torch

from conftest import STALE_RENDEZVOUS, load_step_module


@pytest.mark.parametrize("step, visible, local_rank, expected", [
    ("03_ddp_mpspawn", 4, 2, "cuda:2"),  # 03 and 04: one process per GPU of the node, by its local rank
    ("05_ddp_slurm", 4, 2, "cuda:2"),  # --gpus-per-node: every task sees the node's 4 GPUs, takes its local rank's
    ("05_ddp_slurm", 1, 3, "cuda:0"),  # --gpus-per-task=1, --gpu-bind or a container: the task sees its GPU alone
    ("05_ddp_slurm", 1, 0, "cuda:0"),
    ("05_ddp_slurm", 2, 3, None),      # 2 GPUs visible to local rank 3: no GPU of its own; one clear line
])  # setup() is the same in 03 and 04, and in 05 and 06
def test_each_process_finds_its_gpu(monkeypatch, capsys, step, visible, local_rank, expected):
    module = load_step_module(step)
    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.update(set_device=str(device)))
    monkeypatch.setattr(module.dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setenv("MASTER_ADDR", "n1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(visible))))
    if expected is None:
        with pytest.raises(SystemExit) as stopped:
            module.setup(5, local_rank, 8, 600)
        assert str(stopped.value) == ("error: local rank 3 sees 2 GPUs (CUDA_VISIBLE_DEVICES=0,1): give each task "
                                      "all of its node's GPUs or exactly one, and start one task per GPU")
        assert not calls
        return
    device = module.setup(5, local_rank, 8, 600)
    assert str(device) == calls["set_device"] == expected
    assert (calls["backend"], calls["rank"], calls["world_size"]) == ("nccl", 5, 8)
    assert calls["timeout"].total_seconds() == 600  # --collective-timeout reaches the process group
    printed = capsys.readouterr().out
    assert f"rank 5/8 local_rank {local_rank} " in printed and f" device {expected} backend nccl " in printed, printed


def test_03_holds_its_rendezvous_port_from_the_start(ladder):
    """A program that tries to take 03's port just before mp.spawn starts the ranks (THIEF in conftest.py, in
    03's first ladder run) finds it taken, and the run goes on."""
    first = ladder("03_ddp_mpspawn").first
    assert "thief found the port taken" in first.output, first
    assert first.returncode == 0 and len(first.epochs()) == 1, first


def test_06_submits_from_a_shell_that_has_rendezvous_variables(ladder):
    """A shell inside an allocation, or one that ran torchrun before, has MASTER_ADDR, RANK and the like set,
    and Slurm passes them on to the job: 06's first ladder run starts from such a shell (STALE_RENDEZVOUS in
    conftest.py), and the job's own values replace them."""
    first = ladder("06_ddp_submitit").first
    assert first.returncode == 0, first
    launches = first.launches()  # (rank, world size, local rank, host, pid, device, backend, addr, port)
    assert sorted((launch[0], launch[1], launch[2]) for launch in launches) == [("0", "2", "0"), ("1", "2", "1")]
    assert all(launch[7] != STALE_RENDEZVOUS["MASTER_ADDR"] and launch[8] != "1" for launch in launches), first
    assert len(first.epochs()) == 1, first
