"""The README and docs/ kept true to the code (``python3 -m pytest -q tests/test_docs.py``). Pure (the
Markdown files, the scripts, the sources parsed with ``ast``) but for one parametrized test that runs the
documented commands under ``DRY_RUN=1`` (about a second each). The rules:

1. Scripts: every ``training_scripts/*.sh`` the README and the pages name exists, every other ``*.sh``
   they name exists somewhere in the repository, and the README's scripts table names every script in
   ``training_scripts/`` but ``_entry.sh`` (which the others source).
2. Variables named: every UPPER_CASE name in an inline code span that looks like an environment variable
   (it has an underscore, or is written ``NAME=...`` or ``$NAME``) occurs in the sources (``orchestration/``,
   ``megatron_ext/``, ``training_scripts/``, ``.ci/``), or is in :data:`THIRD_PARTY_PREFIXES` /
   :data:`NOT_OUR_VARIABLES`, each with the reason it is not ours.
3. Variables read: every variable the launcher reads is in ``docs/environment.md``: the string keys of
   ``env.get("X")``, ``env["X"]``, ``"X" in env``, helpers called with ``env`` and ``"X"`` (``_int(env,
   "X", ...)``, ``_text(env, "X")``), a local reader lambda (``text("X")``), and the names iterated into
   ``env[name]`` from a literal or a module-level dict, in every function with an ``env`` parameter of
   :data:`ENVIRONMENT_READERS`.
4. Commands: every command in a code block (fenced or indented) that starts, after ``NAME=value``
   assignments, with ``bash training_scripts/X.sh`` or ``python3 -m orchestration SUB`` and whose
   subcommand prints a plan under ``DRY_RUN=1`` (:data:`DRY_RUN_SUBCOMMANDS`: start, train, stop, submit,
   sweep, import-megatron-args, and plan-memory, which is pure) runs with ``DRY_RUN=1`` and this test's own
   ``ARTIFACT_ROOT`` to exit 0 with no traceback. Skipped, each with its reason (:func:`skip_reason`):
   - placeholders: a word with ``...``, ``<``, ``>``, ``[`` or ``]``, or an argument in capitals (``RUN``);
   - paths not here: an assignment or argument that starts with ``/`` or ``~`` (``/models/Qwen3-1.7B``), a
     ``*_DIR``/``*FILE`` assignment, or a positional argument that is a relative path (has a ``/`` or ends
     in ``.sh``, ``.txt``, ``.json``, ``.jsonl``); ``ENGINE=megatron-lm`` without a checkout too;
   - a stop that would ask other machines: its dry run asks every node what it would signal, over ssh
     (``HOSTS`` naming another host) or ``docker exec`` (``CONTAINER_NAME``); a start's dry run only plans,
     so multi-node starts run;
   - a submit that names a partition or an account: those are checked against a running ``slurmctld``
     (``salloc ...`` lines are not commands of this kind at all).
   status, compare, export-hf, preflight and setup_env are not run: they read a live run, a checkpoint,
   the nodes, or install packages.
5. Pages: every ``tests/test_*.py`` is listed in ``docs/testing.md``; every module and package of
   ``orchestration/`` and ``megatron_ext/`` has its line in ``docs/design.md``; every project path the
   pages name exists; every page is linked from the README, and every link between pages reaches a page
   and a heading that exist.
6. Code: every project path and dotted module name in the code's docstrings, comments and strings
   (``orchestration/node/board.py``, ``megatron_ext.run_spec.checksums.health``) exists, a dotted name
   down to what its module defines; path-like text that is not ours is in :data:`NAMED_ELSEWHERE`, with why.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, clean_env

README = REPO / "README.md"
DOCS_DIR = REPO / "docs"
PAGES = [README, *sorted(DOCS_DIR.glob("*.md"))]
ENVIRONMENT_PAGE = DOCS_DIR / "environment.md"
TESTING_PAGE = DOCS_DIR / "testing.md"
SCRIPTS_DIR = REPO / "training_scripts"
SOURCE_DIRS = ("orchestration", "megatron_ext", "training_scripts", ".ci", "tests/gpu")
"""Where the sources are (tests/gpu: the GPU check, a tool a user runs on a lent machine)."""

ENVIRONMENT_READERS = (
    "orchestration/launch_env.py",           # the launcher's one read of its environment
    "megatron_ext/run_spec/params.py",       # read_overrides: ZERO_STAGE, ENGINE (+ the resilience ones)
    "megatron_ext/run_spec/resilience.py",   # read_resilience_overrides: MAX_RESTARTS, HANG_*
    "megatron_ext/run_spec/wandb_run.py",    # read_wandb_settings: WANDB_*
    "megatron_ext/run_spec/run_paths.py",    # artifact_root: ARTIFACT_ROOT
    "megatron_ext/host/devices.py",      # visible_gpu_count: CUDA_VISIBLE_DEVICES (the NPROC_PER_NODE default)
)
"""The modules whose ``env``-taking functions are the launcher's reads (launch_env.py calls the others)."""

