"""Megatron-LM checkouts newer than the arguments and the Python: flags core_v0.19 retired, and the
Python a checkout states, read from the core_v0.16.1 and core_v0.19.0 checkouts themselves.

    python3 -m pytest -q tests/test_megatron_lm_releases.py

The checkouts are the tarballs beside the repository (``../shared/megatron-lm``: extracted once per
module; without them those tests skip saying so); the small facts read in them are test data
(``tests/data/megatron_lm/retired_flags.tsv``, ``requires_python.tsv``). Pure but for the
extraction and one ``DRY_RUN=1`` start (slow).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import MEGATRON_LM_TARBALL, REPO, TEST_DATA, clean_env
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.python_version import PythonRequirement, python_problem
from orchestration.megatron_lm.checkout import Checkout, read_checkout
from orchestration.megatron_lm.flags import FlagSpec, FlagTable
from orchestration.megatron_lm.retired_flags import DROP, REFUSE, RETIRED_FLAGS, TRANSLATE, release_version

TARBALLS = {"core_v0.16.1": MEGATRON_LM_TARBALL, "core_v0.19.0": MEGATRON_LM_TARBALL.with_name("core_v0.19.0.tar.gz")}
DATA = TEST_DATA / "megatron_lm"


def tsv_rows(name: str) -> list[list[str]]:
    return [line.split("\t") for line in (DATA / name).read_text().splitlines() if line and not line.startswith("#")]


RETIRED = {row[0]: row for row in tsv_rows("retired_flags.tsv")}
"""Old flag -> (flag, where core_v0.16.1 adds it, replacement or -, evidence in core_v0.19.0, what the sources say)."""


@pytest.fixture(scope="module")
def checkouts(tmp_path_factory) -> dict[str, Path]:
    """Both checkouts, extracted from the tarballs beside the repository."""
    out = {}
    for tag, tarball in TARBALLS.items():
        if not tarball.is_file():
            pytest.skip(f"no Megatron-LM {tag} tarball at {tarball} (../shared/megatron-lm/README.md)")
        root = tmp_path_factory.mktemp(tag)
        with tarfile.open(tarball) as tar:
            tar.extractall(root, filter="data")
        out[tag] = next(root.iterdir())
    return out


@pytest.fixture(scope="module")
def read(checkouts) -> dict[str, Checkout]:
    """Both checkouts as the launcher reads them (version, flag table, requires-python)."""
    return {tag: read_checkout(root) for tag, root in checkouts.items()}


def line_of(checkout: Path, where: str) -> str:
    path, _, number = where.partition(":")
    return (checkout / path).read_text().splitlines()[int(number) - 1]


def named_on(line: str, flag: str) -> bool:
    """The flag's add_argument, or the config field ArgumentGroupFactory turns into it, is on the line."""
    return f"'{flag}'" in line or f'"{flag}"' in line or re.match(rf"\s*{flag[2:].replace('-', '_')}\s*:", line) is not None


def table_of(flags, release: str) -> FlagTable:
    return FlagTable(release, {flag: FlagSpec("0") for flag in flags})


# -- the retired flags ----------------------------------------------------------------------------

