"""The ladder's promises about its text: what a step does not change stays byte-identical and in the same
order, every train.py stands alone (no import from another folder), and nothing hard-codes CUDA."""
import ast
import fnmatch
import re
import subprocess

import pytest

from conftest import REPO, STEPS

# The order every train.py follows (a step may lack some), and, for each top-level definition, the runs
# of consecutive steps that must hold it byte for byte. A new step-specific change belongs in this table.
ORDER = ["parse_args", "add_submission_flags", "sbatch_option", "check_submission_flags",
         "load_datasets", "Net", "METRIC", "loss_and_metric", "make_optimizer", "get_lr",
         "STOP_SIGNALS", "REQUEUE_EXIT_CODE", "MAX_STALLED_RUNS", "noted_stop_signals", "catch_stop_signals",
         "stop_signal_received", "StopVote", "ResumableSampler", "start_progress", "stop_run", "periodic_save",
         "make_loaders", "train_step", "train_one_epoch", "evaluate", "save_checkpoint", "load_checkpoint",
         "exit_with_error", "setup", "train", "run", "make_executor", "main",
         # The site checks, set apart at the end of the file.
         "check_same_checkpoint", "gpus_on_node", "check_launch", "run_id", "write_probe", "probe_error",
         "check_gpus_not_shared"]
SHARED = {
    "METRIC": ["01 02 03 04 05 06"],
    "loss_and_metric": ["01 02 03 04 05 06"],
    "make_optimizer": ["01 02 03 04 05 06"],
    "get_lr": ["01 02 03 04 05 06"],
    "load_datasets": ["01 02 03 04 05 06"],
    "Net": ["01 02 03 04 05 06"],
    "parse_args": ["01 02"],
    "train_step": ["01 02", "03 04 05 06"],
    "train_one_epoch": ["01 02", "03 04", "05 06"],
    "evaluate": ["01 02", "03 04", "05 06"],
    "save_checkpoint": ["01 02 03 04 05 06"],
    "load_checkpoint": ["01 02", "03 04 05 06"],
    "exit_with_error": ["03 04 05 06"],
    "check_same_checkpoint": ["03 04 05 06"],
    "setup": ["05 06"],
    "train": ["03 04", "05 06"],
    "make_loaders": ["01 02", "03 04", "05 06"],
    "STOP_SIGNALS": ["05 06"],
    "REQUEUE_EXIT_CODE": ["05 06"],
    "MAX_STALLED_RUNS": ["05 06"],
    "noted_stop_signals": ["05 06"],
    "catch_stop_signals": ["05 06"],
    "stop_signal_received": ["05 06"],
    "StopVote": ["05 06"],
    "ResumableSampler": ["05 06"],
    "start_progress": ["05 06"],
    "stop_run": ["05 06"],
    "periodic_save": ["05 06"],
    "gpus_on_node": ["05 06"],
    "check_launch": ["05 06"],
    "run_id": ["05 06"],
    "write_probe": ["05 06"],
    "probe_error": ["05 06"],
    "check_gpus_not_shared": ["05 06"],
}
ALLOWED_IMPORTS = {"argparse", "contextlib", "datetime", "importlib", "math", "multiprocessing", "os",
                   "signal", "socket", "sys", "time", "torch", "torchvision", "submitit"}


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


WIDTH = 99  # PEP 8's limit for code a team agrees on: whole in a split view, and in `diff -y -W 206`


@pytest.mark.parametrize("step", STEPS)
def test_every_line_fits_a_split_view(step):
    """Every line of the step's train.py and launch scripts is at most 99 columns, so that two files side by
    side (the README's `diff -y -W 206`, an editor's split view) show every line whole."""
    for path in sorted((REPO / step).glob("*.py")) + sorted((REPO / step).glob("*.sh")):
        wide = [f"{path.name}:{number}" for number, line in enumerate(path.read_text().splitlines(), 1)
                if len(line) > WIDTH]
        assert not wide, f"lines over {WIDTH} columns in {step}: {wide}"


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


def test_the_top_level_holds_the_design_only():
    """The top level holds the six steps, requirements.txt, README.md, tests/, pytest.ini and dot-files, besides
    what .gitignore ignores (what the runs write: data, checkpoints, logs); anything else fails, in a git
    checkout or a copy without git alike."""
    ignored = [line.strip("/") for line in (REPO / ".gitignore").read_text().split() if not line.startswith("#")]
    names = {path.name for path in REPO.iterdir() if not any(fnmatch.fnmatch(path.name, p) for p in ignored)}
    stray = {name for name in names if not name.startswith(".")} - {*STEPS, "requirements.txt", "README.md",
                                                                     "tests", "pytest.ini"}
    assert not stray, f"files at the top level that the design has no place for: {sorted(stray)}"


def test_the_readme_gives_the_real_diff_sizes():
    """The README's table of changed lines between neighbours, as `diff A B | grep -c '^[<>]'` counts them."""
    counts = []
    for before, after in zip(STEPS, STEPS[1:]):
        diff = subprocess.run(["diff", f"{before}/train.py", f"{after}/train.py"], cwd=REPO, capture_output=True,
                              text=True).stdout
        counts.append(sum(line[:1] in "<>" for line in diff.splitlines()))
    row = re.search(r"^\| 01 -> 02 \|.*\n\|[-|]+\|\n\|([\d |]+)\|$", (REPO / "README.md").read_text(), re.M)
    assert row and [int(n) for n in row.group(1).split("|")] == counts, f"README table; the files give {counts}"


