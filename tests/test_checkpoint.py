"""Checkpoints are written atomically (a crash in the middle of a write leaves the previous one whole), and read
without keeping anything of them, at most one copy of the state in memory per rank."""
import gc
import pickle
import re
import socket
import sys
import weakref

import pytest
import torch

from conftest import (REPO, SYNTHETIC, Task, child_env, free_port, load_step_module, run, run_slurm_tasks, slurm_task_env,
                      train_in_process)


@pytest.mark.parametrize("step", ["01_single_gpu", "05_ddp_slurm"])  # the two versions of save_checkpoint
def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch, step):
    module = load_step_module(step)
    model = module.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    path = str(tmp_path / "sub" / "ckpt.pt")  # the folder does not exist yet
    module.save_checkpoint(path, {"model": model, "optimizer": optimizer}, {"epoch": 1})
    before, saved_bias = open(path, "rb").read(), model.fc2.bias.detach().clone()

    def crash_midway(state, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash_midway)
    with torch.no_grad():
        model.fc2.bias.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        module.save_checkpoint(path, {"model": model, "optimizer": optimizer}, {"epoch": 2})
    monkeypatch.undo()

    assert open(path, "rb").read() == before
    state = torch.load(path, map_location="cpu")
    assert state["epoch"] == 1
    assert torch.equal(state["model"]["fc2.bias"], saved_bias) and not torch.equal(model.fc2.bias, saved_bias)


@pytest.mark.parametrize("step", ["01_single_gpu", "03_ddp_mpspawn"])  # the two versions of load_checkpoint
def test_loading_keeps_nothing_of_the_checkpoint(tmp_path, monkeypatch, step):
    """load_checkpoint fills the model and the optimizer and returns where the checkpoint left off, and nothing of
    what it read outlives it: a caller that keeps the returned value for the whole run keeps no tensor."""
    module = load_step_module(step)
    model = module.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.zeros(2, 1, 28, 28)).sum().backward()
    optimizer.step()  # momentum buffers to save
    path = str(tmp_path / "ckpt.pt")
    module.save_checkpoint(path, {"model": model, "optimizer": optimizer}, {"epoch": 1})
    saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    read = []  # weak references to the model tensors that torch.load returned
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: (
        state := load(*args, **kwargs), read.extend(weakref.ref(t) for t in state["model"].values()))[0])
    fresh = module.Net()
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.01, momentum=0.9)
    progress = module.load_checkpoint(path, {"model": fresh, "optimizer": fresh_optimizer})
    if step >= "03":  # (progress, why the file cannot be used): each rank's, for check_same_checkpoint
        progress, load_error = progress
        assert load_error is None, load_error
    gc.collect()
    assert progress == {"epoch": 1}, sorted(progress)
    assert read and all(ref() is None for ref in read), "a tensor of the checkpoint is still alive"
    assert all(torch.equal(fresh.state_dict()[name], saved[name]) for name in saved)
    assert fresh_optimizer.state_dict()["state"], "no momentum restored"


WIDE_NET = '''
class Net(nn.Module):
    """A model of 67 million parameters: 268 MB of weights, as much again of momentum."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8192, 8192)

    def forward(self, x):
        return self.fc(x.flatten(1)[:, :1].expand(-1, 8192))
'''
MEMORY = '''
import atexit, os, torch
def _vm(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith(field + ":"))
if os.environ.get("TEST_MEMORY"):
    _init, _load = torch.optim.SGD.__init__, torch.optim.Optimizer.load_state_dict
    def init(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self._rss_before_resume = _vm("VmRSS")  # the model and optimizer are built; nothing is loaded yet
    def load_state_dict(self, *args, **kwargs):
        _load(self, *args, **kwargs)
        # One write of the whole line: the two ranks share the pipe, and print() may write text and newline apart.
        os.write(1, f"memory: {self._rss_before_resume} MB before the resume, peak {_vm('VmHWM')} MB by its end\\n".encode())
    torch.optim.SGD.__init__, torch.optim.Optimizer.load_state_dict = init, load_state_dict
'''


