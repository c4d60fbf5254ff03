"""The shape of the code, checked: imports run one way with no circle, the node side imports
nothing of the launcher side and a node command loads none of it, the launcher imports only the
contract (node/wire.py), the run-state readers (node/run_state.py) and the in-process answer
(node/local.py) of the node side, the environment is read only at the three edges, and imports
inside functions are the few that must be there."""

from __future__ import annotations

import ast
import graphlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env, require

PACKAGES = ("orchestration", "megatron_ext")
ENVIRONMENT_EDGES = {
    "orchestration/launch_env.py": "the launcher's edge",
    "orchestration/node/commands.py": "the node side's entry",
    "megatron_ext/pretrain.py": "the training program's edge",
    "orchestration/megatron_lm/validate.py": "the argument check's child sets each check's environment (validate_args reads it)",
}
LAZY_IMPORTS = {
    ("orchestration/megatron_lm/validate.py", "megatron"): "the child imports the checkout's megatron",
    ("orchestration/megatron_lm/validate.py", "megatron.training"): "the same, after sys.path holds the checkout",
    ("orchestration/megatron_lm/validate.py", "torch"): "whatever torch the checkout's environment has",
    ("orchestration/analysis/comparison_files.py", "matplotlib"): "optional, and slow to import",
    ("orchestration/node/flight_recorder.py", "torch.distributed.flight_recorder.components.builder"):
        "torch's analyser, imported by the supervisor only at a hang (torch takes seconds to import)",
    ("orchestration/node/flight_recorder.py", "torch.distributed.flight_recorder.components.config_manager"): "the same",
    ("orchestration/analysis/comparison_files.py", "matplotlib.pyplot"): "the same",
    ("orchestration/node/preflight.py", "megatron_ext.data.tokenizers"): "node-check alone checks a tokenizer",
    ("orchestration/node/preflight.py", "megatron_ext.run_spec.params"): "the same",
    ("orchestration/__main__.py", "orchestration.node.commands"): "node commands load nothing of the launcher",
    ("orchestration/__main__.py", "orchestration.cli"): "the launcher's commands",
    ("orchestration/node/linktest.py", "torch"): "the link test's own child process alone imports torch",
    ("orchestration/node/linktest.py", "torch.distributed"): "the same",
    ("orchestration/node/board.py", "torch.distributed"): "a multi-node run's supervisor alone (its TCPStore): "
                                                          "a one-node run's agrees in memory and loads no torch",
    ("orchestration/node/local.py", "orchestration.node.commands"): "this machine's node commands answered in the "
                                                                     "launcher's own process, loaded at the first call",
    ("orchestration/runner/start_plan.py", "megatron_ext.data.prepare"): "numpy, for a Megatron-LM start only (the "
                                                                        "launcher prepares its data): the other starts, "
                                                                        "status and stop load none",
    ("orchestration/runner/start_plan.py", "megatron_ext.data.tokenizers"): "sentencepiece or tokenizers, for starts only",
    ("orchestration/runner/start.py", "megatron_ext.data.prepare"): "numpy, for a Megatron-LM start only",
    ("orchestration/runner/sweep.py", "megatron_ext.data.prepare"): "numpy, for a Megatron-LM sweep only",
    ("orchestration/megatron_lm/render.py", "megatron_ext.data.tokenizers"): "for a Megatron-LM start only",
    ("orchestration/node/commands.py", "orchestration.node.preflight"): "node-check's alone: the supervisor, which "
                                                                       "starts torchrun, loads ~40 ms less",
    ("orchestration/node/commands.py", "orchestration.node.linktest"): "node-linktest's alone",
}
NODE_CONTRACT = {"orchestration.node.wire", "orchestration.node.run_state", "orchestration.node.local"}
"""What the launcher may import of the node side (the module docstring says what each is)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _imports(path: Path, modules: set[str]) -> list[tuple[str, bool]]:
    """(imported project module, inside a function) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
        out += [(n, id(node) in inside) for n in names]
    return out


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    modules = set(sources)
    return {m: {n for n, _ in _imports(p, modules) if n in modules and n != m} for m, p in sources.items()}


def test_no_import_circle_anywhere():
    try:
        graphlib.TopologicalSorter(_graph()).prepare()  # raises at the first circle it finds
    except graphlib.CycleError as circle:
        pytest.fail(f"import circle (each imports the next): {' -> '.join(reversed(circle.args[1]))}")


