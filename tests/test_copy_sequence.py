"""A user's job that is not MNIST classification: a tiny causal language model on lines of text, put into a copied
step by replacing only the named parts (load_datasets, Net, METRIC, loss_and_metric, make_optimizer). Its samples are
lines of different lengths, padded to one length, so its loss is a mean over tokens, not over samples: the epoch
line's test loss must be that mean (loss_and_metric's count is the tokens), a stopped and resumed 05 must end with
the uninterrupted run's weights and AdamW state bit for bit (dropout, two parameter groups, the schedule, clipping),
and the copy must differ from the step only inside the replaced parts."""
import ast
import contextlib
import difflib
import filecmp
import io
import math
import os
import random
import re
import signal
import sys
from argparse import Namespace

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, load_step_module, wait_for, weights
from test_accumulation import start_copy
from test_copy import copy_step, defined_name
from test_preemption import REQUEUE_CODE, SITECUSTOMIZE, STOPPED, finish_all, hold_env

NAMES = ("load_datasets", "Net", "METRIC", "loss_and_metric", "make_optimizer")
ALPHABET = "abcdefghijklmnopqrst"  # the text's 20 symbols (the user's code has them too)
T = 16  # tokens per sample
USER_CODE = '''
ALPHABET = "abcdefghijklmnopqrst"  # the text's symbols are tokens 1 to 20; token 0 pads
T = 16  # tokens per sample: a line of up to T + 1 characters


class Lines(torch.utils.data.Dataset):
    """One line of text per sample: the inputs are its characters but the last, the targets its characters but the
    first (the next character at every position), both padded to T: the inputs with token 0, the targets with -100,
    which the loss ignores."""

    def __init__(self, lines):
        self.lines = lines

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, index):
        tokens = torch.tensor([ALPHABET.index(c) + 1 for c in self.lines[index][:T + 1]])
        inputs, targets = torch.zeros(T, dtype=torch.long), torch.full((T,), -100)
        inputs[:len(tokens) - 1], targets[:len(tokens) - 1] = tokens[:-1], tokens[1:]
        return inputs, targets


def load_datasets(args):
    """--data-dir/lines.txt: a line per sample, the first two thirds to train on, the rest to test."""
    with open(os.path.join(args.data_dir, "lines.txt")) as f:
        lines = f.read().split()
    return Lines(lines[:len(lines) * 2 // 3]), Lines(lines[len(lines) * 2 // 3:])


class Net(nn.Module):
    """Token and position embeddings, one causal self-attention block with dropout, a linear head: (N, T, V)."""

    def __init__(self, vocab=len(ALPHABET) + 1, width=24, heads=2):
        super().__init__()
        self.heads = heads
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(T, width)
        self.norm = nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        n, t = x.shape
        h = self.tokens(x) + self.positions(torch.arange(t, device=x.device))
        q, k, v = self.qkv(self.norm(h)).view(n, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (N, heads, T, .)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(n, t, -1)
        return self.head(h + self.dropout(self.proj(attended)))


METRIC = "token accuracy"


def loss_and_metric(output, target):
    """Sums over the tokens that count (not the padding): the loss is a mean over tokens."""
    counted = target != -100
    loss = F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="sum", ignore_index=-100)
    return loss, (output.argmax(-1) == target)[counted].sum(), counted.sum()


def make_optimizer(model, args):
    """AdamW in two groups, as nanoGPT's: weight decay on the Linear layers' weights, none on biases, norms and
    (unlike nanoGPT, which decays every 2-D tensor) embeddings."""
    decayed = {id(module.weight) for module in model.modules() if isinstance(module, nn.Linear)}
    groups = [{"params": [p for p in model.parameters() if id(p) in decayed], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if id(p) not in decayed], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
'''
# The epoch line with this METRIC (conftest's EPOCH_LINE expects "test accuracy").
EPOCH_LINE = re.compile(r"^epoch (\d+)/\d+ \| train loss ([\d.]+) \| test loss ([\d.]+) \| "
                        r"test token accuracy ([\d.]+) of (\d+) \|", re.M)
FLAGS = ["--warmup", "0.1", "--cosine", "--clip-grad", "1.0", "--lr", "0.01", "--accumulate", "2",
         "--test-batch-size", "64", "--log-interval", "0"]