THIRD_PARTY_PREFIXES = {
    "NCCL_": "read by NCCL; the launcher forwards NCCL_* by prefix",
    "GLOO_": "read by gloo; forwarded by prefix",
    "TORCH_": "read by torch (TORCH_NCCL_DUMP_ON_TIMEOUT, ...); forwarded by prefix",
    "CUDA_": "read by the CUDA runtime; forwarded by prefix",
    "SLURM_": "set by Slurm for a job or a step",
    "SBATCH_": "read by sbatch itself",
    "WANDB_": "read by wandb itself (WANDB_RUN_GROUP, WANDB_TAGS, ...); forwarded by prefix",
    "HF_": "read by huggingface_hub / transformers (HF_HOME, HF_HUB_OFFLINE); forwarded by prefix",
    "PYTHON": "read by the interpreter (PYTHONPATH, ...); forwarded by prefix",
}
NOT_OUR_VARIABLES = {
    "MEGATRON_S3_SECRET": "an example name for a user's own secret (environment.md, Secrets)",
    "S3_ACCESS": "the same: an example of a secret name that is not forwarded",
    "MODEL_ARGS": "an array name inside a user's Megatron-LM argument file",
    "DATA_ARGS": "the same",
    "CAP_SYS_PTRACE": "a Linux capability (docker --cap-add SYS_PTRACE), not a variable",
    "CHECKPOINT_PAD_GB": "the test suite's own (tests/standins.py): how large a resume test pads its checkpoint",
}

DRY_RUN_SUBCOMMANDS = frozenset({"start", "train", "stop", "submit", "sweep", "import-megatron-args", "plan-memory"})
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1"})
OUTPUT_OPTIONS = frozenset({"--model-out", "--data-out", "--out", "--output-prefix"})
INPUT_SUFFIXES = (".sh", ".txt", ".json", ".jsonl")
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_UPPER = re.compile(r"^[A-Z][A-Z0-9_]*[A-Z0-9]$")


# -- reading the pages ------------------------------------------------------------------------------