def test_the_node_side_imports_nothing_of_the_launcher():
    graph = _graph()
    for module, imported in graph.items():
        if module.startswith("orchestration.node"):
            foreign = {m for m in imported if m.startswith("orchestration") and not m.startswith("orchestration.node")}
            assert not foreign, (module, foreign)
        if module.startswith("megatron_ext"):
            assert not {m for m in imported if m.startswith("orchestration")}, module


def test_the_launcher_imports_only_the_contract_of_the_node_side():
    graph = _graph()
    launcher = [m for m in graph if m.startswith("orchestration") and not m.startswith("orchestration.node")
                and m != "orchestration.__main__"]
    assert launcher
    for module in launcher:
        node = {m for m in graph[module] if m.startswith("orchestration.node")}
        assert node <= NODE_CONTRACT, (module, node - NODE_CONTRACT)


def _loaded(argv: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime ARGV``: the process and the modules it loaded."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return proc, {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}


def test_a_node_command_loads_no_launcher_module(tmp_path):
    """``python -m orchestration node-status`` as a node runs it: no runner, cluster, analysis, cli,
    megatron_lm, import_args or launch_env module, no torch, no matplotlib."""
    from orchestration.node.wire import NodeTarget, StatusRequest, node_call

    proc, loaded = _loaded(node_call(StatusRequest(NodeTarget("r", 0, "localhost", tmp_path))).argv("-m")[1:], clean_env())
    assert proc.returncode == 0 and '"state": "not started"' in proc.stdout, proc.stdout + proc.stderr[-2000:]
    launcher = sorted(m for m in loaded if m.startswith(("orchestration.runner", "orchestration.cluster", "orchestration.analysis",
                                                         "orchestration.megatron_lm", "orchestration.import_args",
                                                         "orchestration.cli", "orchestration.launch_env", "torch", "matplotlib")))
    assert "orchestration.node.commands" in loaded and launcher == [], launcher

def test_a_start_loads_no_numpy_and_the_supervisor_no_preflight(tmp_path):
    """What stands between the start command and torchrun loads only what it uses (the launcher's
    cost, benchmarks/launcher.py): a start of this program plans without numpy (data preparation is
    a Megatron-LM start's alone), and the node supervisor starts without node-check's preflight."""
    proc, loaded = _loaded(["-m", "orchestration", "start", "gpt_smoke", "smoke", "r", "--this-node"],
                           clean_env(DRY_RUN="1", ARTIFACT_ROOT=str(tmp_path)))
    assert proc.returncode == 0 and '"settled": true' in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "orchestration.node.preflight" in loaded and "numpy" not in loaded
    proc, loaded = _loaded(["-c", "import orchestration.node.commands"], clean_env())
    assert proc.returncode == 0 and "orchestration.node.supervisor" in loaded, proc.stderr[-2000:]
    assert not loaded & {"orchestration.node.preflight", "orchestration.node.linktest", "numpy"}


def test_the_environment_is_read_only_at_the_edges():
    readers = []
    for module, path in _sources().items():
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            reads = ((isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                      and node.attr in ("environ", "getenv", "environb"))
                     or (isinstance(node, ast.ImportFrom) and node.module == "os"
                         and any(a.name in ("environ", "getenv") for a in node.names)))
            if reads and rel not in ENVIRONMENT_EDGES:
                readers.append(f"{rel}:{node.lineno}")
    assert readers == [], readers


LOCK_CALLS = {"flock", "lockf"}
"""File locks: on a cluster's shared file system they fail (Lustre's ``noflock``: ENOSYS), lock this
machine only (``localflock``, NFS's ``local_lock``) or nothing at all (SFTP)."""


def test_no_product_code_takes_a_file_lock():
    """The nodes and the ranks agree over the network (docs/design.md, "What the nodes agree on, and
    where"): no ``fcntl.flock``, ``fcntl.lockf`` or ``lockf`` anywhere in orchestration/ or
    megatron_ext/, called or imported (tests/test_shared_fs.py runs a training on a share that
    refuses them)."""
    found = []
    for path in _sources().values():
        for node in ast.walk(ast.parse(path.read_text())):
            name = (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")) \
                if isinstance(node, ast.Call) else None
            imported = {a.name for a in node.names} if isinstance(node, ast.ImportFrom) and node.module == "fcntl" else set()
            if name in LOCK_CALLS or imported & LOCK_CALLS:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == [], found


def test_imports_inside_functions_are_the_few_that_must_be():
    sources = _sources()
    lazy = []
    for module, path in sources.items():
        if not module.startswith("orchestration"):
            continue
        tree = ast.parse(path.read_text())
        functions = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.If))]
        for f in functions:
            if isinstance(f, ast.If) and module != "orchestration.__main__":
                continue
            for node in ast.walk(f):
                if isinstance(node, ast.Import):
                    lazy += [(str(path.relative_to(REPO)), a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    lazy.append((str(path.relative_to(REPO)), node.module))
    unexplained = sorted(set(lazy) - set(LAZY_IMPORTS))
    assert unexplained == [], unexplained
    assert sources  # the walk found the sources


PROCESS_HELPERS = {"run_torchrun", "wait_for", "tagged_pids", "wait_until_ended", "NamespaceCluster"}
"""Test helpers that start or wait for training processes (tests/conftest.py, the cluster fixtures)."""
PROCESS_FIXTURES = {"unattended", "cluster", "cluster_env", "two_long_runs", "slurm", "slurm_env", "docker_engine",
                    "stage_runs", "sweep", "runs", "resumed"}
"""Fixtures that start training runs, clusters or daemons."""


def _marks(decorators) -> set[str]:
    return {ast.unparse(d).split("pytest.mark.", 1)[-1].split("(")[0] for d in decorators}


def test_every_test_that_starts_training_processes_is_marked_slow():
    """The fast tier (``python3 -m pytest -q -m "not slow"``) runs no training but its one smoke: a
    test (function or module) that calls a process helper or takes a process fixture is marked slow."""
    unmarked = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
                module = {ast.unparse(e).split("pytest.mark.", 1)[-1] for e in
                          (node.value.elts if isinstance(node.value, ast.List) else [node.value])}
        for fn in tree.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
                continue
            marks = module | _marks(fn.decorator_list)
            calls = {getattr(c.func, "id", getattr(c.func, "attr", "")) for c in ast.walk(fn) if isinstance(c, ast.Call)}
            fixtures = {a.arg for a in fn.args.args}
            if (calls & PROCESS_HELPERS or fixtures & PROCESS_FIXTURES) and not marks & {"slow", "smoke"}:
                unmarked.append(f"{path.name}::{fn.name}")
    assert unmarked == [], unmarked


def test_each_module_runs_on_one_worker():
    """The README's ``-n 2 --dist loadgroup``: every test of a module on one worker (its cluster, its
    Slurm, its engine, its run names started once). pytest 9.2 with pytest-xdist 3.8 dropped the
    groups silently (pytest-dev/pytest-xdist#1386): each module's tests on both workers at once."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                           "--no-loadscope-reorder", "-v", "tests/test_zero_table.py", "tests/test_launch_plan.py"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, module in re.findall(r"^\[(gw\d+)\] .*? (tests/test_\w+\.py)::", proc.stdout, flags=re.M):
        workers.setdefault(module, set()).add(worker)
    assert set(workers) == {"tests/test_zero_table.py", "tests/test_launch_plan.py"}, proc.stdout[-2000:]
    assert all(len(w) == 1 for w in workers.values()), workers


def test_psutil_is_required_for_megatron_core_s_checkpoint_writer():
    """pyproject.toml requires psutil although this project imports none of it: megatron-core's
    torch_dist writer measures each writer process's memory with it at every save
    (dist_checkpointing/strategies/filesystem_async.py ``_process_memory``, called by
    ``write_preloaded_data``; 0.16.1 and 0.19.2 alike) and megatron-core does not declare it.
    Read from the installed source, not imported."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None:
        pytest.skip("megatron-core is not installed")
    source = (Path(spec.origin).parent / "dist_checkpointing" / "strategies" / "filesystem_async.py").read_text()
    writer = re.search(r"\n    def write_preloaded_data\((.*?)\n    (?:@|def )", source, re.S)
    assert "psutil.Process(" in source and writer and "_process_memory()" in writer.group(1)
    assert '"psutil' in (REPO / "pyproject.toml").read_text()


def test_the_linter_finds_nothing():
    """ruff, with the rules and line length pyproject.toml gives ([tool.ruff]), over the whole tree."""
    require(None if importlib.util.find_spec("ruff") else "ruff (pip install -e .[test])", "the linter")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_a_dataclass_of_more_than_five_fields_is_built_by_keyword():
    """``NodeStatus(rank, host, False, RunState.LOST, why, None, None, ...)`` reads as nothing: a
    dataclass of more than five fields is ``kw_only`` (its calls name every field)."""
    positional = []
    for name, path in _sources().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for deco in node.decorator_list:
                    call = deco if isinstance(deco, ast.Call) else None
                    if getattr(call.func if call else deco, "id", None) != "dataclass":
                        continue
                    fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and "ClassVar" not in ast.unparse(s.annotation)]
                    kw_only = call is not None and any(k.arg == "kw_only" and ast.literal_eval(k.value) for k in call.keywords)
                    if len(fields) > 5 and not kw_only:
                        positional.append(f"{name}.{node.name} ({len(fields)} fields)")
    assert not positional, f"add kw_only=True: {positional}"


ENGINE_MODULES = {"megatron_ext/run_spec/engines.py"}
"""The one place an engine's name is spelled (the rest asks the engine object)."""
NAMES_NOT_ENGINES = {
    ("orchestration/node/preflight.py", "megatron-core"): "the pip distribution whose version a node reports",
    ("orchestration/setup_env.py", "megatron-core"): "the pip distribution the setup installs",
    ("megatron_ext/training/hf_weights.py", "megatron-core"): "whose weights a mismatch names (the local spec's)",
    ("benchmarks/version_matrix.py", "megatron-core"): "the column of the installed distribution's version",
}
DEVICE_MODULE = "megatron_ext/host/devices.py"
DEVICE_NAMES_TO_FIX: dict[str, str] = {}
"""Device names still spelled in a choice (found by the check's wider reach; orchestration/ was another's to change)."""


def _names_device(node: ast.AST, name: str) -> bool:
    """Whether ``node`` spells the device ``name``: a string that is it or begins with it (``"cuda/nccl"``)."""
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and re.match(rf"{name}\b", n.value) for n in ast.walk(node))