def test_every_retired_flag_is_read_in_both_checkouts(read):
    """For every row of the code's table: the old flag is in core_v0.16.1's parser (a switch, no
    value) and not in core_v0.19.0's, the replacement is in core_v0.19.0's, each at the place the
    test data names; a row without a replacement has its evidence (a folder gone, an attribute
    nothing read); the row applies to 0.19.0 and not to 0.16.1."""
    old, new = read["core_v0.16.1"], read["core_v0.19.0"]
    assert sorted(RETIRED) == sorted(row.flag for row in RETIRED_FLAGS)
    for row in RETIRED_FLAGS:
        flag, added, replacement, evidence, _ = RETIRED[row.flag]
        assert old.table.flags[flag].nargs == "0" and flag not in new.table.flags, flag
        assert named_on(line_of(old.root, added), flag), (flag, added, line_of(old.root, added))
        assert (replacement if replacement != "-" else None) == row.replacement, flag
        if row.replacement is not None:
            assert row.replacement in new.table.flags and row.replacement not in old.table.flags, row.replacement
            assert named_on(line_of(new.root, evidence), row.replacement), (flag, evidence)
        elif evidence.startswith("gone: "):
            folder = evidence.removeprefix("gone: ")
            assert (old.root / folder).is_dir() and not (new.root / folder).exists(), evidence
        else:
            name = evidence.removeprefix("unread: ")
            readers = [f"{p.relative_to(old.root)}:{n}" for p in old.root.rglob("*.py")
                       for n, text in enumerate(p.read_text(errors="replace").splitlines(), 1) if name in text]
            line = int(added.partition(":")[2])
            assert readers and all(r.startswith(added.partition(":")[0] + ":") and 0 <= int(r.rpartition(":")[2]) - line <= 3
                                   for r in readers), readers  # its own add_argument (dest=...), nothing else
        assert row.applies_to(new.table) and not row.applies_to(old.table), flag
    assert {row.action for row in RETIRED_FLAGS} == {TRANSLATE, DROP, REFUSE}


def test_a_row_applies_from_the_release_that_retired_its_flag():
    """Decided from each release's flag table (tests/data/megatron_lm/flags_*.tsv, made by importing
    each release): a row with a replacement where the old flag is gone and the replacement there
    (core_v0.17.1 has both forms of the tokenizer switches: nothing to do); a row without one from
    ``removed_in``, the first release whose table lacks the flag (core_v0.14.0 has no
    --legacy-tokenizer yet, and it is not refused there)."""
    versions = {row[0]: tuple(int(x) for x in row[2].split(".")[:2]) for row in tsv_rows("versions.tsv")}
    tables = {}
    for path in sorted(DATA.glob("flags_*.tsv")):
        tag = path.stem.removeprefix("flags_")
        flags = {line.split("\t")[0] for line in path.read_text().splitlines() if line.startswith("--")}
        tables[tag] = table_of(flags, f"{'.'.join(map(str, versions[tag]))} (a checkout of {tag})")
    applying = {row.flag: [tag for tag, table in tables.items() if row.applies_to(table)] for row in RETIRED_FLAGS}
    newer = ["core_v0.18.2", "core_v0.19.0", "main"]
    assert applying == {**{row.flag: newer for row in RETIRED_FLAGS}, "--legacy-tokenizer": ["core_v0.17.1", *newer]}
    for row in RETIRED_FLAGS:
        if row.removed_in is not None:  # the first release after the last one with the flag
            last = max(versions[tag] for tag, table in tables.items() if row.flag in table.flags)
            assert row.removed_in == min(v for v in versions.values() if v > last), row.flag
    documented = (REPO / "docs" / "megatron-lm.md").read_text()
    assert all(f"| `{row.flag}` |" in documented for row in RETIRED_FLAGS)  # its table, row by row
    assert release_version("core_v0.16.1") == (0, 16) and release_version("0.19.1 (/opt/Megatron-LM)") == (0, 19)


def _plan(checkout: Checkout, tmp_path, env: dict[str, str], extra: tuple[str, ...] = ()):
    from megatron_ext.data.prepare import planned_prepared
    from megatron_ext.run_spec.params import load_run_params, with_batch_geometry
    from megatron_ext.run_spec.run_paths import RunPaths
    from orchestration.launch_env import read_launch_env
    from orchestration.megatron_lm.program import plan_program

    launch = read_launch_env({"ARTIFACT_ROOT": str(tmp_path / "art"), "MEGATRON_LM_DIR": str(checkout.root), **env})
    params = with_batch_geometry(load_run_params("gpt_smoke", "smoke", dataclasses.replace(
        launch.overrides, engine="megatron-lm")), 2)[0]
    params = dataclasses.replace(params, training=dataclasses.replace(params.training, megatron_lm_extra_args=extra))
    paths = RunPaths(launch.artifact_root, "r")
    return plan_program(params, "gpt_smoke", "smoke", paths, launch, checkout,
                        planned_prepared(params.data, paths.data_cache_dir))