def code_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of every fenced block and every indented block (four spaces after
    a blank line, not a list item's continuation)."""
    lines, blocks, i, prev_blank = text.splitlines(), [], 0, True
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                j += 1
            blocks.append((i + 2, "\n".join(lines[i + 1:j])))
            i, prev_blank = j + 1, False
            continue
        if line.startswith("    ") and prev_blank and not line.lstrip().startswith(("- ", "* ", "| ")):
            start, body = i + 1, []
            while i < len(lines) and (lines[i].startswith("    ")
                                      or (not lines[i].strip() and i + 1 < len(lines) and lines[i + 1].startswith("    "))):
                body.append(lines[i][4:])
                i += 1
            blocks.append((start, "\n".join(body)))
            prev_blank = False
            continue
        prev_blank = not line.strip()
        i += 1
    return blocks


def prose(text: str) -> str:
    """The page without its fenced blocks (inline code spans stay)."""
    return re.sub(r"^\s*```.*?^\s*```[^\n]*$", "", text, flags=re.S | re.M)


def inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


@dataclass(frozen=True)
class Command:
    """One documented launcher command: ``NAME=value ... bash training_scripts/X.sh ARGS`` or
    ``NAME=value ... python3 -m orchestration SUB ARGS``."""

    page: str
    line: int
    env: tuple[tuple[str, str], ...]
    script: str | None
    subcommand: str
    args: tuple[str, ...]

    @property
    def key(self) -> tuple:
        """What the command exercises: the same but for the run's name (or DRY_RUN written out) is
        the same command here."""
        args = list(self.args)
        positional = [i for i, a in enumerate(args) if not a.startswith("-")]
        run_at = 0 if self.subcommand == "stop" else 2 if self.subcommand in ("start", "train", "submit", "sweep") else None
        if run_at is not None and len(positional) > run_at:
            args[positional[run_at]] = "RUN"
        return tuple(kv for kv in self.env if kv[0] != "DRY_RUN"), self.script, self.subcommand, tuple(args)

    def describe(self) -> str:
        head = ["bash", f"training_scripts/{self.script}"] if self.script else ["python3", "-m", "orchestration", self.subcommand]
        return shlex.join([f"{k}={v}" for k, v in self.env] + head + list(self.args))


def script_subcommand(script: str) -> str | None:
    """The ``python -m orchestration SUB`` a training script execs (None: another program)."""
    path = SCRIPTS_DIR / script
    if not path.is_file():
        return None
    found = re.search(r"-m orchestration ([a-z][a-z-]*)", path.read_text())
    return found.group(1) if found else None


def commands_in(page: Path) -> list[Command]:
    out = []
    for start, block in code_blocks(page.read_text()):
        for offset, line in enumerate(re.sub(r"\\\n", " ", block).splitlines()):
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            for part in line.split("&&"):
                try:
                    words = shlex.split(part, comments=True)
                except ValueError:
                    continue
                env = []
                while words and _ASSIGNMENT.match(words[0]):
                    name, value = _ASSIGNMENT.match(words.pop(0)).groups()
                    env.append((name, value))
                if len(words) >= 2 and words[0] == "bash" and words[1].startswith("training_scripts/"):
                    script = words[1].split("/", 1)[1]
                    sub = script_subcommand(script)
                    if sub:
                        out.append(Command(page.name, start + offset, tuple(env), script, sub, tuple(words[2:])))
                elif len(words) >= 4 and words[0] in ("python3", "python") and words[1:3] == ["-m", "orchestration"]:
                    out.append(Command(page.name, start + offset, tuple(env), None, words[3], tuple(words[4:])))
    return out


def documented_commands() -> list[Command]:
    seen, out = set(), []
    for page in PAGES:
        for command in commands_in(page):
            if command.subcommand in DRY_RUN_SUBCOMMANDS and command.key not in seen:
                seen.add(command.key)
                out.append(command)
    return out


def _missing(path_text: str) -> bool:
    return not (REPO / Path(path_text).expanduser()).exists()


def skip_reason(command: Command) -> str | None:
    """Why a documented command cannot run here under DRY_RUN=1 (None: it must run). See the
    module docstring for the rules."""
    env = dict(command.env)
    words = [value for _, value in command.env] + list(command.args)
    for word in words:
        if any(mark in word for mark in ("...", "\u2026", "<", ">", "[", "]")):
            return f"placeholder {word!r}"
    for arg in command.args:
        if re.fullmatch(r"[A-Z][A-Z_]*", arg):
            return f"placeholder argument {arg}"
    for name, value in command.env:
        if (value.startswith(("/", "~")) or name.endswith(("_DIR", "FILE"))) and _missing(value):
            return f"{name}={value} does not exist here"
    previous = ""
    for arg in command.args:
        value = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
        positional = not arg.startswith("-") and not previous.startswith("-")
        if value.startswith(("/", "~")) and _missing(value):
            return f"{value} does not exist here"
        if positional and ("/" in value or value.endswith(INPUT_SUFFIXES)) and previous not in OUTPUT_OPTIONS and _missing(value):
            return f"{value} does not exist here"
        previous = arg
    if env.get("ENGINE") == "megatron-lm" and _missing(env.get("MEGATRON_LM_DIR", "") or "/nonexistent"):
        return "ENGINE=megatron-lm needs a Megatron-LM checkout"
    if command.subcommand == "stop":
        hosts = set(re.split(r"[,\s]+", env.get("HOSTS", "").strip())) - {""}
        if hosts - LOCAL_HOSTS or env.get("HOSTFILE"):
            return "a stop's dry run asks every node over ssh what it would signal (these hosts are not here)"
        if env.get("CONTAINER_NAME"):
            return "a stop's dry run asks every node through docker exec (no such container here)"
    if command.subcommand == "submit":
        if {"--partition", "--account"} & {a.split("=", 1)[0] for a in command.args} or \
                {"SBATCH_PARTITION", "SBATCH_ACCOUNT"} & set(env):
            return "a partition or account is checked against a running slurmctld"
    return None


# -- reading the sources ----------------------------------------------------------------------------

def source_words() -> set[str]:
    """Every UPPER_CASE word in the project's sources."""
    words: set[str] = set()
    for top in SOURCE_DIRS:
        for path in (REPO / top).rglob("*"):
            if path.is_file() and (path.suffix in (".py", ".sh", ".tsv") or path.parent.name == ".ci"):
                words |= set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", path.read_text(errors="replace")))
    return words


def _upper_constants(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and _UPPER.match(n.value)}


def _names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def environment_reads(path: Path) -> set[str]:
    """The variable names the functions with an ``env`` parameter in ``path`` read (rule 3)."""
    tree = ast.parse(path.read_text())
    module_values = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                     for t in node.targets if isinstance(t, ast.Name)}
    found: set[str] = set()

    def key(node: ast.AST) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _UPPER.match(node.value):
            found.add(node.value)

    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        envs = {a.arg for a in fn.args.args + fn.args.kwonlyargs if a.arg == "env" or a.arg.endswith("_env")}
        if not envs:
            continue
        readers = {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda)
                   and _names(node.value) & envs for t in node.targets if isinstance(t, ast.Name)}
        key_names: set[str] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr in ("get", "pop") and isinstance(func.value, ast.Name) \
                        and func.value.id in envs and node.args:
                    key(node.args[0])
                    key_names |= {node.args[0].id} if isinstance(node.args[0], ast.Name) else set()
                elif any(isinstance(a, ast.Name) and a.id in envs for a in node.args) or \
                        (isinstance(func, ast.Name) and func.id in readers):
                    for a in node.args:
                        key(a)
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in envs:
                key(node.slice)
                key_names |= {node.slice.id} if isinstance(node.slice, ast.Name) else set()
            elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                    and any(isinstance(c, ast.Name) and c.id in envs for c in node.comparators):
                key(node.left)
        for node in ast.walk(fn):
            if isinstance(node, (ast.comprehension, ast.For)) and _names(node.target) & key_names:
                iterable = node.iter
                if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Attribute):
                    iterable = iterable.func.value  # NAME.items() / NAME.keys()
                if isinstance(iterable, ast.Name) and iterable.id in module_values:
                    iterable = module_values[iterable.id]
                if isinstance(iterable, ast.Dict):
                    found |= {k.value for k in iterable.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
                              and _UPPER.match(k.value)}
                elif isinstance(iterable, (ast.Tuple, ast.List, ast.Set)):
                    found |= _upper_constants(iterable)
    return found


