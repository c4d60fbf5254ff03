"""The start plan: what every node runs, built by one pure function from what the start read and
what the nodes' preflight answered; ``DRY_RUN=1`` prints it, a start executes exactly it.

    DRY_RUN=1 HOSTS=node0,node1 python -m orchestration start gpt_smoke smoke demo

Three parts (torchx: ``schedule(dryrun_info)`` runs the request it printed):

- :func:`read_start_inputs` reads what a start depends on (the params with the global batch
  applied, the latest checkpoint, the attempt ledger, a Megatron-LM checkout, where the data is
  or will be prepared) into :class:`StartInputs`; every bad input is a UserError here;
- the preflight (orchestration/runner/preflight.py) asks every node and answers with its
  :class:`~orchestration.node.wire.NodeReport` (the free port node 0 picked, each node's interface
  to MASTER_ADDR and its node-local directory, its software);
- :func:`plan_start` (pure) turns inputs and answers into a :class:`StartPlan`: the run id, and per
  node the host, the torchrun argv, every variable every process of the run gets from the
  launcher and the supervisor (attempt 1's, with the rule for later attempts), the variables
  removed, the working directory, the log and pid-file paths, the names of the secret variables
  (never their values); and the :class:`Step` s with side effects (data preparation, Megatron-LM's
  argument check and helpers, the checkpoint link, the parameters file, the nodes' start), each an
  object that executes itself and whose description names every side effect it has; the start runs
  them in order (orchestration/runner/start.py). Without answers (the nodes could not be asked) the
  plan is marked unsettled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Iterator, Mapping, Sequence

from megatron_ext.host.devices import Device
from megatron_ext.run_spec.engines import engine_named
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.megatron_lm_checkpoints import check_loadable_by_megatron_lm, find_megatron_lm_checkpoint
from megatron_ext.run_spec.checkpoints import check_resumable, latest_iteration, read_meta
from megatron_ext.run_spec.params import BatchGeometry, RunParams, load_run_params, with_batch_geometry
from megatron_ext.run_spec.model_size import checkpoint_bytes, parameters_to_save
from megatron_ext.run_spec.resilience import (ATTEMPT_ENV, FLIGHT_RECORDER_ENTRIES, FLIGHT_RECORDER_ENV, PROGRESS_DIR_ENV,
                                              PauseSchedule)
from megatron_ext.run_spec.resolved import ResolvedRun, RunRuntime, write_resolved
from megatron_ext.run_spec.run_paths import RunPaths, check_root_writable, check_run_name
from megatron_ext.run_spec.wandb_run import WandbState, read_wandb_state, write_wandb_state
from orchestration.cluster.backends import backend_for
from orchestration.cluster.fanout import NodeResult
from orchestration.launch_env import SOCKET_IFNAME_VARIABLES, LaunchEnv
from orchestration.megatron_lm.checkout import Checkout, read_checkout
from orchestration.megatron_lm.dataset_helpers import ensure_built
from orchestration.megatron_lm.flags import StrayWord, split_flags
from orchestration.megatron_lm.program import (BUILD_HELPERS, CHECK_ARGUMENTS, ProgramPlan, Verdicts, check_arguments,
                                               check_megatron_lm_params, plan_program)
from orchestration.node.run_state import first_attempt, read_heartbeat
from orchestration.node.wire import MEMBERSHIP_RULE, NODE_TAG, RUN_ID_TAG, RUN_TAG, NodePlan, NodeReport, NodeStarted, torchrun_argv

if TYPE_CHECKING:
    from megatron_ext.data.prepare import PreparedData

DEFAULT_LOCAL_DIR = "/dev/shm"
"""A node's local directory for the ranks' progress files until its preflight says (tmpfs where there is one)."""
PER_ATTEMPT = {ATTEMPT_ENV: "the attempt: the plan's first_attempt, then one more at each restart"}
PER_ATTEMPT_ELASTIC = {"NNODES": MEMBERSHIP_RULE, "NODE_RANK": "this node's place among the nodes of the attempt",
                       "--nnodes": "as NNODES", "--node-rank": "as NODE_RANK"}


@dataclass(frozen=True, kw_only=True)
class StartInputs:
    """What a start read before planning (:func:`read_start_inputs`)."""

    model: str
    data: str
    run: str
    nodes: tuple[tuple[int, str], ...]
    """(node rank, host) of the nodes this start reaches."""
    params: RunParams
    """With the overrides and the global batch applied."""
    geometry: BatchGeometry
    run_id: str
    resume_from: int | None = None
    """The iteration of the run's latest checkpoint, which the ranks will resume from."""
    resume_note: str | None = None
    first_attempt: int = 1
    """1, or the next attempt of a requeued Slurm job (its ledger continues)."""
    prepared: PreparedData | None = None
    """ENGINE=megatron-lm: where the data is (or will be) prepared (the launcher prepares it)."""
    data_ready: bool = True
    """The prepared data exists already (else the start prepares it first)."""
    checkout: Checkout | None = None
    """ENGINE=megatron-lm: the checkout's version and flags."""
    link_checkpoints: bool = False
    """CHECKPOINT_ROOT: the run's checkpoint folder is to be linked there (the start does it)."""


