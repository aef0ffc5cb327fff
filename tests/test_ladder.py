"""Every step trains on the synthetic data (one process for 01 and 02, two Gloo ranks for 03 to 06),
is interrupted after one epoch and resumed for a second, and all of them compute the same weights."""
import re
import sys

import pytest
import torch

from conftest import STEPS, STEPS_PER_EPOCH, SYNTHETIC, TEST_SAMPLES, TOLERANCE, batch_args, max_abs_diff, run, weights


@pytest.mark.parametrize("step", STEPS)
def test_step_trains_and_prints_once_per_epoch(ladder, step):
    runs = ladder(step)
    assert runs.first.returncode == 0, runs.first
    assert runs.second.returncode == 0, runs.second
    [first] = runs.first.epochs()  # exactly one epoch line: only global rank 0 prints it
    [second] = runs.second.epochs()
    assert (first["epoch"], first["epochs"], second["epoch"], second["epochs"]) == (1, 1, 2, 2)
    resumed = "after epoch 1\n" if step < "05" else "at epoch 2 step 0\n"  # 05 on: the step inside an epoch too
    assert f"resumed from {runs.final} {resumed}" in runs.second.output, runs.second
    assert runs.second.output.count("resumed from") == 1
    assert second["loss"] < 0.8 * first["loss"], (first, second)  # the loss falls
    assert first["acc"] > 50 and second["acc"] > first["acc"] - 1, (first, second)  # chance is 10%
    assert first["total"] == second["total"] == TEST_SAMPLES  # every test sample counted once
    assert first["samples_per_s"] > 0
    if step not in ("01_single_gpu", "02_dataparallel"):
        # every rank shows its launch facts once, and all agree on the world size and rendezvous
        for result in (runs.first, runs.second):
            launches = result.launches()  # (rank, world size, local rank, host, pid, device, backend, addr, port)
            assert sorted(launch[0] for launch in launches) == ["0", "1"], result
            assert {(launch[1], launch[5], launch[6], launch[7], launch[8]) for launch in launches} == {
                ("2", "cpu", "gloo", launches[0][7], launches[0][8])}


PROGRESS_LINE = re.compile(r"^epoch (\d+) step (\d+)/(\d+) \| loss ([\d.]+)( \(rank 0\))? \| (\d+) samples/s$", re.M)


@pytest.mark.parametrize("step", STEPS)
def test_progress_lines_inside_an_epoch(ladder, step):
    """--log-interval 15 in the resumed run's epoch 2, 50 steps of the global batch: a line at steps 15, 30 and
    45, each once (two printing ranks would print it twice), before the epoch line, with rank 0's falling loss;
    in the first run the default (200) prints none."""
    runs = ladder(step)
    lines = PROGRESS_LINE.findall(runs.second.output)
    assert [(int(epoch), int(at), int(steps)) for epoch, at, steps, *_ in lines] == [
        (2, at, STEPS_PER_EPOCH) for at in (15, 30, 45)], runs.second
    losses = [float(loss) for _, _, _, loss, *_ in lines]
    assert losses == sorted(losses, reverse=True) and losses[0] < runs.first.epochs()[0]["loss"], losses
    distributed = step not in ("01_single_gpu", "02_dataparallel")
    assert all(bool(marker) == distributed and int(speed) > 0 for *_, marker, speed in lines), lines
    assert runs.second.output.index(f"step 45/{STEPS_PER_EPOCH}") < runs.second.output.index("epoch 2/2 |")
    assert not PROGRESS_LINE.search(runs.first.output), runs.first


def test_checkpoint_format(ladder):
    for step in STEPS:
        state = torch.load(ladder(step).final, map_location="cpu")
        assert state["epoch"] == 2, step
        assert not any(key.startswith("module.") for key in state["model"]), step  # the unwrapped model
        assert state["optimizer"]["state"], step  # momentum buffers, needed to resume exactly


def test_all_steps_compute_the_same_weights(ladder, reference):
    """Same seed and global batch: after one epoch every step holds the weights of the single process."""
    single = weights(reference.epoch1)
    diffs = {step: max_abs_diff(weights(ladder(step).epoch1), single) for step in STEPS}
    print("max abs difference to 01 after one epoch:", {s: f"{d:.1e}" for s, d in diffs.items()})
    assert diffs["01_single_gpu"] == 0
    assert diffs["02_dataparallel"] == 0  # on a CPU, 02 runs the plain model: another process, the same seed
    assert all(diff <= TOLERANCE for diff in diffs.values()), diffs
    assert any(diff > 0 for diff in diffs.values())  # DDP really ran: it adds gradients in another order


def test_resumed_runs_end_like_an_uninterrupted_one(ladder, reference):
    uninterrupted = weights(reference.epoch2)
    resumed = weights(ladder("01_single_gpu").final)
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)  # bit for bit in one process
    for step in STEPS[1:]:
        assert max_abs_diff(weights(ladder(step).final), uninterrupted) <= TOLERANCE, step


def test_the_seed_decides_the_run(ladder, reference, tmp_path):
    """--seed reaches the initial weights and the data order: the same seed repeats a run exactly (02's first
    epoch, another process, equals 01's bit for bit, as test_all_steps_compute_the_same_weights asserts), and
    another seed gives another run."""
    result = run([sys.executable, "01_single_gpu/train.py", *SYNTHETIC, *batch_args("01_single_gpu"), "--epochs", "1",
                  "--seed", "1", "--checkpoint", str(tmp_path / "1.pt")])
    assert result.returncode == 0, result
    same, other = weights(reference.epoch1), weights(tmp_path / "1.pt")
    assert all(torch.equal(weights(ladder("02_dataparallel").epoch1)[k], same[k]) for k in same)
    assert max_abs_diff(other, same) > 0.01