def _project_files() -> dict[str, ast.Module]:
    return {str(p.relative_to(REPO)): ast.parse(p.read_text())
            for p in [*_sources().values(), *sorted((REPO / "benchmarks").glob("*.py"))]}


def test_no_engine_name_or_device_string_outside_its_own_module():
    """``"megatron-lm"`` / ``"megatron-core"`` only in megatron_ext/run_spec/engines.py (the rest asks
    ``engine_named(...)``: its program, save signal, progress source, log parser, reshard rule);
    ``"cuda" if ... else "cpu"`` (``torch.device("cuda", i) if ... else torch.device("cpu")``, ``"cuda/nccl" if ...
    else "cpu/gloo"`` too) and ``== "cpu"`` only as megatron_ext/host/devices.py's ``Device``."""
    found = []
    for rel, tree in _project_files().items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and node.value in ("megatron-core", "megatron-lm")
                    and rel not in ENGINE_MODULES and (rel, node.value) not in NAMES_NOT_ENGINES):
                found.append(f"{rel}:{node.lineno} engine name {node.value!r}")
            if rel == DEVICE_MODULE:
                continue
            if isinstance(node, ast.IfExp) and rel not in DEVICE_NAMES_TO_FIX and any(
                    _names_device(node.body, a) and _names_device(node.orelse, b) for a, b in (("cuda", "cpu"), ("cpu", "cuda"))):
                found.append(f"{rel}:{node.lineno} device chosen by name")
            if isinstance(node, ast.Compare) and any(isinstance(o, (ast.Eq, ast.NotEq)) for o in node.ops) and any(
                    getattr(n, "value", None) in ("cuda", "cpu") for n in (node.left, *node.comparators)):
                found.append(f"{rel}:{node.lineno} device compared by name")
    assert not found, found