@dataclass(frozen=True, kw_only=True)
class StartPlan:
    run: str
    run_id: str
    resolved: ResolvedRun
    """Written to the run's params file at start."""
    geometry: BatchGeometry
    nodes: tuple[NodePlan, ...] = field(default_factory=tuple)
    resume_from: int | None = None
    program: ProgramPlan | None = None
    python: str = ""
    cwd: str = ""
    notes: tuple[str, ...] = ()
    """What the user should know about this start (how the program was checked, a reshard, what
    the preflight settled)."""
    first_attempt: int = 1
    steps: tuple[Step, ...] = ()
    settled: bool = False
    """Built with every node's preflight answers (else MASTER_PORT, the interfaces and the local
    directories are what a start would settle)."""
    master_port: int = 0

    @property
    def node_hosts(self) -> tuple[tuple[int, str], ...]:
        """(rank, host) of every node: what a backend is picked from (cluster/backends.py)."""
        return tuple((p.node_rank, p.host) for p in self.nodes)

    def header(self) -> dict:
        """What the dry run prints before the nodes' plans."""
        engine = engine_named(self.resolved.runtime.engine)
        return {"run": self.run, "run_id": self.run_id, "settled": self.settled, "master_port": self.master_port,
                "resume_from": self.resume_from, "engine": engine.label, "known_limits": engine.known_limits,
                "steps": [{"name": s.name, "description": s.description, "check": s.check} for s in self.steps]}

    def to_json_lines(self) -> list[str]:
        """The plan as the dry run prints it: the header, then one line per node."""
        return [json.dumps({"plan": self.header()}), *(n.to_json() for n in self.nodes)]


# -- reading ---------------------------------------------------------------------------------------