# The generated blocks each step page must hold: the output of a real run, its train.py against the previous
# step's, and its launch script against the previous one (or whole, where there was none before; a batch
# script, submit.sh, is linked from the page: its comments are its explanation).
PAGE_BLOCKS = {
    "01_single_gpu": ["output 01", "file 01_single_gpu/run.sh"],
    "02_dataparallel": ["output 02", "diff 01_single_gpu/train.py 02_dataparallel/train.py",
                        "diff 01_single_gpu/run.sh 02_dataparallel/run.sh"],
    "03_ddp_mpspawn": ["output 03", "diff 02_dataparallel/train.py 03_ddp_mpspawn/train.py",
                       "diff 02_dataparallel/run.sh 03_ddp_mpspawn/run.sh"],
    "04_ddp_torchrun": ["output 04", "diff 03_ddp_mpspawn/train.py 04_ddp_torchrun/train.py",
                        "diff 03_ddp_mpspawn/run.sh 04_ddp_torchrun/run.sh"],
    "05_ddp_slurm": ["output 05", "diff 04_ddp_torchrun/train.py 05_ddp_slurm/train.py"],
    "06_ddp_submitit": ["output 06", "diff 05_ddp_slurm/train.py 06_ddp_submitit/train.py"],
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


def printed_formats(step):
    """A regex that a line printed by the step's own files matches: a run of their messages, each an f-string
    or string of train.py or an echo of its shell scripts, whose fields may hold anything; a line starts with
    a message's own words."""
    messages = []
    for node in ast.walk(ast.parse((REPO / step / "train.py").read_text())):
        if isinstance(node, ast.JoinedStr):
            # A message written in one piece ends with its newline, which a line of output does not hold.
            messages.append([re.escape(v.value.rstrip("\n")) if isinstance(v, ast.Constant) else None
                             for v in node.values])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            messages.append([re.escape(node.value)])
    for script in (REPO / step).glob("*.sh"):
        for echo in re.findall(r"^\s*echo ((?:.*\\\n)*.*)$", script.read_text(), re.M):
            text = " ".join(re.findall(r'"([^"]*)"', echo))
            parts = re.split(r"\$\{[^}]*\}|\$\w+", text)
            messages.append([x for part in parts for x in (re.escape(part), None)][:-1])
    def pattern(parts):
        return "".join(".+?" if part is None else part for part in parts)
    words = [parts for parts in messages if sum(len(p) for p in parts if p) >= 3]
    first = "|".join(pattern(parts) for parts in words if parts[0] and len(parts[0]) >= 3)
    return re.compile(f"(?:{first})(?:{'|'.join(pattern(parts) for parts in words)})*")


# Lines of an output block that other programs print: sbatch, torchrun (its log lines and its warning about
# OMP_NUM_THREADS), Slurm's and submitit's.
FOREIGN = re.compile(r"^(Submitted batch job \d+|\[?[WIE]\d{4} .*|\*+|Setting OMP_NUM_THREADS environment variable .*|"
                     r"(srun|slurmstepd|sbatch|submitit)\b.*)$")


@pytest.mark.parametrize("step", STEPS)
def test_output_blocks_are_what_the_step_prints(step):
    """Each line of a page's sample output, from a real run, is one that the step's files still print (its
    numbers and names aside), or another program's; sacct's table and the high job are Slurm's."""
    import pages
    formats = printed_formats(step)
    for name, block in pages.output_blocks((REPO / step / "README.md").read_text()):
        command = f"python tests/pages.py --outputs {name}"
        assert re.search(r"^Printed on \d{4}-\d\d-\d\d, on .+:$", block, re.M), f"no machine and date: {command}"
        ours = True
        for line in block.split("```console\n", 1)[1].rsplit("```", 1)[0].splitlines():
            if line.startswith("$ "):
                ours = not line.startswith(("$ sacct", f"$ {pages.HIGH}", "$ wait"))
            elif ours and line.strip() and not FOREIGN.match(line):
                assert formats.fullmatch(line), f"{step}/README.md: no print of {step} gives {line!r}: run `{command}`"


def parser_flags(step):
    source = (REPO / step / "train.py").read_text()
    return set(re.findall(r"add_argument\(\s*\"(--[a-z-]+)\"", source))


def test_the_readme_links_and_flags_exist():
    """Every link of the README and tests/README.md points at a file that exists; every flag the README's
    prose names is one of a train.py; every command line of the README that runs a step passes that step's
    flags only."""
    every_flag = set().union(*(parser_flags(step) for step in STEPS)) | {"--help"}  # argparse's own
    for readme in (REPO / "README.md", REPO / "tests" / "README.md"):
        text = readme.read_text()
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            assert (readme.parent / target).exists(), f"{readme.relative_to(REPO)} links {target}, which is missing"
    text = (REPO / "README.md").read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", prose))
    assert named <= every_flag, f"the README names flags that no train.py has: {named - every_flag}"
    for step, args in re.findall(r"(\d\d_\w+)/(?:train\.py|run\.sh|submit\.sh)((?: [^#\n]*)?)", text):
        flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", args))
        assert flags <= parser_flags(step), f"README runs {step} with {flags - parser_flags(step)}"


def test_pages_stay_short():
    """The README at most 120 lines, each step page at most 150 lines of prose besides its generated blocks."""
    import pages
    assert len((REPO / "README.md").read_text().splitlines()) <= 120
    for page in pages.pages():
        lines = len(pages.BLOCK.sub("", page.read_text()).splitlines())
        assert lines <= 150, f"{page.relative_to(REPO)}: {lines} lines of prose"