BACKEND_CHOICE = ("use_srun", "container_name", "ssh_opts")
"""What picks a backend: read by orchestration/cluster/backends.py alone (and set by launch_env.py)."""


PHASE_NAMES = {"prepare", "setup", "step", "eval", "checkpoint", "done", "preempted"}
"""megatron_ext/run_spec/resilience.py's Phase, spelled there alone."""


def test_no_rank_phase_spelled_outside_its_enum():
    """A rank's phase is ``Phase`` (resilience.py): never a string given to ``.phase(...)`` or
    ``phase=``, nor compared with something's ``.phase`` (the literals that once stood in loop.py,
    supervisor.py and the watchdog)."""
    found = []

    def literal(node) -> bool:
        values = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else \
            [node.body, node.orelse] if isinstance(node, ast.IfExp) else [node]
        return any(isinstance(v, ast.Constant) and v.value in PHASE_NAMES for v in values)

    for rel, tree in _project_files().items():
        if rel == "megatron_ext/run_spec/resilience.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "phase" and any(map(literal, node.args)):
                found.append(f"{rel}:{node.lineno} .phase({ast.unparse(node.args[0])})")
            if isinstance(node, ast.Call):
                found += [f"{rel}:{node.lineno} phase={ast.unparse(k.value)}" for k in node.keywords
                          if k.arg == "phase" and literal(k.value)]
            if isinstance(node, ast.Compare) and any(getattr(n, "attr", None) == "phase" for n in (node.left, *node.comparators)) \
                    and any(literal(n) for n in (node.left, *node.comparators)):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not found, f"use megatron_ext.run_spec.resilience.Phase: {found}"