def read_start_inputs(launch: LaunchEnv, model: str, data: str, run: str, nodes: Sequence[tuple[int, str]]) -> StartInputs:
    """Checked params for the whole cluster (world = NNODES x NPROC_PER_NODE) and everything else a
    start depends on; a UserError before anything starts. Reads files only (and makes and removes one
    empty folder: whether the artifact root takes the run's files)."""
    from megatron_ext.data.tokenizers import check_tokenizer

    check_run_name(run)
    check_root_writable(launch.artifact_root)
    params = load_run_params(model, data, launch.overrides)
    check_tokenizer(params.data.tokenizer)
    params, geometry = with_batch_geometry(params, launch.world_size)
    params = with_min_nodes(params, launch)
    paths = RunPaths(launch.artifact_root, run)
    resume_from = latest_iteration(paths.checkpoints_dir)
    note = None
    engine = engine_named(params.training.engine)
    if resume_from is not None and not engine.runs_checkout:  # Megatron-LM checks its own checkpoints
        t = params.training
        note = check_resumable(read_meta(paths.checkpoints_dir, resume_from), launch.world_size, t.zero_stage,
                               t.global_batch_size, launch.device, paths.checkpoints_dir)
    checkout = prepared = None
    ready = True
    if engine.runs_checkout:
        check_megatron_lm_params(params)
        init = params.training.init_checkpoint  # Megatron-LM loads the iteration the tracker names, no other
        if init and Path(init).expanduser().exists():  # else the ranks say it is missing
            check_loadable_by_megatron_lm(find_megatron_lm_checkpoint(init))
        if not launch.megatron_lm_dir:
            raise UserError("ENGINE=megatron-lm needs MEGATRON_LM_DIR, the Megatron-LM checkout holding pretrain_gpt.py")
        checkout = read_checkout(launch.megatron_lm_dir)
        from megatron_ext.data.prepare import is_prepared, planned_prepared  # numpy: only where the launcher prepares

        prepared = planned_prepared(params.data, paths.data_cache_dir)
        ready = is_prepared(params.data, paths.data_cache_dir)
    return StartInputs(model=model, data=data, run=run, nodes=tuple(nodes), params=params, geometry=geometry,
                       run_id=f"{run}-{uuid.uuid4().hex[:10]}", resume_from=resume_from, resume_note=note,
                       first_attempt=first_attempt(paths, continue_ledger=launch.slurm_restart_count > 0), prepared=prepared,
                       data_ready=ready, checkout=checkout, link_checkpoints=check_checkpoint_link(launch, run))


def checkpoint_target(launch: LaunchEnv, run: str) -> Path:
    """Where the run's checkpoints are written: ``<CHECKPOINT_ROOT>/<run>/checkpoints`` when set (the
    run's folder under the artifact root links there), else that folder itself."""
    if launch.checkpoint_root is not None:
        return launch.checkpoint_root / run / "checkpoints"
    return RunPaths(launch.artifact_root, run).checkpoints_dir


def check_checkpoint_link(launch: LaunchEnv, run: str) -> bool:
    """Whether the start must link the run's checkpoint folder to CHECKPOINT_ROOT; a UserError where it
    cannot (the run keeps checkpoints elsewhere already). Reads the file system."""
    if launch.checkpoint_root is None:
        return False
    link, target = RunPaths(launch.artifact_root, run).checkpoints_dir, checkpoint_target(launch, run)
    if link.is_symlink():
        if link.resolve() != target.resolve():
            raise UserError(f"run {run}'s checkpoints are in {link.resolve()} (linked from {link}), not under "
                            f"CHECKPOINT_ROOT={launch.checkpoint_root}; give that CHECKPOINT_ROOT, or another RUN name")
        return False
    if link.exists() and any(link.iterdir()):
        raise UserError(f"run {run} keeps its checkpoints in {link} already: CHECKPOINT_ROOT={launch.checkpoint_root} "
                        "cannot move them; unset CHECKPOINT_ROOT, move them there yourself, or use another RUN name")
    return True


