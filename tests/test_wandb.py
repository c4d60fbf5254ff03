"""Weights & Biases: settings from WANDB_*, the launcher's refusal without wandb, and a real offline
run (2 ranks, then a resume) read back from wandb's own files."""

from __future__ import annotations

import json
import secrets
import struct
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_torchrun, write_data_set
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.run_paths import RunPaths
from megatron_ext.run_spec.wandb_run import read_wandb_settings
from orchestration.launch_env import read_launch_env
from orchestration.node.wire import CheckRequest, NodeCheckRequest, NodeTarget, decode_request, node_call
from orchestration.runner.preflight import required_modules


def test_wandb_settings_come_from_the_environment(tmp_path):
    assert read_wandb_settings({"WANDB_MODE": "offline"}) is None  # no project: no W&B
    s = read_wandb_settings({"WANDB_PROJECT": "p", "WANDB_ENTITY": "team", "WANDB_MODE": "offline"})
    paths = RunPaths(tmp_path, "demo")
    assert (s.project, s.entity, s.mode, s.enabled) == ("p", "team", "offline", True)
    assert s.exp_name("demo") == "demo" and s.save_dir(paths) == paths.run_dir  # wandb writes runs/demo/wandb/
    named = read_wandb_settings({"WANDB_PROJECT": "p", "WANDB_NAME": "z1 try", "WANDB_DIR": str(tmp_path / "w")})
    assert named.exp_name("demo") == "z1 try" and named.save_dir(paths) == tmp_path / "w"
    assert not read_wandb_settings({"WANDB_PROJECT": "p", "WANDB_MODE": "disabled"}).enabled
    with pytest.raises(UserError, match=r"WANDB_MODE='ofline' is not a W&B mode; use one of online, offline"):
        read_wandb_settings({"WANDB_PROJECT": "p", "WANDB_MODE": "ofline"})


def test_a_rank_without_wandb_project_blocks_megatron_core_s_wandb_import(monkeypatch):
    """megatron-core imports wandb as it is imported, when installed; a run not logging to W&B does
    not pay for it (megatron_ext/pretrain.py), and one logging to it is left alone."""
    import importlib.util

    from megatron_ext.import_hooks import skip_unused_wandb

    modules: dict = {}
    assert skip_unused_wandb({}, modules) and modules == {"wandb": None}
    assert not skip_unused_wandb({"WANDB_PROJECT": "p"}, {}) and not skip_unused_wandb({}, {"wandb": object()})
    monkeypatch.setitem(sys.modules, "wandb", None)  # recorded, so the test's end puts back what was there
    del sys.modules["wandb"]
    assert skip_unused_wandb({})
    with pytest.raises(ImportError):
        import wandb  # noqa: F401
    assert importlib.util.find_spec("wandb") is None


def test_the_launcher_forwards_wandb_and_every_node_checks_it_imports(tmp_path, monkeypatch):
    key = secrets.token_hex(20)
    launch = read_launch_env({"WANDB_PROJECT": "p", "WANDB_RUN_GROUP": "sweep", "WANDB_API_KEY": key,
                              "ARTIFACT_ROOT": str(tmp_path)})
    assert launch.forwarded["WANDB_PROJECT"] == "p" and launch.forwarded["WANDB_RUN_GROUP"] == "sweep"
    assert "WANDB_API_KEY" not in launch.forwarded and launch.secrets == {"WANDB_API_KEY": key}
    assert key not in repr(launch)
    assert required_modules(launch) == ("wandb",)
    assert required_modules(read_launch_env({"WANDB_PROJECT": "p", "WANDB_MODE": "disabled"})) == ()
    assert required_modules(read_launch_env({})) == ()
    request = CheckRequest(master_addr="localhost", nproc_per_node=2, nnodes=1, shared_token=str(tmp_path / "t"),
                           required_modules=required_modules(launch))
    call = node_call(NodeCheckRequest(NodeTarget("r", 0, "localhost", tmp_path), request))
    assert decode_request(call.command, call.request).check.required_modules == ("wandb",)

    from orchestration.node import preflight

    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    report = preflight.inspect_node(NodeCheckRequest(NodeTarget("r", 0, "localhost", tmp_path),
                                                     CheckRequest(master_addr="localhost", nproc_per_node=2, nnodes=1,
                                                                  required_modules=("wandb",))),
                                    tmp_path / "run_state", 0, REPO)
    [problem] = [p for p in report.problems if "wandb" in p]
    assert problem.startswith("WANDB_PROJECT is set but wandb is not installed on this node (")
    assert "pip install wandb (or pip install -e .[wandb]) on every node, or unset WANDB_PROJECT" in problem