def test_one_class_per_backend_and_steps_that_run_themselves():
    """This machine, ssh, docker exec and srun are one class each with plan, start, status and stop,
    and nothing else branches on how nodes are reached; a start's steps are objects that execute
    themselves (no ``step.name ==`` dispatch)."""
    from orchestration.cluster import backends
    from orchestration.runner import start_plan

    classes = [backends.ThisMachine, backends.Ssh, backends.DockerExec, backends.Srun]
    assert len({c.name for c in classes}) == 4 and all(issubclass(c, backends.Backend) for c in classes)
    assert all(callable(getattr(c, verb)) for c in classes for verb in ("plan", "start", "status", "stop"))
    steps = [c for c in vars(start_plan).values() if isinstance(c, type) and issubclass(c, start_plan.Step) and c.name]
    assert len(steps) == 6 and all(c.run is not start_plan.Step.run for c in steps), steps
    found = []
    for rel, tree in _project_files().items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in BACKEND_CHOICE and rel.startswith("orchestration/")
                    and rel not in ("orchestration/cluster/backends.py", "orchestration/launch_env.py")):
                found.append(f"{rel}:{node.lineno} reads {node.attr}")
            if isinstance(node, ast.Compare) and ast.unparse(node.left) == "step.name":
                found.append(f"{rel}:{node.lineno} dispatches on a step's name")
    assert not found, found


def test_one_module_per_command():
    """Every command of ``python -m orchestration`` is added and run by a module of its own,
    orchestration/cli/cmd_<verb>.py (cmd_export.py: export-hf and export-megatron-lm, one per
    format), every cmd_ module is one of them, and none chooses an exit code on a result's attribute
    (``EXIT_OK if report.ok else ...``): the runner's result says it (``exit_code``)."""
    from orchestration import cli

    commands = next(a.choices for a in cli.build_parser()._actions if a.dest == "command")
    modules = {name: parser.get_default("execute").__module__ for name, parser in commands.items()}
    misplaced = [f"{name}: {module}" for name, module in modules.items()
                 if not (name + "-").startswith(module.rsplit(".cmd_", 1)[1].replace("_", "-") + "-")]
    assert misplaced == [], misplaced
    files = {f"orchestration.cli.{p.stem}" for p in (REPO / "orchestration" / "cli").glob("cmd_*.py")}
    assert set(modules.values()) == files == {m.__name__ for m in cli.COMMANDS}
    decided = [f"{p.name}:{node.lineno} {ast.unparse(node)}" for p in (REPO / "orchestration" / "cli").glob("*.py")
               for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.IfExp)
               and all(getattr(n, "id", "").startswith("EXIT_") for n in (node.body, node.orelse))
               and any(isinstance(n, ast.Attribute) for n in ast.walk(node.test))]
    assert decided == [], f"give the result an exit_code: {decided}"


FAILURE_TEXT_READERS = {
    "orchestration/analysis/goodput.py": "end_cause reads the failure's kind from the reason text only for a ledger "
                                         "written before it kept AttemptRecord.failure_kind",
}