def launcher_reads() -> dict[str, str]:
    """Every variable the launcher reads -> the module that reads it."""
    return {name: module for module in ENVIRONMENT_READERS for name in sorted(environment_reads(REPO / module))}


# -- 1. scripts -------------------------------------------------------------------------------------

def test_every_script_named_exists_and_the_readme_table_names_every_script():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for name in sorted(set(re.findall(r"training_scripts/([\w.-]+\.sh)", text))):
            if not (SCRIPTS_DIR / name).is_file():
                missing.append(f"{page.name}: training_scripts/{name}")
        for name in sorted(set(re.findall(r"(?<![\w/.*-])([a-z0-9_]+\.sh)\b", text))):
            if not (SCRIPTS_DIR / name).is_file() and not any(
                    (REPO / top).rglob(name) for top in ("tests", ".ci", "benchmarks")):
                missing.append(f"{page.name}: {name}")
    assert not missing, f"scripts the docs name that do not exist: {missing}"

    table = {name for line in README.read_text().splitlines() if line.startswith("|")
             for name in re.findall(r"[\w.-]+\.sh", line.split("|")[1])}
    unlisted = sorted(p.name for p in SCRIPTS_DIR.glob("*.sh") if p.name != "_entry.sh" and p.name not in table)
    assert not unlisted, f"add these scripts to the README's scripts table: {unlisted}"