def test_a_rank_refuses_wandb_that_does_not_import(tmp_path, monkeypatch):
    """Plain torchrun, no launcher: every rank refuses before a process group exists."""
    from megatron_ext import pretrain

    real = pretrain.importlib.util.find_spec
    monkeypatch.setattr(pretrain.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    args = pretrain.parse_args(["--model", "gpt_smoke", "--data", "smoke", "--run-name", "r"])
    with pytest.raises(UserError, match=r"WANDB_PROJECT is set but wandb is not installed for .*pip install wandb"):
        pretrain.resolve(args, {"WANDB_PROJECT": "p", "ARTIFACT_ROOT": str(tmp_path)})


# -- wandb's own files ------------------------------------------------------------------------------

def wandb_records(path: Path):
    """The records of a ``.wandb`` file (a LevelDB-style log of wandb's protobuf ``Record``: a 7-byte
    header, 32 KiB blocks, each chunk ``crc32 | length | type``), as wandb's sync reads it."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def read_offline_run(run_dir: Path) -> dict:
    """An offline run directory's id, config and history (step -> scalars)."""
    [log] = run_dir.glob("*.wandb")
    out = {"id": None, "config": {}, "history": {}}
    for r in wandb_records(log):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["id"] = r.run.run_id
            out["config"] = {c.key: json.loads(c.value_json) for c in r.run.config.update}
            out["name"], out["project"] = r.run.display_name, r.run.project
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out["history"][r.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


@pytest.mark.slow
def test_offline_run_logs_every_iteration_once_from_one_rank_and_resumes_the_same_run(artifact_root, tmp_path):
    """2 ranks, 6 iterations (checkpoints at 4 and 6), then the run resumed from iteration 4 to 8, as
    a restart after a failure at iteration 6 would: one W&B run, each iteration logged once."""
    run, key = "wandb_offline", secrets.token_hex(20)
    data = write_data_set(tmp_path / "six.yaml", train_iters=6, save_interval=4)
    env = {"WANDB_PROJECT": "megatron-zero-tests", "WANDB_MODE": "offline", "WANDB_API_KEY": key}
    proc, first = run_torchrun(artifact_root, run, data=data, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = RunPaths(artifact_root, run)
    (paths.checkpoints_dir / "latest").write_text("iter_0000004")  # as if the attempt had failed after iteration 6
    proc, second = run_torchrun(artifact_root, run, data=data, train_iters=8, **env)
    assert proc.returncode == 0 and "resuming from iteration 4" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]

    runs = sorted(paths.wandb_dir.glob("offline-run-*"))
    assert len(runs) == 2, runs  # one W&B writer per start: one rank logs
    a, b = (read_offline_run(r) for r in runs)
    assert a["id"] == b["id"] == json.loads(paths.wandb_state_path.read_text())["id"]
    assert (a["name"], a["project"]) == (run, "megatron-zero-tests")
    assert a["config"]["logging_rank"] == 1 and a["config"]["world_size"] == 2  # the last rank, as Megatron-LM
    assert sorted(a["history"]) == [1, 2, 3, 4, 5, 6] and sorted(b["history"]) == [7, 8]  # 5 and 6 not twice
    for logged, records in ((a["history"], first), (b["history"], second)):  # what rank 0 wrote to metrics.jsonl
        metrics = {r["iteration"]: r for r in records}
        for step, scalars in logged.items():
            assert scalars["lm loss"] == pytest.approx(metrics[step]["lm_loss"], rel=1e-9)
            assert scalars["learning-rate"] == pytest.approx(metrics[step]["lr"], rel=1e-9)
            assert {"grad-norm", "throughput/tokens-per-s", "iteration-time-s", "memory/model-state-bytes"} <= set(scalars)
    assert "validation/lm loss" in a["history"][6] and "validation/lm loss" in b["history"][8]
    assert json.loads(paths.wandb_state_path.read_text())["last_step"] == 8
    for path in paths.run_dir.rglob("*"):  # the API key reached the ranks, but no file
        assert not path.is_file() or key.encode() not in path.read_bytes(), path