def wide_03(tmp_path, sitecustomize):
    """03 copied into tmp_path with WIDE_NET, its checkpoint with momentum at tmp_path/ckpt.pt, and sitecustomize
    in tmp_path/site; returns the size of the checkpoint's state (weights and momentum) in MB."""
    from test_copy import copy_step  # noqa: E402 (a helper of the copy tests)
    folder = copy_step("03_ddp_mpspawn", tmp_path, code=WIDE_NET, names=("Net",))
    module = load_step_module("03_ddp_mpspawn", folder / "train.py")
    torch.manual_seed(0)
    model = module.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for parameter in model.parameters():
        optimizer.state[parameter]["momentum_buffer"] = torch.randn_like(parameter)
    module.save_checkpoint(str(tmp_path / "ckpt.pt"), {"model": model, "optimizer": optimizer}, {"epoch": 1})
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(sitecustomize)
    return 2 * sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def test_a_resume_holds_at_most_one_copy_of_the_state(tmp_path):
    """03 copied with a model whose state (weights and momentum) is 537 MB, resumed by two ranks: while a rank
    loads, its resident memory grows by at most one copy of the state plus the optimizer's momentum (the model
    is there before). Reading the whole file in every rank, or sending it pickled from rank 0, takes more."""
    state_mb = wide_03(tmp_path, MEMORY)
    result = run([sys.executable, "03_ddp_mpspawn/train.py", "--world-size", "2", "--dataset", "synthetic", "--epochs",
                  "1", "--checkpoint", str(tmp_path / "ckpt.pt")], timeout=180, cwd=tmp_path,
                 env=child_env(PYTHONPATH=str(tmp_path / "site"), TEST_MEMORY="1"))
    assert result.returncode == 0 and "resumed from" in result.output, result
    figures = [tuple(map(int, m)) for m in re.findall(r"memory: (\d+) MB before the resume, peak (\d+) MB", result.output)]
    print(f"state {state_mb:.0f} MB; per rank (MB before the resume, peak): {figures}")
    assert len(figures) == 2, result
    for before, peak in figures:
        assert peak - before <= state_mb + state_mb / 2 + 64, (state_mb, figures)


def test_ranks_that_found_different_files_at_the_same_step_stop(monkeypatch, capsys):
    """check_same_checkpoint compares all that a rank loaded besides the weights, not only (epoch, step): two
    files saved inside an epoch at one step (a fixed --checkpoint reused by two runs, one node's stale view; two
    end-of-epoch files of one epoch hold the same progress and pass) differ in their loss sums,
    and the ranks would train from different optimizer states (DDP broadcasts the weights only). The gather is
    stood in for: rank 1 found one file, rank 0 another. Rank 0 prints the one line, rank 1 exits 1 silently."""
    module = load_step_module("05_ddp_slurm")
    rank0 = {"epoch": 1, "step": 5, "loss_sum": 40.0, "count": 320.0}
    mine = dict(rank0, loss_sum=39.0)
    monkeypatch.setattr(module.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(module.dist, "all_gather_object", lambda out, obj, group: out.__setitem__(
        slice(None), [("node0", rank0, None), ("node1", mine, None)]))
    for rank, printed in [(0, "error: cannot use the checkpoint ckpt.pt (rank 1 on node1): it finds epoch 2 step 5, "
                              "rank 0 on node0 epoch 2 step 5: start again once every node sees the same file\n"),
                          (1, "")]:
        monkeypatch.setattr(module.dist, "get_rank", lambda rank=rank: rank)
        with pytest.raises(SystemExit) as stopped:
            module.check_same_checkpoint("ckpt.pt", [rank0, mine][rank], None, None)
        assert stopped.value.code == 1 and capsys.readouterr().err == printed, rank
    monkeypatch.setattr(module.dist, "all_gather_object", lambda out, obj, group: out.__setitem__(
        slice(None), [("node0", rank0, None), ("node1", dict(rank0), None)]))
    module.check_same_checkpoint("ckpt.pt", dict(rank0), None, None)  # the same: no exit


def not_a_checkpoint(kind, path):
    """A file at path that a resume cannot use: a copy cut short, random bytes, another script's state_dict, or a
    checkpoint of another model."""
    if kind == "2 bytes":
        path.write_bytes(b"PK")
    elif kind == "random bytes":
        path.write_bytes(torch.randint(0, 256, (1000,), generator=torch.Generator().manual_seed(0),
                                       dtype=torch.uint8).numpy().tobytes())
    elif kind == "another script's":
        torch.save({"weight": torch.zeros(3)}, path)
    else:  # another model's
        torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "optimizer": {}, "epoch": 1}, path)


@pytest.mark.parametrize("kind", ["2 bytes", "random bytes", "another script's", "another model's"])
@pytest.mark.parametrize("step", ["01_single_gpu", "02_dataparallel", "03_ddp_mpspawn", "04_ddp_torchrun",
                                  "05_ddp_slurm", "06_ddp_submitit"])
def test_a_checkpoint_that_cannot_be_read_ends_with_one_line(monkeypatch, tmp_path, capsys, step, kind):
    """A resume from a file that is no checkpoint of this model ends with one line naming the file and torch's
    reason, where it was torch's traceback on every rank, whose last line blamed mmap ("mmap can only be used with
    files saved with ...") or a missing key. From 03 on rank 0 alone prints it, and every rank exits 1, whichever
    rank could not use the file: here (the gather stood in for) all of them, or rank 1 alone (one node's view)."""
    module = load_step_module(step)
    path = tmp_path / "ckpt.pt"
    not_a_checkpoint(kind, path)
    model = module.Net()
    checkpointed = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.01)}
    if step < "03":
        with pytest.raises(SystemExit) as exited:
            module.load_checkpoint(str(path), checkpointed)
        assert re.fullmatch(rf"error: cannot resume from {path}: \w+: [^\n]+", exited.value.code), exited.value.code
        return
    progress, error = module.load_checkpoint(str(path), checkpointed)
    assert progress is None and error, error
    failed = (None, error)
    monkeypatch.setattr(module.dist, "get_world_size", lambda: 2)
    for rank0, rank1, named in [(failed, failed, 0), (({"epoch": 1}, None), failed, 1)]:
        for rank in (0, 1):
            monkeypatch.setattr(module.dist, "get_rank", lambda rank=rank: rank)
            monkeypatch.setattr(module.dist, "all_gather_object", lambda out, obj, group: out.__setitem__(
                slice(None), [("node0", *rank0), ("node1", *rank1)]))
            with pytest.raises(SystemExit) as exited:
                module.check_same_checkpoint(str(path), *[rank0, rank1][rank], None)
            printed = capsys.readouterr().err
            assert exited.value.code == 1 and printed == ("" if rank else (
                f"error: cannot use the checkpoint {path} (rank {named} on node{named}): {error}\n")), (rank, printed)