def write_lines(folder, count=384, seed=0):
    """folder/lines.txt: count lines of 3 to 19 symbols, each a run through ALPHABET from a random symbol by a stride
    of 1 to 3 (the first character predicts little, the next ones more); returns the folder's path."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        start, stride, length = rng.randrange(len(ALPHABET)), rng.randint(1, 3), rng.randint(3, T + 3)
        lines.append("".join(ALPHABET[(start + k * stride) % len(ALPHABET)] for k in range(length)))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lines.txt").write_text("\n".join(lines) + "\n")
    return str(folder)


def epochs(output):
    return [dict(zip(("epoch", "loss", "test_loss", "accuracy", "total"), map(float, m.groups())))
            for m in EPOCH_LINE.finditer(output)]


def test_a_copied_01_reports_the_mean_over_tokens(tmp_path):
    """01 copied with the language model trains two epochs (accumulation, warm-up + cosine, clipping) in this
    process; the loss falls, and the last epoch line's test loss, token accuracy and count are those computed here
    from the checkpoint: sums over the test set's tokens, divided by the number of tokens. The mean over samples of
    each line's mean differs from it by far more than the rounding, so the test tells the two apart."""
    script = copy_step("01_single_gpu", tmp_path / "project", USER_CODE, NAMES) / "train.py"
    data, checkpoint = write_lines(tmp_path / "data"), tmp_path / "ckpt.pt"
    module, output = load_step_module("01_copied_sequence", script), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(output):
        patch.setattr(sys, "argv", [str(script), *FLAGS, "--data-dir", data, "--epochs", "2", "--batch-size", "16",
                                    "--checkpoint", str(checkpoint)])
        module.train(module.parse_args(), torch.device("cpu"))
    first, last = epochs(output.getvalue())
    assert last["loss"] < first["loss"], output.getvalue()

    net = module.Net()
    net.load_state_dict(weights(checkpoint))
    net.eval()
    _, test_set = module.load_datasets(Namespace(data_dir=data))
    inputs, targets = (torch.stack(tensors) for tensors in zip(*(test_set[i] for i in range(len(test_set)))))
    with torch.no_grad():
        logits = net(inputs)
    losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100).double()  # 0: pad
    counted = targets != -100
    tokens, correct = int(counted.sum()), int((logits.argmax(-1) == targets)[counted].sum())
    per_token = losses.sum().item() / tokens
    per_sample = (losses.sum(1) / counted.sum(1)).mean().item()
    print(f"test loss printed {last['test_loss']:.4f}, over tokens {per_token:.6f}, over samples {per_sample:.6f}; "
          f"train loss {first['loss']:.4f} -> {last['loss']:.4f}; {correct}/{tokens} tokens right")
    assert last["total"] == tokens and len(test_set) < tokens, (last, len(test_set), tokens)  # counts tokens
    assert abs(last["test_loss"] - per_token) <= 0.5e-4 + 1e-6, (last["test_loss"], per_token)
    assert abs(last["accuracy"] - correct / tokens) <= 0.5e-4 + 1e-6, (last["accuracy"], correct / tokens)
    assert abs(per_sample - per_token) > 1e-3, (per_sample, per_token)  # the two means are far apart here


HOLD = 4  # the optimizer step (of 8) after which the stopped run's ranks are held and get SIGTERM


