"""A user copies one step folder into their own project, replaces load_datasets() and Net with their own and
changes nothing else: the copy trains on a dataset that takes one int index per sample, as torchvision's do (a
list of indices raises TypeError), with data-loader workers started by forkserver (Python 3.14's default) or
without, and every step ends with the weights of 01. The dataset draws a random number per sample, as a random
augmentation would: every process, ranks and workers alike, draws its own, and the same --seed draws them again."""
import ast
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import REPO, TOLERANCE, child_env, max_abs_diff, run, submitit_logs, weights

USER_CODE = '''
class ShapesDataset(torch.utils.data.Dataset):
    """One sample per call, as torchvision's datasets: an int index in, (image, label) out. Each sample is made from
    its index alone, as a file would be read from disk. It draws one random number, as a random augmentation would,
    and appends it to $TEST_DRAWS_LOG with its process id."""

    def __init__(self, size, first):
        self.size, self.first = size, first

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        if not isinstance(index, int):
            raise TypeError(f"ShapesDataset takes one int index, not {type(index).__name__}")
        generator = torch.Generator().manual_seed(self.first + index)
        label = int(torch.randint(0, 4, (), generator=generator))
        image = torch.randn(3, 12, 12, generator=generator)
        image[label % 3, label // 3 * 6:label // 3 * 6 + 6] += 2  # class = a bright band in one channel
        draw = torch.rand(()).item()  # the augmentation's random number; not applied, so the steps stay comparable
        if os.environ.get("TEST_DRAWS_LOG"):
            with open(os.environ["TEST_DRAWS_LOG"], "a") as log:
                log.write(f"{os.getpid()} {draw!r}\\n")
        return image, label


def load_datasets(args):
    return ShapesDataset(640, 0), ShapesDataset(160, 100_000)


class Net(nn.Module):
    """Not the ladder's CNN: a small MLP with LayerNorm."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(3 * 12 * 12, 64), nn.LayerNorm(64), nn.Tanh(),
                                    nn.Linear(64, 4))

    def forward(self, x):
        return self.layers(x)
'''
SITECUSTOMIZE = '''
import multiprocessing, os
if os.environ.get("TEST_START_METHOD"):
    multiprocessing.set_start_method(os.environ["TEST_START_METHOD"], force=True)
'''


def defined_name(node):
    """The name a top-level statement defines: a function's or a class's, or the one name an assignment sets
    (METRIC = "accuracy"); else None."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return getattr(node, "name", None)


def replace_definitions(source, names, code):
    """source with the top-level definitions (functions, classes, assignments to one name) called names removed and
    code put where the first of them was."""
    nodes = [node for node in ast.parse(source).body if defined_name(node) in names]
    assert sorted(map(defined_name, nodes)) == sorted(names), names
    lines = source.splitlines(keepends=True)
    for node in sorted(nodes, key=lambda node: node.lineno, reverse=True):
        first = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
        lines[first - 1:node.end_lineno] = [code] if node is min(nodes, key=lambda node: node.lineno) else []
    return "".join(lines)


def copy_step(step, project, code=USER_CODE, names=("load_datasets", "Net")):
    """step's folder alone in project, with names replaced by code, as a user would do it."""
    shutil.copytree(REPO / step, project / step)
    script = project / step / "train.py"
    script.write_text(replace_definitions(script.read_text(), names, code))
    return project / step


def draws_by_process(log):
    """The random numbers each process drew, in order, as a sorted list of sequences (the pids left out)."""
    sequences = {}
    for line in Path(log).read_text().splitlines():
        pid, draw = line.split()
        sequences.setdefault(pid, []).append(draw)
    return sorted(sequences.values())


@pytest.fixture(scope="session")
def project(shared):
    """Every step copied alone into a project folder of its own (01, 03, 04, 06), nothing else of the repository;
    made once for all pytest-xdist workers."""
    def compute(root):
        for step in ("01_single_gpu", "03_ddp_mpspawn", "04_ddp_torchrun", "06_ddp_submitit"):
            copy_step(step, root / step)
        site = root / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        return root
    return shared("copied-project", compute)


def run_copy(project, step, workers, folder, seed=0):
    """One epoch of the copied step, global batch 64 (2 processes x 32 from 03 on); returns (result, checkpoint,
    draws log)."""
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint, draws = folder / "ckpt.pt", folder / "draws.log"
    flags = ["--epochs", "1", "--workers", str(workers), "--seed", str(seed), "--checkpoint", str(checkpoint),
             "--test-batch-size", "40",
             "--batch-size", "64" if step == "01_single_gpu" else "32"]
    env = child_env(PYTHONPATH=str(project / "site"), TEST_START_METHOD="forkserver", TEST_DRAWS_LOG=str(draws))
    cwd = project / step
    if step == "01_single_gpu":
        result = run(["bash", f"{step}/run.sh", *flags], env=env, cwd=cwd)
    elif step == "03_ddp_mpspawn":
        result = run([sys.executable, f"{step}/train.py", "--world-size", "2", *flags], env=env, cwd=cwd)
    elif step == "04_ddp_torchrun":
        result = run(["bash", f"{step}/run.sh", *flags], env=dict(env, NPROC_PER_NODE="2"), cwd=cwd)
    else:
        logs = folder / "logs"
        result = run([sys.executable, f"{step}/train.py", "--local", "--tasks-per-node", "2", "--log-dir", str(logs),
                      *flags], env=env, cwd=cwd)
        result.output += submitit_logs(logs)
    return result, checkpoint, draws