def test_05_resumed_from_a_file_it_cannot_read_ends_with_one_line(tmp_path, capsys):
    """The whole path in train(): 05 given a checkpoint cut short exits 1 with rank 0's one line and no traceback,
    before any training."""
    path = tmp_path / "ckpt.pt"
    not_a_checkpoint("random bytes", path)
    code, output = train_in_process("05_ddp_slurm", ["--dataset", "synthetic", "--checkpoint", str(path)], capsys)
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert code == 1 and len(errors) == 1 and errors[0].startswith(
        f"error: cannot use the checkpoint {path} (rank 0 on {socket.gethostname()}): "), (
        output)
    assert "Traceback" not in output and "epoch 1" not in output, output


def test_a_nan_loss_sum_in_the_checkpoint_is_the_same_checkpoint(monkeypatch):
    """A run whose loss turned NaN saved loss_sum = nan: every rank loads the same file, and the comparison of the
    ranks' progress must not call it another file (nan != nan: every rank would stop, blaming storage)."""
    module = load_step_module("05_ddp_slurm")
    rank0 = {"epoch": 1, "step": 5, "loss_sum": float("nan"), "count": 320.0}
    monkeypatch.setattr(module.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(module.dist, "get_rank", lambda: 1)
    # The gather unpickles each rank's progress: every NaN a float object of its own (equal objects would pass).
    monkeypatch.setattr(module.dist, "all_gather_object", lambda out, obj, group: out.__setitem__(
        slice(None), [pickle.loads(pickle.dumps(("node0", rank0, None))), pickle.loads(pickle.dumps(obj))]))
    module.check_same_checkpoint("ckpt.pt", pickle.loads(pickle.dumps(rank0)), None, None)  # no exit


def test_a_checkpoint_folder_that_rank_0_cannot_write_ends_with_one_line(tmp_path):
    """05 (and 06): rank 0 writes a file beside the checkpoint, which every rank must read back; a folder it cannot
    write (a read-only mount, a full disk, a file in the path) ends both ranks with rank 0's one line, before
    training: rank 0 does not leave the other waiting in a collective alone (Gloo's tracebacks there)."""
    (tmp_path / "afile").write_text("")
    result = run_slurm_tasks([*SYNTHETIC, "--checkpoint", str(tmp_path / "afile" / "c.pt")], world_size=2,
                             timeout=60)
    errors = [line for line in (result.output + result.stderr).splitlines() if "error" in line.lower()]
    assert result.returncode == 1 and errors == [
        f"error: cannot use the checkpoint {tmp_path}/afile/c.pt (rank 0 on {socket.gethostname()}): cannot write "
        f"beside it: [Errno 17] File exists: '{tmp_path}/afile'"], result
    assert "Traceback" not in result.stderr and "epoch 1" not in result.output, result


def test_a_checkpoint_folder_that_another_rank_cannot_see_ends_with_one_line(tmp_path):
    """05 (and 06): each rank in a folder of its own with the same relative --checkpoint, as on node-local storage
    ($TMPDIR, /tmp) that every node has, which holds an earlier run's probe: rank 1 cannot read rank 0's, and the
    run ends with one line before training, where every requeue would have started over (test_slurm_site.py: the
    same on the Slurm cluster)."""
    folders = [tmp_path / f"node{rank}" for rank in range(2)]
    for folder in folders:
        folder.mkdir()
    (folders[1] / "ckpt.pt.probe").write_text("4241-0 port 1")  # an earlier run's probe on that node
    port = free_port()
    procs = [Task([REPO / "05_ddp_slurm/train.py", *SYNTHETIC, "--checkpoint", "ckpt.pt"],
                  slurm_task_env(rank, 2, port), folders[rank]) for rank in range(2)]
    outs = [proc.communicate(timeout=60) for proc in procs]
    output = "".join(out + err for out, err in outs)
    errors = [line for line in output.splitlines() if line.startswith("error")]
    assert [proc.returncode for proc in procs] == [1, 1] and errors == [
        f"error: cannot use the checkpoint ckpt.pt (rank 1 on {socket.gethostname()}): rank 0's files in "
        f"{folders[1]} are not here: put it on storage that every node mounts (a requeue would start over)"], output
    assert "Traceback" not in output and not list(folders[1].glob("*.pt")), output
