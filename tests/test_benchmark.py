"""tests/benchmark.py is not collected (nine configurations, about 18 processes); its in-process part is: the
call into 01's training loop on batches already on the device, which breaks when the loop's signature changes."""
import sys
from argparse import Namespace

from conftest import REPO

sys.path.insert(0, str(REPO / "tests"))
import benchmark  # noqa: E402


def test_benchmark_runs_01s_loop_on_prebatched_data(capsys):
    args = Namespace(dataset="synthetic", data_dir="data", epochs=2, batch_size=64)
    losses = benchmark.prebatched(args)
    speeds = [int(speed) for epoch, speed in benchmark.EPOCH_LINE.findall(capsys.readouterr().out)]
    assert len(speeds) == 2 and min(speeds) > 0, speeds
    assert losses[1] < losses[0] < 2.5, losses  # it trains: below chance's 2.30 after one epoch, and falls