@pytest.fixture(scope="session")
def copies(project, shared):
    """(step, workers, seed) -> (result, checkpoint, draws log): each run once, whichever worker asks first."""
    def get(step, workers, seed=0):
        return shared(f"copy-{step}-workers{workers}-seed{seed}",
                      lambda folder: run_copy(project, step, workers, folder, seed))
    return get


CASES = [("01_single_gpu", 1), ("03_ddp_mpspawn", 0), ("03_ddp_mpspawn", 1), ("04_ddp_torchrun", 1),
         ("06_ddp_submitit", 1)]


@pytest.mark.parametrize("step, workers", CASES, ids=[f"{step}-workers{workers}" for step, workers in CASES])
def test_a_copied_step_trains_a_per_sample_dataset_like_01(copies, step, workers):
    reference, reference_checkpoint, _ = copies("01_single_gpu", 0)
    result, checkpoint, draws = copies(step, workers)
    assert reference.returncode == 0, reference
    assert result.returncode == 0, result
    [epoch] = result.epochs()
    assert epoch["total"] == 160 and epoch["acc"] > 60, result  # 4 classes: chance is 25%
    diff = max_abs_diff(weights(checkpoint), weights(reference_checkpoint))
    print(f"{step} copied, {workers} workers: max abs diff to 01 without workers {diff:.1e}")
    assert diff <= TOLERANCE
    fetched = [len(sequence) for sequence in draws_by_process(draws)]  # samples fetched by each process
    assert sum(fetched) == 640 + 160, fetched  # every training and test sample once
    # Who fetched them: each rank's main process without workers, else the workers of its two loaders.
    ranks = 1 if step == "01_single_gpu" else 2
    assert len(fetched) == ranks * (2 * workers or 1), fetched


@pytest.mark.parametrize("workers", [0, 1])
def test_every_rank_and_worker_draws_its_own_random_numbers(copies, workers):
    """With two ranks (03), each process that fetches samples (a rank, or a worker of a rank's loader) draws its
    own sequence of random numbers: no two start alike (a seed shared by the ranks would repeat them)."""
    result, _, draws = copies("03_ddp_mpspawn", workers)
    assert result.returncode == 0, result
    starts = Counter(tuple(sequence[:3]) for sequence in draws_by_process(draws))
    assert len(starts) == 2 * (2 * workers or 1) and max(starts.values()) == 1, starts.most_common(2)


def test_the_seed_repeats_the_random_numbers(copies):
    """The same --seed draws the same sequences again, in every worker, whichever launcher started the ranks (03's
    mp.spawn, 04's torchrun: what they draw depends on the seed, the epoch and the rank alone); another seed draws
    others."""
    runs = [copies(step, 1, seed) for step, seed in (("03_ddp_mpspawn", 0), ("04_ddp_torchrun", 0),
                                                      ("03_ddp_mpspawn", 1))]
    assert all(result.returncode == 0 for result, _, _ in runs), runs
    first, again, other = (draws_by_process(draws) for _, _, draws in runs)
    assert len(first) == 4 and again == first
    assert not {tuple(s[:3]) for s in other} & {tuple(s[:3]) for s in first}


@pytest.mark.slurm
def test_a_copied_05_trains_on_slurm(slurm, project, copies, tmp_path):
    """05 copied alone into a project, submitted from its root with its own submit.sh on two nodes, one task and
    one data-loader worker each (started by forkserver): the weights of 01."""
    from test_slurm import finish, job_id_of, read, sbatch_05
    copy_step("05_ddp_slurm", tmp_path / "project")
    _, reference, _ = copies("01_single_gpu", 0)
    env = dict(PYTHONPATH=str(project / "site"), TEST_START_METHOD="forkserver")
    proc = sbatch_05(tmp_path, 2, 1, ["--workers", "1", "--epochs", "1", "--batch-size", "32", "--test-batch-size", "40",
                                      "--checkpoint", f"{tmp_path}/ckpt.pt"], env=env, cwd=tmp_path / "project")
    job_id = job_id_of(proc)
    assert finish(proc, 180) == 0, read(tmp_path / f"ddp-slurm-{job_id}.out")
    diff = max_abs_diff(weights(tmp_path / "ckpt.pt"), weights(reference))
    print(f"05 copied, on Slurm with a worker per task: max abs diff to 01 {diff:.1e}")
    assert diff <= TOLERANCE