def test_every_script_is_executable_in_the_repository():
    """Every entry script runs as ``./training_scripts/x.sh`` in a fresh clone: git records 100755
    (a file mode a checkout's umask cannot change)."""
    listed = subprocess.run(["git", "ls-files", "-s", "training_scripts"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode != 0 or not listed.stdout:
        pytest.skip("not a git checkout: the modes git records cannot be read")
    modes = {line.split()[3]: line.split()[0] for line in listed.stdout.splitlines() if line.endswith(".sh")}
    assert {path: mode for path, mode in modes.items() if mode != "100755"} == {}, \
        "git update-index --chmod=+x these (and chmod +x)"


# -- 2. variables named -----------------------------------------------------------------------------

def named_variables(text: str) -> set[str]:
    out = set()
    for span in inline_code(text):
        for match in re.finditer(r"(?<![\w.-])(\$\{?)?([A-Z][A-Z0-9_]*[A-Z0-9])(?![\w.-])(=?)", span):
            dollar, name, equals = match.groups()
            if "_" in name or dollar or equals:
                out.add(name)
    return out


def test_every_variable_the_docs_name_exists_in_the_code():
    code = source_words()
    unknown = [f"{page.name}: {name}" for page in PAGES for name in sorted(named_variables(page.read_text()))
               if name not in code and name not in NOT_OUR_VARIABLES and not name.startswith(tuple(THIRD_PARTY_PREFIXES))]
    assert not unknown, ("variables the docs name that no source reads or writes (a typo, a variable that "
                         f"went, or a third-party one to allowlist with its reason): {unknown}")


def test_the_variable_reader_finds_the_known_reads():
    reads = launcher_reads()
    for name in ("HOSTS", "NNODES", "ZERO_STAGE", "ENGINE", "ARTIFACT_ROOT", "WANDB_PROJECT", "WANDB_ENTITY",
                 "HANG_STEP_FLOOR_S", "MAX_RESTARTS", "SBATCH_PARTITION", "CUDA_VISIBLE_DEVICES"):
        assert name in reads, (name, sorted(reads))


# -- 3. variables read ------------------------------------------------------------------------------

def test_every_variable_the_launcher_reads_is_in_the_environment_page():
    documented = {name for span in inline_code(ENVIRONMENT_PAGE.read_text())
                  for name in re.findall(r"[A-Z][A-Z0-9_]*[A-Z0-9]", span)}
    missing = {name: module for name, module in launcher_reads().items() if name not in documented}
    assert not missing, f"document these in docs/environment.md (variable: the module that reads it): {missing}"


# -- 4. commands ------------------------------------------------------------------------------------

def _params() -> list:
    out = []
    for command in documented_commands():
        reason = skip_reason(command)
        marks = [pytest.mark.skip(reason=f"{command.page}:{command.line}: {reason}")] if reason else []
        out.append(pytest.param(command, marks=marks, id=f"{command.page}:{command.line}"))
    return out


def run_dry(command: Command, artifact_root: Path) -> tuple[int, str]:
    """The command as documented, with DRY_RUN=1 and its own artifact root: (exit code, output)."""
    env = {**clean_env(LAUNCHER_PYTHON=sys.executable), **dict(command.env), "DRY_RUN": "1", "ARTIFACT_ROOT": str(artifact_root)}
    argv = (["bash", str(SCRIPTS_DIR / command.script)] if command.script
            else [sys.executable, "-m", "orchestration", command.subcommand]) + list(command.args)
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[tuple, tuple[int, str]]:
    """Every runnable documented command's dry run, three at a time (each is a second of
    interpreter start and planning, mostly waiting on imports)."""
    runnable = [c for c in documented_commands() if skip_reason(c) is None]
    root = tmp_path_factory.mktemp("dry_runs")
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = pool.map(lambda ic: run_dry(ic[1], root / str(ic[0])), enumerate(runnable))
        return {c.key: r for c, r in zip(runnable, results)}


@pytest.mark.parametrize("command", _params())
def test_documented_command_runs_under_dry_run(command: Command, dry_runs):
    code, output = dry_runs[command.key]
    assert code == 0 and "Traceback" not in output, (
        f"{command.page}:{command.line}: `{command.describe()}` under DRY_RUN=1 exited {code}:\n{output[-3000:]}")


def test_the_documented_commands_are_found():
    commands = documented_commands()
    assert len(commands) >= 10, [c.describe() for c in commands]
    runnable = [c for c in commands if skip_reason(c) is None]
    assert {c.subcommand for c in runnable} >= {"start", "train", "stop", "submit", "sweep", "import-megatron-args"}, \
        [c.describe() for c in runnable]


def test_the_readme_test_command_is_the_one_ci_runs():
    """CI runs the README's test line as it stands: exactly one code line in the README and the
    pages holds `.ci/py312_env.sh` and pytest, and `.ci/run` runs that line, verbatim."""
    lines = [line.strip() for page in PAGES for _, block in code_blocks(page.read_text())
             for line in block.splitlines() if ".ci/py312_env.sh" in line and "pytest" in line]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines() if "pytest" in line and not line.startswith("#")]
    assert len(lines) == 1 and ci == lines, (lines, ci)


# -- 5. tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("page,files,spelled,fix", [
    (TESTING_PAGE, "tests/test_*.py", "{}", "add a line for each to docs/testing.md, 'The test modules'"),
    (README, "docs/*.md", "(docs/{})", "link these from the README's Documentation table"),
], ids=["test_modules_in_the_testing_page", "pages_linked_from_the_readme"])
def test_every_file_is_named_on_its_page(page, files, spelled, fix):
    text = page.read_text()
    unnamed = sorted(p.name for p in REPO.glob(files) if spelled.format(p.name) not in text)
    assert not unnamed, f"{fix}: {unnamed}"