def test_no_failure_kind_read_from_text():
    """An attempt's failure is a typed ``Failure`` on the board and in each node's end: its ``kind``
    decides (hung or not, whose suspects); no code in orchestration/ tests a failure's text, or a
    reason, for a word (the ``" hung: " in failure`` that once stood in supervisor.py)."""
    import typing

    from orchestration.node.attempts import AttemptEnd
    from orchestration.node.board import Board
    from orchestration.node.failure import Failure

    assert typing.get_type_hints(Board.failure)["return"] == Failure | None
    assert typing.get_type_hints(Board.claim_failure)["failure"] is Failure
    assert typing.get_type_hints(AttemptEnd)["failure"] == Failure | None
    found = []
    for rel, tree in _project_files().items():
        if not rel.startswith("orchestration/") or rel in FAILURE_TEXT_READERS:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)
                    and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
                    and re.search(r"failure|reason|\.text\b|\.summary\b", " ".join(map(ast.unparse, node.comparators)))):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not found, f"decide from Failure.kind (orchestration/node/failure.py): {found}"


def test_no_count_parsed_back_from_an_env_mapping():
    """NNODES, NPROC_PER_NODE and MASTER_ADDR/MASTER_PORT are typed fields of ``NodePlan``, which
    its argv and env are rendered from (and its resilience policy a ``ResilienceParams``): nothing in
    orchestration/ or megatron_ext/ parses a number back out of an environment mapping
    (``int(plan.env["NNODES"])``, ``int(env.get(...))``) but the edges that read the process's own
    environment (:data:`ENVIRONMENT_EDGES`)."""
    import typing

    from megatron_ext.run_spec.resilience import ResilienceParams
    from orchestration.node.wire import NodePlan

    hints = typing.get_type_hints(NodePlan)
    assert [hints[f] for f in ("nnodes", "nproc_per_node", "master_addr", "master_port", "resilience")] == \
        [int, int, str, int, ResilienceParams]

    def an_env(node) -> bool:
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        return isinstance(name, str) and (name.lower().endswith("env") or name == "environ")

    found = []
    for rel, tree in _project_files().items():
        if not rel.startswith(PACKAGES) or rel in ENVIRONMENT_EDGES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("int", "float") and any(
                    (isinstance(n, ast.Subscript) and an_env(n.value))
                    or (isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "get" and an_env(n.func.value))
                    for arg in node.args for n in ast.walk(arg)):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not found, f"carry the count as a typed field: {found}"


