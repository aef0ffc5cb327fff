"""tests/benchmark.py is not collected (13 configurations a size, about 20 processes); its in-process parts are: the
call into 01's training loop on batches already on the device, which breaks when the loop's signature changes, and
the copies it runs (the wide Net swapped in; 01 without its per-step reseed, 04 without gradient_as_bucket_view),
whose edits stop the benchmark when the steps' lines change."""
import ast
import difflib
import math
import re
import sys
from argparse import Namespace

import torch

from conftest import REPO, STEPS, load_step_module

sys.path.insert(0, str(REPO / "tests"))
import benchmark  # noqa: E402


def test_benchmark_runs_01s_loop_on_prebatched_data(capsys):
    args = Namespace(dataset="synthetic", data_dir="data", epochs=2, batch_size=64)
    losses = benchmark.prebatched(args)
    speeds = [int(speed) for epoch, speed in benchmark.EPOCH_LINE.findall(capsys.readouterr().out)]
    assert len(speeds) == 2 and min(speeds) > 0, speeds
    assert losses[1] < losses[0] < 2.5, losses  # it trains: below chance's 2.30 after one epoch, and falls


def test_benchmark_copies_the_steps_with_a_wide_net_and_its_two_edits(tmp_path):
    small, wide = benchmark.make_project(tmp_path / "small"), benchmark.make_project(tmp_path / "wide", "8,16,32")
    for step in STEPS:  # small: the steps as shipped
        assert (small / "shipped" / step / "train.py").read_bytes() == (REPO / step / "train.py").read_bytes()
    for step in ("01_single_gpu", "06_ddp_submitit"):  # wide: Net() builds the wide CNN, in 01 as in 06
        net = load_step_module(step, wide / "shipped" / step / "train.py").Net()
        shapes = [tuple(p.shape) for p in net.parameters()]
        assert shapes == [(8, 1, 3, 3), (8,), (16, 8, 3, 3), (16,), (32, 16 * 7 * 7), (32,), (10, 32), (10,)], shapes
        assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    for root in (small, wide):
        shipped, edited = ((root / variant / "01_single_gpu" / "train.py").read_text().splitlines()
                           for variant in ("shipped", "no-reseed"))
        changed = [line for line in difflib.ndiff(shipped, edited) if line[0] in "+-"]  # 01 without its reseed:
        assert len(changed) == 4 and all(line[0] == "-" for line in changed), changed  # 4 lines fewer, no other change
        assert "seed = hash(" in changed[0] and "default_generator.manual_seed(seed)" in changed[1], changed
        assert "manual_seed_all(seed)" in changed[3], changed
        step01 = load_step_module("01_single_gpu", root / "no-reseed" / "01_single_gpu" / "train.py")
        model = step01.Net()  # and its loop still trains: two batches of 4
        args = Namespace(**{**vars(benchmark.defaults(step01)), "log_interval": 0})
        optimizer = step01.make_optimizer(model, args)
        peak_lrs = [group["lr"] for group in optimizer.param_groups]
        batches = [(torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3]))] * 2
        loss, samples = step01.train_one_epoch(args, model, batches, optimizer, peak_lrs, torch.device("cpu"), 0)
        assert samples == 8 and math.isfinite(loss), (loss, samples)
        shipped, edited = ((root / variant / "04_ddp_torchrun" / "train.py").read_text()
                           for variant in ("shipped", "no-bucket-view"))
        ast.parse(edited)  # 04 without gradient_as_bucket_view: its one DDP(...) call is otherwise the same
        calls = [re.findall(r"DDP\(model[^)]*\)", text) for text in (shipped, edited)]  # the call, over its lines
        assert [len(lines) for lines in calls] == [1, 1] and "gradient_as_bucket_view=True" in calls[0][0], calls
        assert calls[1][0] == calls[0][0].replace(benchmark.BUCKET_VIEW, ")"), calls
        assert len(edited) == len(shipped) - len(benchmark.BUCKET_VIEW) + 1