PROJECT_PATH = re.compile(r"(?<![\w./$-])((?:orchestration|megatron_ext|tests|benchmarks|training_scripts|docs|\.ci)"
                          r"/[\w./-]*[\w/])(?![\w<*{])")
PROJECT_MODULE = re.compile(r"(?<![\w./-])((?:orchestration|megatron_ext)(?:\.\w+)+)")
NAMED_ELSEWHERE = {
    "docs/user-guide/hybrid-model-migration.md": "Megatron-LM's page, as its GPTModel's log line names it",
    "training_scripts/X.sh": "a placeholder for any script",
    "docs/s": "a rate (documents per second)",
    "tests/test_": "a pattern's start",
}
"""Path-like text in the code that is not a path of this project, each with why."""


def test_every_project_path_the_docs_name_exists():
    """A file renamed or moved shows here."""
    missing = [f"{page.name}: {path}" for page in PAGES for path in sorted(stale_paths(page.read_text()))]
    assert not missing, missing


def stale_paths(text: str) -> set[str]:
    """The project paths in ``text`` (``orchestration/runner/sweep.py``, ``tests/gpu/``) that do not exist."""
    return {p for p in PROJECT_PATH.findall(text) if p not in NAMED_ELSEWHERE and not (REPO / p).exists()}