def _self_targets(node: ast.AST) -> list[ast.Attribute]:
    """The ``self.x`` an assignment (plain, augmented, annotated; tuples unpacked) sets."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
    found = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets += t.elts
        elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
            found.append(t)
    return found


def _declared(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> set[str]:
    """What a class names for its instances: its class body's names (a dataclass's fields, class
    attributes, properties), what its ``__init__`` sets, and the same of its project bases."""
    names = {t.id for s in cls.body for t in ast.walk(s) if isinstance(s, (ast.Assign, ast.AnnAssign)) and isinstance(t, ast.Name)
             and isinstance(t.ctx, ast.Store)}
    for f in cls.body:
        if isinstance(f, ast.FunctionDef):
            names |= {t.attr for n in ast.walk(f) for t in _self_targets(n)} if f.name == "__init__" else \
                {f.name} if any("property" in ast.unparse(d) or "setter" in ast.unparse(d) for d in f.decorator_list) else set()
    for base in cls.bases:
        name = ast.unparse(base).rsplit(".", 1)[-1]
        names |= _declared(classes[name], classes) if name in classes and classes[name] is not cls else set()
    return names


def test_no_attribute_appears_after_construction():
    """An object of the training program has its whole state once constructed: no method but
    ``__init__`` sets a ``self.x`` that ``__init__`` or the class body does not name, and none probes
    for one (``hasattr(self, ...)``, ``getattr(self, ..., default)``). training/loop.py's ``Pretrain``
    once grew 14 attributes in ``build()``: they are ``Built``, which build returns."""
    trees = {rel: tree for rel, tree in _project_files().items() if rel.startswith("megatron_ext/")}
    classes = {c.name: c for tree in trees.values() for c in ast.walk(tree) if isinstance(c, ast.ClassDef)}
    found = []
    for rel, tree in trees.items():
        for cls in (c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)):
            known = _declared(cls, classes)
            for f in (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name != "__init__"):
                for n in ast.walk(f):
                    found += [f"{rel}:{t.lineno} {cls.name}.{f.name} sets self.{t.attr}" for t in _self_targets(n) if t.attr not in known]
                    if (isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("hasattr", "getattr") and n.args
                            and ast.unparse(n.args[0]) == "self" and (n.func.id == "hasattr" or len(n.args) == 3)):
                        found.append(f"{rel}:{n.lineno} {cls.name}.{f.name} probes {ast.unparse(n)}")
    assert not found, found


def test_no_test_module_imports_another():
    """What several test modules share is in tests/conftest.py, run_checks.py or standins.py: a test
    module imports no other test module (importing one runs its module code and ties the two together;
    test_resilience once took its goodput check from test_goodput, test_megatron_lm_loop from test_resilience)."""
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert not found, found


SUPERVISOR_PARTS = {"orchestration/node/membership.py": "Membership", "orchestration/node/between_attempts.py": "BetweenAttempts",
                    "orchestration/node/hang_protocol.py": "HangProtocol", "orchestration/node/checkpoint_pass.py": "CheckpointPass"}
"""The parts :class:`Supervisor` is made of, each in a module of its own with what it owns."""


def test_the_supervisor_is_its_parts_and_its_state_is_in_one_place():
    """orchestration/node/supervisor.py's ``Supervisor`` is made of its parts (membership, the hang
    protocol, what happens between attempts), each a module with the methods it owns; the state they
    share is the supervisor's alone: no part has an ``__init__``, and every ``self.x`` a part sets is
    one the supervisor's ``__init__`` sets, so a reader finds the whole state in one place."""
    trees = _project_files()
    supervisor = next(c for c in trees["orchestration/node/supervisor.py"].body if isinstance(c, ast.ClassDef) and c.name == "Supervisor")
    assert [ast.unparse(b) for b in supervisor.bases] == list(SUPERVISOR_PARTS.values())
    init = next(f for f in supervisor.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    state = {t.attr for n in ast.walk(init) for t in _self_targets(n)}
    found = []
    for rel, name in SUPERVISOR_PARTS.items():
        part = next(c for c in trees[rel].body if isinstance(c, ast.ClassDef) and c.name == name)
        for f in (f for f in part.body if isinstance(f, ast.FunctionDef)):
            found += [f"{rel}: {name}.__init__"] if f.name == "__init__" else []
            found += [f"{rel}:{t.lineno} {name}.{f.name} sets self.{t.attr}" for n in ast.walk(f) for t in _self_targets(n)
                      if t.attr not in state]
    assert not found, found


def test_node_commands_dispatch_on_the_request_type():
    """Each node command's name is spelled once, on its request type (``command``); the node side
    answers by the request's type (commands.py ``ANSWERS``), never by comparing a command's name."""
    from orchestration.node.commands import ANSWERS
    from orchestration.node.wire import NODE_REQUESTS

    assert set(ANSWERS) == set(NODE_REQUESTS.values()) and all(r.command == c for c, r in NODE_REQUESTS.items())
    found = []
    for rel, tree in _project_files().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(n, ast.Constant) and str(n.value).startswith("node-")
                                                     for side in (node.left, *node.comparators) for n in ast.walk(side)):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_preset_fields_and_megatron_lm_flags_are_one_table():
    """The fields that are one Megatron-LM flag each are one table, both ways (render.py ``FIELD_FLAGS``,
    one field per flag): render.py spells none of its flags outside it, and the importer
    (import_args/mapping.py) reads none of them by a literal of its own."""
    from orchestration.megatron_lm.render import FIELD_FLAGS

    flags = [flag for fields in FIELD_FLAGS.values() for flag, _, _ in fields.values()]
    assert len(set(flags)) == len(flags)
    render, mapping = (ast.parse((REPO / rel).read_text()) for rel in ("orchestration/megatron_lm/render.py",
                                                                        "orchestration/import_args/mapping.py"))
    table = next(n for n in render.body if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "FIELD_FLAGS")
    in_table = {id(n) for n in ast.walk(table)}
    found = [f"render.py:{n.lineno} {n.value}" for n in ast.walk(render)
             if isinstance(n, ast.Constant) and n.value in flags and id(n) not in in_table]
    found += [f"mapping.py:{n.lineno} {ast.unparse(n)}" for n in ast.walk(mapping)
              if isinstance(n, ast.Call) and getattr(n.func, "attr", "") in ("switch", "text", "texts", "number", "required", "default")
              and any(isinstance(a, ast.Constant) and a.value in flags for a in n.args)]
    assert not found, found
