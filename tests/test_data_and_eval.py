"""Exact evaluation across ranks, the real MNIST loading code on tiny files in MNIST's own format, and
what happens when MNIST cannot be downloaded."""
import http.server
import re
import struct
import sys
import threading
from argparse import Namespace

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import SYNTHETIC, child_env, load_step_module, run, run_step


def test_evaluation_is_exact_for_any_world_size(tmp_path):
    """Three ranks split 800 test samples 267/267/266 with no padding; the printed accuracy must equal
    a single-process evaluation of the same weights."""
    checkpoint = tmp_path / "ckpt.pt"
    result = run([sys.executable, "03_ddp_mpspawn/train.py", "--world-size", "3", *SYNTHETIC, "--epochs", "1",
                  "--batch-size", "20", "--checkpoint", str(checkpoint)])
    assert result.returncode == 0, result
    [epoch] = result.epochs()
    single = load_step_module("01_single_gpu")
    _, test_set = single.load_datasets(Namespace(dataset="synthetic"))
    model = single.Net()
    model.load_state_dict(torch.load(checkpoint, map_location="cpu")["model"])
    loss_sum, correct, total = single.evaluate(model, DataLoader(test_set, batch_size=500), torch.device("cpu"),
                                                0)
    assert (epoch["correct"], epoch["total"]) == (correct, total) == (correct, 800)
    # The held-out mean loss, as printed (4 decimals; 3 ranks add their float32 batch sums in another order).
    assert abs(epoch["test_loss"] - loss_sum / total) <= 0.5e-4 + 1e-6, (epoch, loss_sum / total)
    assert 0.5 < correct / total < 1  # a real score, not a trivially perfect one


def write_mnist(root, train_size=600, test_size=200):
    """Tiny MNIST in its own IDX format: digit d is a bright bar in row band d, under noise."""
    generator = torch.Generator().manual_seed(0)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, size in (("train", train_size), ("t10k", test_size)):
        labels = torch.randint(0, 10, (size,), generator=generator)
        images = torch.randint(0, 60, (size, 28, 28), generator=generator)
        for i, digit in enumerate(labels.tolist()):
            images[i, 2 + 2 * digit: 4 + 2 * digit, 4:24] = 255
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, size, 28, 28) + images.to(torch.uint8).numpy().tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 2049, size) + labels.to(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("step", ["01_single_gpu", "04_ddp_torchrun"])
def test_mnist_files_load_through_torchvision(tmp_path, step):
    write_mnist(tmp_path / "data")
    result = run_step(step, ["--dataset", "mnist", "--data-dir", str(tmp_path / "data"), "--workers", "0",
                             "--epochs", "2", "--batch-size", "16", "--lr", "0.05"], tmp_path)
    assert result.returncode == 0, result
    first, second = result.epochs()
    assert first["total"] == second["total"] == 200  # the files' test split, each sample once
    assert second["loss"] < first["loss"] and second["acc"] > 80, result


class RefusingProxy(http.server.ThreadingHTTPServer):
    """An HTTP proxy on localhost that answers every request with an error and counts them."""

    def __init__(self):
        self.requests = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_any(handler):
                self.requests.append(f"{handler.command} {handler.path}")
                handler.send_error(502 if handler.command == "CONNECT" else 404)
            do_GET = do_HEAD = do_CONNECT = do_any

            def log_message(handler, *args):
                pass
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.mark.parametrize("step", ["01_single_gpu", "03_ddp_mpspawn"])
def test_offline_download_fails_once_with_one_line(tmp_path, step):
    """No internet (every request refused by a local proxy): a one-line error that says where to read how
    to fetch MNIST, and with two ranks only rank 0 tries, so the proxy sees what one process asks for."""
    proxy = RefusingProxy()
    address = f"http://127.0.0.1:{proxy.server_address[1]}"
    args = [sys.executable, f"{step}/train.py", "--dataset", "mnist", "--data-dir", str(tmp_path / "none")]
    if step == "03_ddp_mpspawn":
        args += ["--world-size", "2"]
    result = run(args, env=child_env(http_proxy=address, https_proxy=address, no_proxy=""), timeout=60)
    proxy.shutdown()
    assert result.returncode != 0, result
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: MNIST is not in")]
    assert len(errors) == 1 and "01's page" in errors[0], result  # which says how to fetch it
    assert "Traceback" not in result.stderr, result
    train_images = [r for r in proxy.requests if "train-images" in r or r.startswith("CONNECT")]
    # One process tries each mirror for the first file, then gives up: the same count for 01 and for 03.
    assert len(train_images) == 2, proxy.requests
    assert re.search(r"ossci-datasets|lecun", " ".join(proxy.requests))


@pytest.mark.parametrize("test_batch_size", [1000, 133, 1])
def test_every_rank_evaluates_as_many_batches_and_every_sample_once(monkeypatch, test_batch_size):
    """03-06 split the test set into every world_size-th sample on each rank, in as many batches on every rank (05's
    stop vote, or a loss with a collective, runs once a batch), none empty: 800 samples on 3 ranks at 133 a batch
    were 3 batches on two ranks and 2 on the third. At 1 a batch, 267 samples go in 266 batches: one holds 2."""
    module = load_step_module("03_ddp_mpspawn")
    monkeypatch.setattr(module.dist, "barrier", lambda group=None: None)
    args = Namespace(dataset="synthetic", test_batch_size=test_batch_size, batch_size=64, seed=0, workers=0)
    shards = [list(module.make_loaders(args, rank, 3, torch.device("cpu"), None)[1].batch_sampler)
              for rank in range(3)]
    assert len({len(batches) for batches in shards}) == 1, [len(batches) for batches in shards]
    assert all(0 < len(batch) <= test_batch_size + 1 for batches in shards for batch in batches)
    assert sorted(index for batches in shards for batch in batches for index in batch) == list(range(800))