def with_min_nodes(params: RunParams, launch: LaunchEnv) -> RunParams:
    """``params`` with the fewest nodes the run may go on with (NNODES=MIN:MAX, else the data set's
    training.resilience.min_nodes), checked for every node count from there to NNODES before
    anything starts: the global batch divides at each, and the checkpoint can be resharded."""
    r, t = params.training.resilience, params.training
    low = launch.min_nodes if launch.min_nodes is not None else (r.min_nodes or launch.nnodes)
    if low > launch.nnodes:
        raise UserError(f"training.resilience.min_nodes={low} is more than the {launch.nnodes} node(s) of this start; "
                        f"set it to at most {launch.nnodes} (or NNODES=MIN:MAX)")
    params = dataclasses.replace(params, training=dataclasses.replace(
        t, resilience=dataclasses.replace(r, min_nodes=low if low < launch.nnodes else 0)))
    if low >= launch.nnodes:
        return params
    counts = range(low, launch.nnodes + 1)
    uneven = [n for n in counts if t.global_batch_size % (t.micro_batch_size * n * launch.nproc_per_node)]
    if uneven:
        raise UserError(
            f"NNODES={low}:{launch.nnodes}: the global batch {t.global_batch_size} does not divide into micro-batches of "
            f"{t.micro_batch_size} on {', '.join(map(str, uneven))} node(s) x {launch.nproc_per_node} processes, so a run "
            f"that loses nodes could not keep it; choose a global batch that every count from {low} to {launch.nnodes} "
            f"divides (e.g. {t.micro_batch_size * launch.nproc_per_node * math.lcm(*counts)}), or another MIN")
    engine = engine_named(t.engine)
    why = engine.reshard_refusal(t.zero_stage, launch.device)
    if why:
        raise UserError(f"NNODES={low}:{launch.nnodes} at ZERO_STAGE={t.zero_stage}: {why}; a run that may lose a node "
                        f"needs a checkpoint another data-parallel size can load: use ZERO_STAGE="
                        f"{' or '.join(str(s) for s in range(4) if not engine.reshard_refusal(s, launch.device))}, "
                        "or NNODES without MIN")
    return params


# -- planning (pure) -------------------------------------------------------------------------------

def node_environment(launch: LaunchEnv, node_rank: int, run: str, run_id: str, program_env: Mapping[str, str | None],
                     local_dir: str, first: int) -> tuple[dict[str, str], tuple[str, ...]]:
    """(variables set, variables removed) for every process of the run on node ``node_rank``: the
    forwarded ones, the program's, the launcher's, the run tags, and the supervisor's (the attempt,
    the node-local progress directory, torch's flight recorder for the hang dumps)."""
    env = {k: v for k, v in launch.forwarded.items() if k not in program_env}
    env.update({k: v for k, v in program_env.items() if v is not None})
    env.update(NNODES=str(launch.nnodes), NODE_RANK=str(node_rank), NPROC_PER_NODE=str(launch.nproc_per_node),
               MASTER_ADDR=launch.master_addr, MASTER_PORT=str(launch.master_port), ARTIFACT_ROOT=str(launch.artifact_root),
               PYTHONUNBUFFERED="1", **{RUN_TAG: run, RUN_ID_TAG: run_id, NODE_TAG: str(node_rank)},
               **{ATTEMPT_ENV: str(first), PROGRESS_DIR_ENV: f"{local_dir.rstrip('/')}/megatron_ext_{run_id}_node{node_rank}"})
    if not any(name in env for name in FLIGHT_RECORDER_ENV):  # every collective each rank issued, for the dumps
        env[FLIGHT_RECORDER_ENV[0]] = str(FLIGHT_RECORDER_ENTRIES)
    unset = tuple(sorted(k for k, v in program_env.items() if v is None))
    return env, unset


def settle(launch: LaunchEnv, answers: Sequence[NodeReport] | None) -> tuple[LaunchEnv, dict[int, dict[str, str]],
                                                                               dict[int, str], list[str]]:
    """What the preflight's answers decide: the port (node 0's pick, MASTER_PORT unset), each node's
    interface to MASTER_ADDR (socket variables unset, several nodes), each node's local directory;
    the notes that say so. Pure."""
    if answers is None:
        return launch, {}, {}, []
    notes = []
    node0 = next((r for r in answers if r.node_rank == 0), None)
    if not launch.master_port_explicit and node0 and node0.free_port:
        launch = dataclasses.replace(launch, master_port=node0.free_port)
        notes.append(f"MASTER_PORT is not set: using {node0.free_port}, the first free port from 6000 on node 0")
    unset = [v for v in SOCKET_IFNAME_VARIABLES if v not in launch.forwarded] if launch.nnodes > 1 else []
    node_env = {}
    if unset:
        node_env = {r.node_rank: {v: r.interface for v in unset} for r in answers if r.interface}
        if node_env:
            where = ", ".join(f"node{r.node_rank} {r.interface}" for r in answers if r.interface)
            notes.append(f"{' and '.join(unset)} not set: using the interface that routes to MASTER_ADDR on each node ({where})")
    local_dirs = {r.node_rank: r.local_dir for r in answers if r.local_dir}
    return launch, node_env, local_dirs, notes