def test_extra_arguments_written_for_0_16_are_translated_dropped_or_refused_on_0_19(read, tmp_path):
    """MEGATRON_LM_EXTRA_ARGS and training.megatron_lm_extra_args on a core_v0.19.0 checkout: one
    line each, naming where the flag came from, what 0.19 has instead and what was done; the
    rendered argv carries the translation and not the dropped flags; a refused flag stops the plan
    with one line naming both; on core_v0.16.1 the same flags pass untouched."""
    new = read["core_v0.19.0"]
    plan = _plan(new, tmp_path, {"MEGATRON_LM_EXTRA_ARGS": "--tokenizer-hf-use-fast --muon-use-nesterov --log-params-norm"},
                 ("--no-scatter-gather-tensors-in-pipeline", "--tokenizer-hf-include-special-tokens"))
    assert plan.program_args[-2:] == ("--muon-nesterov", "--log-params-norm")
    assert not {row.flag for row in RETIRED_FLAGS} & set(plan.program_args)
    retired = [n for n in plan.notes if "not in Megatron-LM" in n]
    assert retired == [
        "training.megatron_lm_extra_args: --no-scatter-gather-tensors-in-pipeline: not in Megatron-LM 0.19.1 (no such "
        "option: the flag had no effect in core_v0.16.1 either, where nothing read scatter_gather_tensors_in_pipeline): dropped",
        "training.megatron_lm_extra_args: --tokenizer-hf-include-special-tokens: not in Megatron-LM 0.19.1 (including "
        "special tokens is its default; the opt-out is --tokenizer-hf-no-include-special-tokens): dropped",
        "MEGATRON_LM_EXTRA_ARGS: --tokenizer-hf-use-fast: not in Megatron-LM 0.19.1 (fast tokenizers are its default; "
        "the opt-out is --tokenizer-hf-no-use-fast): dropped",
        "MEGATRON_LM_EXTRA_ARGS: --muon-use-nesterov: not in Megatron-LM 0.19.1 (its name for the same switch is "
        "--muon-nesterov): translated to --muon-nesterov",
    ], retired
    with pytest.raises(UserError) as refused:
        _plan(new, tmp_path, {"MEGATRON_LM_EXTRA_ARGS": "--use-legacy-models"}, ("--legacy-tokenizer",))
    message = str(refused.value)
    assert message.startswith("training.megatron_lm_extra_args: --legacy-tokenizer: not in Megatron-LM 0.19.1 (the "
                              "legacy tokenizers are gone: megatron.core.tokenizers builds every --tokenizer-type): refused; "
                              "remove it"), message
    assert ("; MEGATRON_LM_EXTRA_ARGS: --use-legacy-models: not in Megatron-LM 0.19.1 (the legacy models are gone: it "
            "builds Megatron-Core models only): refused; remove it to train Megatron-Core's GPT model") in message
    assert message.endswith("or use a checkout that has it (core_v0.16.1 does)") and "\n" not in message
    old = _plan(read["core_v0.16.1"], tmp_path, {"MEGATRON_LM_EXTRA_ARGS": "--use-legacy-models --muon-use-nesterov"})
    assert old.program_args[-2:] == ("--use-legacy-models", "--muon-use-nesterov")
    assert not [n for n in old.notes if "not in Megatron-LM" in n]


def test_the_start_says_once_that_0_19_deprecates_gpt_model(read, tmp_path):
    """core_v0.19.0's GPTModel logs its deprecation on every rank; the plan says it once, before the
    start, with what the launcher runs (read from the checkout's source; core_v0.16.1 has none)."""
    new, old = (_plan(read[tag], tmp_path, {}).notes for tag in ("core_v0.19.0", "core_v0.16.1"))
    said = [n for n in new if "deprecates GPTModel" in n]
    assert len(said) == 1 and said[0].startswith("Megatron-LM 0.19.1 deprecates GPTModel (each rank logs 'GPTModel IS "
                                                 "DEPRECATED'"), new
    assert not any("deprecates GPTModel" in n for n in old), old


