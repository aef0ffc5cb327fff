"""Checkpoints are written atomically: a crash in the middle of a write leaves the previous one whole."""
import pytest
import torch

from conftest import load_step_module


@pytest.mark.parametrize("step", ["01_single_gpu", "05_ddp_slurm"])  # the two versions of save_checkpoint
def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch, step):
    module = load_step_module(step)
    model = module.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    path = str(tmp_path / "sub" / "ckpt.pt")  # the folder does not exist yet
    module.save_checkpoint(path, model, optimizer, 1)
    before, saved_bias = open(path, "rb").read(), model.fc2.bias.detach().clone()

    def crash_midway(state, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash_midway)
    with torch.no_grad():
        model.fc2.bias.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        module.save_checkpoint(path, model, optimizer, 2)
    monkeypatch.undo()

    assert open(path, "rb").read() == before
    state = torch.load(path, map_location="cpu")
    assert state["epoch"] == 1
    assert torch.equal(state["model"]["fc2.bias"], saved_bias) and not torch.equal(model.fc2.bias, saved_bias)