# -- the steps ---------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class Started:
    """What a start's steps share while they run (orchestration/runner/start.py makes one)."""

    launch: LaunchEnv
    plan: StartPlan
    inputs: StartInputs
    data_ready: bool
    nodes: list[NodeResult[NodeStarted]] = field(default_factory=list)
    """Every node's start (the start-nodes step's)."""
    verdicts: Verdicts = field(default_factory=dict)
    """Megatron-LM argument checks already run (a sweep's, for all its stages at once)."""

    @property
    def paths(self) -> RunPaths:
        return RunPaths(self.launch.artifact_root, self.plan.run)


@dataclass(frozen=True)
class Step:
    """One thing a start does beyond planning, in order; :meth:`run` does it and returns its notes."""

    description: str
    """What it does, every side effect named."""
    name: ClassVar[str] = ""
    check: ClassVar[bool] = False
    """A check (reads, changes nothing): a dry run runs it too. Else an action, which it only lists."""

    def run(self, start: Started) -> tuple[str, ...]:
        raise NotImplementedError


class PrepareData(Step):
    name = "prepare-data"

    def run(self, start: Started) -> tuple[str, ...]:
        from megatron_ext.data.prepare import ensure_prepared

        ensure_prepared(start.inputs.params.data, start.paths.data_cache_dir)
        start.data_ready = True
        return ()


class CheckArguments(Step):
    name, check = CHECK_ARGUMENTS, True

    def run(self, start: Started) -> tuple[str, ...]:
        return check_arguments(start.plan.program, start.launch, start.inputs.checkout,
                               start.inputs.params.data.tokenizer.model_path, start.data_ready, start.verdicts)


class BuildHelpers(Step):
    name = BUILD_HELPERS

    def run(self, start: Started) -> tuple[str, ...]:
        return (ensure_built(start.inputs.checkout.root, start.launch.python),)


class LinkCheckpoints(Step):
    name = "link-checkpoints"

    def run(self, start: Started) -> tuple[str, ...]:
        paths, target = start.paths, checkpoint_target(start.launch, start.plan.run)
        target.mkdir(parents=True, exist_ok=True)
        paths.run_dir.mkdir(parents=True, exist_ok=True)
        if paths.checkpoints_dir.is_dir() and not paths.checkpoints_dir.is_symlink():
            paths.checkpoints_dir.rmdir()  # empty (checked when the plan was made)
        paths.checkpoints_dir.symlink_to(target, target_is_directory=True)
        return ()


class WriteParams(Step):
    name = "write-params"

    def run(self, start: Started) -> tuple[str, ...]:
        write_resolved(start.paths.params_path, start.plan.resolved)
        wandb_id = start.plan.program.env.get("WANDB_RUN_ID") if start.plan.program else None
        if wandb_id and read_wandb_state(start.paths) is None:
            write_wandb_state(start.paths, WandbState(wandb_id))
        return ()


class StartNodes(Step):
    name = "start-nodes"

    def run(self, start: Started) -> tuple[str, ...]:
        ranks = [p.node_rank for p in start.plan.nodes]
        with naming_the_waits(start.paths, ranks, start.plan.run_id):
            start.nodes = backend_for(start.launch, start.plan.node_hosts).start(start.launch, start.plan.nodes, start.paths)
        return ()


WAIT_SAY_S = 30.0
"""How often a start that waits on its nodes says what each one names as its step under way."""