def _defines(module: Path, name: str) -> bool:
    return re.search(rf"^\s*(?:async def |def |class )?{name}\b\s*[(:=]|^(?:from|import) .*\b{name}\b", module.read_text(),
                     re.M) is not None


def _module_file(parts: list[str]) -> Path | None:
    base = REPO.joinpath(*parts)
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def stale_names(text: str) -> set[str]:
    """The project paths and dotted module names in ``text`` that do not exist: a path must; a
    dotted name's longest module prefix must, followed by at most a name it defines and, for a
    class, one of its attributes."""
    stale = stale_paths(text)
    for name in PROJECT_MODULE.findall(text):
        parts = name.split(".")
        k = next((k for k in range(len(parts), 0, -1) if _module_file(parts[:k])), 0)
        module, rest = _module_file(parts[:k]) if k >= 2 else None, parts[k:]
        if module is None or len(rest) > 2 or (rest and not _defines(module, rest[0])):
            stale.add(name)
    return stale


def test_every_path_and_module_the_code_names_exists():
    """Docstrings, comments and messages cite modules by path (orchestration/node/board.py) or by
    dotted name (megatron_ext.run_spec.checksums.health): each exists, as the docs' paths do."""
    files = [p for top in ("orchestration", "megatron_ext", "tests", "benchmarks", "training_scripts", ".ci")
             for p in sorted((REPO / top).rglob("*")) if p.is_file() and p.suffix in (".py", ".sh", ".md", ".toml", "")
             and "__pycache__" not in p.parts]
    stale = {f"{path.relative_to(REPO)}: {name}" for path in [*files, REPO / "pyproject.toml"]
             for name in stale_names(path.read_text(errors="replace"))}
    assert not stale, sorted(stale)
    # what it found once: a path and a module moved since (now orchestration/node/, orchestration/analysis/)
    old_path, old_module = "orchestration" + "/supervisor.py", "orchestration" + ".report"  # (not a name in this file)
    assert stale_names(f"(see {old_path}) are :mod:`{old_module}`'s; megatron_ext.run_spec.checksums.health, "
                       "orchestration.node.wire.NodePlan.attempt_argv") == {old_path, old_module}


def test_the_design_page_names_every_module():
    """Every module and package of the two programs has its line in docs/design.md's layout."""
    text = (DOCS_DIR / "design.md").read_text()
    unnamed = []
    for top in ("orchestration", "megatron_ext"):
        for path in sorted((REPO / top).rglob("*.py")):
            if path.name != "__init__.py" and not re.search(rf"(?<![\w.]){re.escape(path.name)}\b", text):
                unnamed.append(str(path.relative_to(REPO)))
        for package in sorted(p for p in (REPO / top).rglob("*") if p.is_dir() and (p / "__init__.py").exists()):
            if package != REPO / top and f"{package.name}/" not in text:
                unnamed.append(str(package.relative_to(REPO)) + "/")
    assert not unnamed, f"give these a line in docs/design.md's layout: {unnamed}"


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in prose(text).splitlines() if re.match(r"#{1,6} ", line)}


def test_links_between_pages_point_at_pages_and_headings_that_exist():
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md)?(?:#([^)\s]+))?\)", page.read_text()):
            path = page.parent / target if target else page
            if not path.is_file():
                broken.append(f"{page.name}: {target}")
            elif anchor and anchor not in heading_anchors(path.read_text()):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert not broken, broken