def test_the_hybrid_program_needs_transformer_engine_layers_in_0_19(checkouts):
    """Why pretrain_hybrid.py is not offered (docs/megatron-lm.md, "GPTModel, deprecated in 0.19"):
    its builder takes layers only from --spec, and every spec core_v0.19.0 ships for it is built of
    transformer-engine layers, which nodes without transformer-engine (and the CPU) cannot run."""
    root = checkouts["core_v0.19.0"]
    assert "You must provide a valid hybrid layer spec via --spec" in (root / "hybrid_builders.py").read_text()
    for spec in ("megatron/core/models/hybrid/hybrid_layer_specs.py", "megatron/core/post_training/modelopt/hybrid/model_specs.py"):
        imports = re.search(r"from megatron\.core\.extensions\.transformer_engine import \(?([^)]*?)\)?\n(?!\s)",
                            (root / spec).read_text(), re.S)
        assert imports and "TENorm" in imports.group(1), spec
    assert sorted(p.name for p in (root / "megatron/core/models/hybrid").glob("*spec*.py")) == ["hybrid_layer_specs.py"]


def test_an_argument_file_for_0_16_imports_against_a_0_19_checkout(read, tmp_path):
    """import-megatron-args with the core_v0.19.0 checkout: the old flags are translated or dropped,
    each a note naming file and line; a refused one is one error naming file and line."""
    from orchestration.import_args.importer import import_files, load_flag_table
    from orchestration.import_args.yaml_files import render_report

    table = read["core_v0.19.0"].table.without_optional()  # what load_flag_table(MEGATRON_LM_DIR) gives
    files = [(str(p), p.read_text()) for p in sorted((DATA / "args" / "params" / "qwen3_1p7b").glob("*.sh"))]
    extra = ("EXTRA=(\n    --tokenizer-hf-use-fast\n    --muon-use-nesterov\n)\n")
    result = import_files([*files, ("old.sh", extra)], table)
    report = render_report(result)
    assert ("note: old.sh:2: --tokenizer-hf-use-fast: not in Megatron-LM 0.19.1 (fast tokenizers are its default; the "
            "opt-out is --tokenizer-hf-no-use-fast): dropped\n") in report, report
    assert ("note: old.sh:3: --muon-use-nesterov: not in Megatron-LM 0.19.1 (its name for the same switch is "
            "--muon-nesterov): translated to --muon-nesterov\n") in report
    assert "not imported: --muon-nesterov (old.sh:3)" in report  # the translated flag, read as 0.19's own
    with pytest.raises(UserError, match=r"^old\.sh:2: --use-legacy-models: not in Megatron-LM 0\.19\.1 \(the legacy "
                                        r"models are gone: it builds Megatron-Core models only\): refused; remove it"):
        import_files([*files, ("old.sh", "EXTRA=(\n    --use-legacy-models\n)\n")], table)
    shipped = import_files([*files, ("old.sh", extra)], load_flag_table(None))  # core_v0.16.1's own flags: untouched
    assert not [n for n in shipped.notes if "not in Megatron-LM" in n]


# -- the Python a checkout needs ---------------------------------------------------------------------

def test_a_checkout_s_python_is_read_from_its_pyproject(read):
    """core_v0.19.0 states >=3.12 in its pyproject.toml (its code imports typing.override, new in
    3.12); core_v0.16.1's archive has no pyproject.toml: nothing is required."""
    for tag, wanted, evidence in tsv_rows("requires_python.tsv"):
        checkout = read[tag]
        assert checkout.requires_python == (wanted or None), tag
        if evidence != "-":
            assert "override" in line_of(checkout.root, evidence.split()[0]), evidence
    assert read["core_v0.16.1"].python_requirement is None