@contextlib.contextmanager
def naming_the_waits(paths: RunPaths, ranks: Sequence[int], run_id: str, say: Callable[[str], None] | None = None,
                     every_s: float = WAIT_SAY_S, poll_s: float = 2.0) -> Iterator[None]:
    """While the body waits on the nodes' starts: each node's step under way, as its supervisor
    names it in its heartbeat record of this start (``doing``: node 0 reading its share of a 450 GB
    checkpoint before it chooses takes minutes), said on standard error at once and then every
    ``every_s`` (``waiting: node 0 is verifying the checkpoint of iteration 8 before choosing it
    (this node's share, 1 of 4): 40.0 of 112.5 GB read``), so that a long start says what it waits
    for. Reads the records on this machine's view of the share; says nothing where it has none."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    done = threading.Event()

    def watch() -> None:
        said_at: dict[int, float] = {}
        while not done.wait(poll_s):
            for rank in ranks:
                heartbeat = read_heartbeat(paths, rank)
                if (heartbeat is not None and heartbeat.run_id == run_id and heartbeat.doing
                        and time.monotonic() - said_at.get(rank, -math.inf) >= every_s):
                    said_at[rank] = time.monotonic()
                    say(f"waiting: node {rank} is {heartbeat.doing}")
    watcher = threading.Thread(target=watch, name="naming-the-waits", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(poll_s + 1.0)


PROGRAM_STEPS = {CheckArguments.name: CheckArguments, BuildHelpers.name: BuildHelpers}
"""The steps a program plan names (orchestration/megatron_lm/program.py: ENGINE=megatron-lm)."""


def plan_steps(launch: LaunchEnv, inputs: StartInputs, program: ProgramPlan) -> tuple[Step, ...]:
    steps: list[Step] = []
    if inputs.prepared is not None and not inputs.data_ready:
        steps.append(PrepareData(f"tokenize {inputs.params.data.source} into {inputs.prepared.prefixes[0]} "
                                 "(Megatron-LM reads prepared prefixes)"))
    steps += [PROGRAM_STEPS[name](text) for name, text in (*program.checks, *program.prepare)]
    if inputs.link_checkpoints:
        steps.append(LinkCheckpoints("link the run's checkpoint folder under the artifact root to CHECKPOINT_ROOT"))
    wandb = " and the run's W&B id record (one W&B run across restarts)" if program.env.get("WANDB_RUN_ID") else ""
    steps.append(WriteParams(f"write the resolved parameters beside the logs{wandb}"))
    backend = backend_for(launch, inputs.nodes)
    steps.append(StartNodes(f"start {len(inputs.nodes)} node(s) in parallel ({backend.name}): each node's supervisor "
                            "starts its torchrun (node 0 first clears the run's failure and attempt files)"))
    return tuple(steps)


def pause_schedule(training, program_args: Sequence[str]) -> PauseSchedule | None:
    """When the run pauses between its lines by itself (saves, validation passes), its log interval,
    and whether its saves end in the background: the Megatron-LM log watch's limits between two
    lines (orchestration/node/watchdog.py). From the training params, or, where Megatron-LM's
    arguments (``program_args``) give the flag, its last value there: a user's extra arguments come
    last and win, as in Megatron-LM's parser. None where the run neither saves nor evaluates, or
    prints no iteration line (``--skip-train``). Pure."""
    try:
        given = dict(split_flags(list(program_args)))  # the last of a repeated flag, as argparse keeps it
    except StrayWord:
        given = {}

    def number(flag: str, default: int) -> int:
        values = given.get(flag)
        try:
            return int(values[-1]) if values else default
        except ValueError:
            return default
    if "--skip-train" in given:
        return None
    train_iters = number("--train-iters", training.train_iters)
    save_interval = number("--save-interval", training.save_interval)
    evaluates = number("--eval-iters", training.eval_iters) > 0 or "--full-validation" in given
    if not save_interval and not evaluates:
        return None
    return PauseSchedule(save_interval=save_interval, train_iters=train_iters,
                         eval_interval=number("--eval-interval", training.eval_interval or train_iters) if evaluates else 0,
                         background="--async-save" in given, log_interval=number("--log-interval", training.log_interval))


def plan_start(launch: LaunchEnv, inputs: StartInputs, answers: Sequence[NodeReport] | None = None,
               left_out: Sequence[int] = ()) -> StartPlan:
    """The plan of every node in ``inputs.nodes``, settled by ``answers`` (every node's preflight
    report) when given; ``left_out``: nodes the first attempt runs without (NNODES=MIN:MAX). Pure."""
    first_members = tuple(rank for rank, _ in inputs.nodes if rank not in left_out) if left_out else ()
    launch, interfaces, local_dirs, settled_notes = settle(launch, answers)
    params, paths = inputs.params, RunPaths(launch.artifact_root, inputs.run)
    program = plan_program(params, inputs.model, inputs.data, paths, launch, inputs.checkout, inputs.prepared, answers,
                           has_checkpoint=inputs.resume_from is not None)
    node_plans = []
    t = params.training
    pauses = pause_schedule(t, program.program_args)
    parameters = parameters_to_save(params)  # at most: bf16 and fp32 weights with the moments (GPUs, stages 0-1)
    one_checkpoint = checkpoint_bytes(parameters, Device.CUDA, 0) if parameters else 0
    initial = t.init_checkpoint or params.hf_weights or ""
    rendezvous = dict(nnodes=launch.nnodes, nproc_per_node=launch.nproc_per_node, master_addr=launch.master_addr,
                      master_port=launch.master_port)
    for rank, host in inputs.nodes:
        env, unset = node_environment(launch, rank, inputs.run, inputs.run_id, program.env,
                                      local_dirs.get(rank, DEFAULT_LOCAL_DIR), inputs.first_attempt)
        env.update(interfaces.get(rank, {}))
        node_plans.append(NodePlan(
            run=inputs.run, run_id=inputs.run_id, node_rank=rank, host=host, **rendezvous,
            argv=torchrun_argv(launch.python, program.argv, node_rank=rank, **rendezvous), env=env, unset=unset,
            cwd=launch.cwd, log_path=str(paths.node_log(rank)), pid_path=str(paths.node_pid_file(rank)),
            engine=program.engine, resilience=params.training.resilience, pauses=pauses, checkpoint_bytes=one_checkpoint,
            initial_weights=initial,
            first_attempt=inputs.first_attempt, save_signal=program.save_signal,
            secret_names=tuple(sorted(launch.secrets)), resets_run_state=rank == 0,
            per_attempt={**PER_ATTEMPT, **(PER_ATTEMPT_ELASTIC if params.training.resilience.min_nodes else {})},
            resume_args=program.resume_args, checkpoint_choice=program.checkpoint_choice, hosts=tuple(launch.hosts),
            first_members=first_members, restart_exclude=launch.restart_exclude,
        ))
    runtime = RunRuntime(run=inputs.run, run_id=inputs.run_id, engine=program.engine, nnodes=launch.nnodes,
                         nproc_per_node=launch.nproc_per_node, hosts=tuple(launch.hosts), program_argv=tuple(program.argv),
                         gradient_accumulation_steps=inputs.geometry.accumulation_steps, program_env=dict(program.env))
    notes = [*program.notes, *([inputs.resume_note] if inputs.resume_note else []), *settled_notes]
    r = params.training.resilience
    if r.max_restarts and not params.training.save_interval:
        notes.append(f"MAX_RESTARTS={r.max_restarts} without checkpoints (training.save_interval is 0): a restart "
                     f"starts again from iteration 0, and the breaker ends the run after {r.attempts_without_progress} "
                     "attempts without a new checkpoint; set save_interval")
    if answers is None:
        notes.append("the nodes were not asked (no preflight): MASTER_PORT, the socket interfaces and the node-local "
                     "directories are what a start would settle, not what it will use")
    return StartPlan(run=inputs.run, run_id=inputs.run_id, resolved=ResolvedRun(params, runtime), geometry=inputs.geometry,
                     nodes=tuple(node_plans), resume_from=inputs.resume_from, program=program, python=launch.python, cwd=launch.cwd,
                     notes=tuple(notes), first_attempt=inputs.first_attempt,
                     steps=plan_steps(launch, inputs, program), settled=answers is not None, master_port=launch.master_port)