def test_a_copied_05_resumes_the_language_model_bit_for_bit(tmp_path):
    """05 copied with the language model (dropout, AdamW with two parameter groups), two ranks as srun starts them,
    8 x --accumulate 2 each, warm-up + cosine, clipping, one epoch of 8 optimizer steps: a run stopped by SIGTERM
    after step HOLD and resumed ends with the uninterrupted run's weights, AdamW moments and steps, and parameter
    groups bit for bit, and prints the same epoch line, counted in tokens."""
    script = copy_step("05_ddp_slurm", tmp_path / "project", USER_CODE, NAMES) / "train.py"
    data, site = write_lines(tmp_path / "data"), tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)  # test_preemption's: the hold and the step clock
    flags = [*FLAGS, "--data-dir", data, "--epochs", "1", "--batch-size", "8"]
    uninterrupted, checkpoint = tmp_path / "uninterrupted.pt", tmp_path / "stopped.pt"
    hold, held, _ = hold_env(tmp_path, HOLD)
    runs = [start_copy(script, [*flags, "--checkpoint", str(uninterrupted)], dict(PYTHONPATH=str(site))),
            start_copy(script, [*flags, "--checkpoint", str(checkpoint)], dict(PYTHONPATH=str(site), **hold))]
    wait_for(lambda: len(held()) == 2 or any(p.poll() is not None for p in runs[1]), 120, "both ranks held")
    for proc in runs[1]:
        os.kill(proc.pid, signal.SIGTERM)
    (codes, output), (stop_codes, stopped) = finish_all(runs[0]), finish_all(runs[1])
    assert codes == [0, 0], output
    assert stop_codes == [REQUEUE_CODE] * 2 and STOPPED.findall(stopped) == [("1", str(HOLD), "SIGTERM")], stopped
    mid_epoch = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert mid_epoch["step"] == HOLD, mid_epoch.keys()
    resume_codes, resumed = finish_all(start_copy(script, [*flags, "--checkpoint", str(checkpoint)],
                                                  dict(PYTHONPATH=str(site))))
    assert resume_codes == [0, 0] and f"at epoch 1 step {HOLD}" in resumed, resumed

    expected = torch.load(uninterrupted, map_location="cpu", weights_only=True)
    final = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert all(torch.equal(final["model"][k], expected["model"][k]) for k in expected["model"]), "not bit for bit"
    assert not all(torch.equal(mid_epoch["model"][k], expected["model"][k]) for k in expected["model"])  # it trained on
    states = final["optimizer"]["state"], expected["optimizer"]["state"]
    assert states[0].keys() == states[1].keys() and len(states[1]) == len(expected["model"])
    for index, state in states[1].items():
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"] and float(state["step"]) == 8, state.keys()
        assert all(torch.equal(states[0][index][key], value) for key, value in state.items()), index
    groups = expected["optimizer"]["param_groups"]
    assert final["optimizer"]["param_groups"] == groups
    # The cosine's end: the rate of the last of 8 steps (each step's is set before it), warm-up 0.8 of a step.
    last = 0.01 * (1 + math.cos(math.pi * (7 - 0.8) / (8 - 0.8))) / 2
    assert [(g["weight_decay"], g["lr"]) for g in groups] == [(0.1, pytest.approx(last, rel=1e-9)),
                                                             (0.0, pytest.approx(last, rel=1e-9))], groups
    [line], [again] = epochs(output), epochs(resumed)
    lines = (tmp_path / "data" / "lines.txt").read_text().split()
    tokens = sum(min(len(text), T + 1) - 1 for text in lines[len(lines) * 2 // 3:])
    print(f"05 copied: uninterrupted {line}, resumed {again}; {tokens} test tokens")
    assert again == line and line["total"] == tokens, (line, again, tokens)


@pytest.mark.parametrize("step", ["01_single_gpu", "05_ddp_slurm"])
def test_the_copy_changes_only_the_named_parts(tmp_path, step):
    """Every line that differs between the copied train.py and the step's lies inside the named definitions of the
    step's and inside the user's code in the copy's; the folder's other files are the step's, byte for byte. This
    checks the copy the other tests run, as copy_step made it; that such a copy needs no other change is what they
    prove, by training, reporting the token mean and resuming bit for bit."""
    folder = copy_step(step, tmp_path / "project", USER_CODE, NAMES)
    original, copied = (REPO / step / "train.py").read_text(), (folder / "train.py").read_text()

    def spans(source, keep):  # the line numbers of the top-level statements keep(node) selects
        return {line for node in ast.parse(source).body if keep(node)
                for line in range(node.lineno, node.end_lineno + 1)}
    user_names = {defined_name(node) for node in ast.parse(USER_CODE).body}
    assert set(NAMES) <= user_names
    replaced, written = spans(original, lambda node: defined_name(node) in NAMES), spans(
        copied, lambda node: defined_name(node) in user_names)
    old, new = original.splitlines(), copied.splitlines()
    removed, added = set(), set()
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag != "equal":
            removed.update(i for i in range(i1 + 1, i2 + 1) if old[i - 1].strip())  # blank lines may pair up anyhow
            added.update(j for j in range(j1 + 1, j2 + 1) if new[j - 1].strip())
    print(f"{step}: {len(removed)} lines replaced, {len(added)} written")
    assert removed and removed <= replaced, [old[i - 1] for i in sorted(removed - replaced)]
    assert added and added <= written, [new[j - 1] for j in sorted(added - written)]
    others = sorted(path.name for path in (REPO / step).iterdir() if path.is_file() and path.name != "train.py")
    assert others == sorted(path.name for path in folder.iterdir() if path.is_file() and path.name != "train.py")
    assert filecmp.cmpfiles(REPO / step, folder, others, shallow=False)[0] == others