def test_every_node_s_preflight_refuses_a_python_the_checkout_does_not_support(read, tmp_path):
    """The launcher sends the checkout's requirement in every node's check request; each node compares
    its own interpreter, one line naming both versions and the fix. The rule on given versions too."""
    from orchestration.node import preflight
    from orchestration.node.wire import CheckRequest, NodeCheckRequest, NodeTarget, decode_request, node_call

    requirement = read["core_v0.19.0"].python_requirement
    root = read["core_v0.19.0"].root
    request = CheckRequest(master_addr="localhost", nproc_per_node=2, nnodes=1, python=requirement)
    call = node_call(NodeCheckRequest(NodeTarget("r", 0, "localhost", tmp_path), request))
    assert decode_request(call.command, call.request) == NodeCheckRequest(NodeTarget("r", 0, "localhost", tmp_path), request)
    report = preflight.inspect_node(decode_request(call.command, call.request), tmp_path / "rs", 0, REPO)
    running = "%d.%d.%d" % sys.version_info[:3]
    line = (f"Megatron-LM 0.19.1 (MEGATRON_LM_DIR={root}) needs Python >=3.12 (requires-python in "
            f"its pyproject.toml), and this node runs {running} ({sys.executable}); run the launcher with a Python 3.12 "
            "environment at the same path on every node (LAUNCHER_PYTHON=/path/to/python3.12 bash "
            "training_scripts/setup_env.sh, then start with that LAUNCHER_PYTHON), or use a Megatron-LM checkout that "
            f"supports Python {sys.version_info[0]}.{sys.version_info[1]}")
    assert [p for p in report.problems if "needs Python" in p] == ([line] if sys.version_info < (3, 12) else [])
    assert python_problem(requirement, (3, 12, 1), "/opt/py312/bin/python") is None
    assert python_problem(requirement, (3, 11, 7), "/usr/bin/python3", "the launcher").startswith(
        f"Megatron-LM 0.19.1 (MEGATRON_LM_DIR={root}) needs Python >=3.12 (requires-python in its "
        "pyproject.toml), and the launcher runs 3.11.7 (/usr/bin/python3); run the launcher with a Python 3.12")
    ranged = PythonRequirement("Megatron-LM 9.9.9", ">=3.10,<3.12", "requires-python in its pyproject.toml")
    assert "with a Python 3.10 environment" in python_problem(ranged, (3, 12, 1), "p")
    assert python_problem(ranged, (3, 11, 7), "p") is None
    broken = python_problem(dataclasses.replace(ranged, specifier="python3.12"), (3, 11, 7), "p")
    assert broken == ("Megatron-LM 9.9.9 states Python 'python3.12' (requires-python in its pyproject.toml), which is no "
                      "PEP 440 version specifier; fix it there (e.g. >=3.12)")
    without = preflight.inspect_node(NodeCheckRequest(NodeTarget("r", 0, "localhost", tmp_path),
                                                      CheckRequest(master_addr="localhost", nproc_per_node=2, nnodes=1)),
                                     tmp_path / "rs", 0, REPO)
    assert not [p for p in without.problems if "needs Python" in p]


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info >= (3, 12), reason="core_v0.19.0 runs on this Python: nothing to refuse")
def test_a_dry_run_with_a_0_19_checkout_on_python_3_11_says_the_refusal(checkouts, tmp_path):
    """``DRY_RUN=1`` with core_v0.19.0 on Python 3.11: the argument check says why it cannot run and
    that the preflight refuses the start (not "checked every flag against the checkout's source
    instead"), and the preflight's table holds the node's line; exit 2, no traceback."""
    env = clean_env(DRY_RUN="1", ENGINE="megatron-lm", MEGATRON_LM_DIR=str(checkouts["core_v0.19.0"]),
                    ARTIFACT_ROOT=str(tmp_path / "art"), MEGATRON_LM_EXTRA_ARGS="--tokenizer-hf-use-fast")
    proc = subprocess.run([sys.executable, "-m", "orchestration", "start", "gpt_smoke", "smoke", "r", "--this-node"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    needs = f"Megatron-LM 0.19.1 (MEGATRON_LM_DIR={checkouts['core_v0.19.0']}) needs Python >=3.12"
    assert ("note: Megatron-LM's own argument check cannot run here, and every node's preflight refuses a start on this "
            f"Python: {needs} (requires-python in its pyproject.toml), and the launcher runs") in proc.stderr, proc.stderr
    assert re.search(rf"^0 +localhost +{re.escape(needs)} .*, and this node runs ", proc.stderr, re.M), proc.stderr
    assert "checked every flag against the checkout's source instead" not in proc.stderr
    assert "note: MEGATRON_LM_EXTRA_ARGS: --tokenizer-hf-use-fast: not in Megatron-LM 0.19.1" in proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
