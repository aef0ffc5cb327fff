"""The ladder's promises about its text: what a step does not change stays byte-identical and in the same
order, every train.py stands alone (no import from another folder), and nothing hard-codes CUDA."""
import ast
import re
import subprocess

import pytest

from conftest import REPO, STEPS

# The order every train.py follows (a step may lack some), and, for each top-level definition, the runs
# of consecutive steps that must hold it byte for byte. A new step-specific change belongs in this table.
ORDER = ["parse_args", "download_mnist", "load_datasets", "Net", "ResumableSampler", "STOP_SIGNALS", "STOP",
         "STOP_CHECK_SECONDS", "STOP_LEAD_SECONDS", "STOPPED", "signalled", "stop_requested", "train_one_epoch",
         "evaluate", "save_checkpoint", "load_checkpoint", "setup", "train", "report_stop", "run", "PORT_PROBE", "main"]
SHARED = {
    "download_mnist": ["01 02 03 04 05 06"],
    "load_datasets": ["01 02 03 04 05 06"],
    "Net": ["01 02 03 04 05 06"],
    "parse_args": ["01 02"],
    "train_one_epoch": ["01 02", "03 04", "05 06"],
    "evaluate": ["01 02", "03 04", "05 06"],
    "save_checkpoint": ["01 02 03 04", "05 06"],
    "load_checkpoint": ["01 02", "03 04 05 06"],
    "setup": ["03 04", "05 06"],
    "train": ["03 04", "05 06"],
    "ResumableSampler": ["05 06"],
    "STOP_SIGNALS": ["05 06"],
    "STOP": ["05 06"],
    "STOP_CHECK_SECONDS": ["05 06"],
    "STOP_LEAD_SECONDS": ["05 06"],
    "STOPPED": ["05 06"],
    "signalled": ["05 06"],
    "stop_requested": ["05 06"],
    "report_stop": ["05 06"],
}
ALLOWED_IMPORTS = {"argparse", "datetime", "importlib", "multiprocessing", "os", "shlex", "signal", "socket", "sys", "time",
                   "torch", "torchvision", "submitit"}


def definitions(step):
    source = (REPO / step / "train.py").read_text()
    lines = source.splitlines(keepends=True)
    found = {}
    for node in ast.parse(source).body:
        name = getattr(node, "name", None) or (node.targets[0].id if isinstance(node, ast.Assign) else None)
        if name:
            first = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
            found[name] = "".join(lines[first - 1:node.end_lineno])
    return found


@pytest.mark.parametrize("name", list(SHARED))
def test_unchanged_parts_are_byte_identical(name):
    by_number = {step[:2]: definitions(step) for step in STEPS}
    for group in SHARED[name]:
        texts = {number: by_number[number][name] for number in group.split()}
        first = texts[group.split()[0]]
        assert all(text == first for text in texts.values()), f"{name} differs within steps {group}"


@pytest.mark.parametrize("step", STEPS)
def test_definitions_keep_the_common_order(step):
    names = list(definitions(step))
    assert all(name in ORDER for name in names), names
    assert names == sorted(names, key=ORDER.index)


@pytest.mark.parametrize("step", STEPS)
def test_each_script_stands_alone(step):
    tree = ast.parse((REPO / step / "train.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import in {step}"
            imported.add(node.module.split(".")[0])
    assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS
    assert "sys.path" not in (REPO / step / "train.py").read_text()


@pytest.mark.parametrize("step", STEPS)
def test_no_hard_coded_cuda(step):
    source = (REPO / step / "train.py").read_text()
    assert not re.search(r"\.cuda\(|[\"']cuda:\d", source)
    for line in source.splitlines():
        if 'torch.device("cuda"' in line:  # only where a GPU was found
            assert "is_available()" in line or "local_rank" in line, line


def test_the_readme_gives_the_real_diff_sizes():
    """The README's table of changed lines between neighbours, as `diff A B | grep -c '^[<>]'` counts them."""
    counts = []
    for before, after in zip(STEPS, STEPS[1:]):
        diff = subprocess.run(["diff", f"{before}/train.py", f"{after}/train.py"], cwd=REPO, capture_output=True,
                              text=True).stdout
        counts.append(sum(line[:1] in "<>" for line in diff.splitlines()))
    row = re.search(r"^\| 01 -> 02 \|.*\n\|[-|]+\|\n\|([\d |]+)\|$", (REPO / "README.md").read_text(), re.M)
    assert row and [int(n) for n in row.group(1).split("|")] == counts, f"README table; the files give {counts}"


# The generated blocks each step page must hold: its train.py against the previous step's, and its launch
# script against the previous one (or whole, where there was none before).
PAGE_BLOCKS = {
    "01_single_gpu": ["file 01_single_gpu/run.sh"],
    "02_dataparallel": ["diff 01_single_gpu/train.py 02_dataparallel/train.py",
                        "diff 01_single_gpu/run.sh 02_dataparallel/run.sh"],
    "03_ddp_mpspawn": ["diff 02_dataparallel/train.py 03_ddp_mpspawn/train.py",
                       "diff 02_dataparallel/run.sh 03_ddp_mpspawn/run.sh"],
    "04_ddp_torchrun": ["diff 03_ddp_mpspawn/train.py 04_ddp_torchrun/train.py",
                        "diff 03_ddp_mpspawn/run.sh 04_ddp_torchrun/run.sh", "file 04_ddp_torchrun/submit.sh"],
    "05_ddp_slurm": ["diff 04_ddp_torchrun/train.py 05_ddp_slurm/train.py",
                     "diff 04_ddp_torchrun/submit.sh 05_ddp_slurm/submit.sh"],
    "06_ddp_submitit": ["diff 05_ddp_slurm/train.py 06_ddp_submitit/train.py"],
}


def test_every_step_has_its_page_with_its_diffs():
    import pages
    assert sorted(PAGE_BLOCKS) == sorted(STEPS)
    readme = (REPO / "README.md").read_text()
    for step, blocks in PAGE_BLOCKS.items():
        text = (REPO / step / "README.md").read_text()
        found = [f"{kind} {' '.join(p for p in paths if p)}" for _, kind, *paths, _ in pages.BLOCK.findall(text)]
        assert found == blocks, f"{step}/README.md holds the generated blocks {found}"
        assert f"]({step}/README.md)" in readme, f"the README does not link {step}/README.md"


def test_generated_blocks_match_the_files():
    """Every generated block of every step page is what `python tests/pages.py` makes of today's files."""
    import pages
    stale = [str(page.relative_to(REPO)) for page in pages.pages() if pages.render(page.read_text()) != page.read_text()]
    assert not stale, f"generated blocks out of date in {', '.join(stale)}: run `python tests/pages.py`"
