"""How each process finds its GPU and its rendezvous. setup() of 03-06 under the layouts that real sites give
a task (all of its node's GPUs, or one bound to it), with CUDA and the process group replaced by recorders,
and 03's rendezvous port, which no other program can take."""
import sys

import pytest
import torch

from conftest import SYNTHETIC, Result, child_env, load_step_module, run, submitit_logs


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


# Between choosing the rendezvous port and binding it, another program may take it. This one tries, just
# before mp.spawn starts the ranks (a sitecustomize on PYTHONPATH puts it there).
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


def test_03_holds_its_rendezvous_port_from_the_start(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(THIEF)
    result = run([sys.executable, "03_ddp_mpspawn/train.py", "--world-size", "2", *SYNTHETIC, "--epochs", "1"],
                 env=child_env(PYTHONPATH=str(tmp_path)))
    assert "thief found the port taken" in result.output, result
    assert result.returncode == 0 and len(result.epochs()) == 1, result


def test_06_submits_from_a_shell_that_has_rendezvous_variables(tmp_path):
    """A shell inside an allocation, or one that ran torchrun before, has MASTER_ADDR, RANK and the like set,
    and Slurm passes them on to the job: the job's own values replace them."""
    stale = dict(MASTER_ADDR="10.255.255.1", MASTER_PORT="1", RANK="7", WORLD_SIZE="9", LOCAL_RANK="3",
                 LOCAL_WORLD_SIZE="4")
    result = run([sys.executable, "06_ddp_submitit/train.py", "--local", "--tasks-per-node", "2", "--log-dir",
                  str(tmp_path), *SYNTHETIC, "--epochs", "1"], env=child_env(**stale))
    logs = submitit_logs(tmp_path)
    assert result.returncode == 0, result.output + result.stderr + logs
    launches = Result(0, logs, "", 0).launches()  # (rank, world size, local rank, host, pid, device, backend, ...)
    assert sorted((launch[0], launch[1], launch[2]) for launch in launches) == [("0", "2", "0"), ("1", "2", "1")]
    assert all(launch[7] != stale["MASTER_ADDR"] and launch[8] != "1" for launch in launches), logs
    assert len(Result(0, logs, "", 0).epochs()) == 1, logs
