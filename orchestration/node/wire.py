"""The contract between the launcher and a node: the node's plan, every node command's request as
the launcher sends it, every answer, and their encoding. The launcher imports this module (and the
run-state readers) from ``orchestration/node``, nothing else; the node side reads the same
definitions.

    python -m orchestration node-status --request '{"target": {"run": "demo", "node_rank": 1, "host": "node1",
        "artifact_root": "/shared/runs"}}'

A :class:`NodePlan` is everything one node runs for a start (``DRY_RUN=1`` prints it, the node's
supervisor executes it): the torchrun argv, every variable torchrun and the ranks get from the
launcher and the supervisor (per-attempt ones as attempt 1 sees them, with the rule for later
attempts in :attr:`NodePlan.per_attempt`), the names of the secret variables but never their
values, which travel as one JSON line on the node command's standard input
(:func:`encode_secrets` / :func:`decode_secrets`). Every node command takes one typed request
(the plan for ``node-start``, a :class:`StatusRequest`, ...: each type names its command once, in
``command``) as one JSON argument, written by :func:`node_call` and read back by :func:`decode_request`
with the project's one converter (megatron_ext/run_spec/convert.py); this machine's commands get the same
request in the launcher's own process. Every node command prints one JSON line: one of the answer
dataclasses below (:func:`encode_payload`, read back typed with :func:`decode_payload`) or
``{"error": ...}``. Pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, NamedTuple, Sequence, TypeVar

from megatron_ext.run_spec.convert import structure, unstructure
from megatron_ext.run_spec.engines import MEGATRON_CORE
from megatron_ext.run_spec.python_version import PythonRequirement
from megatron_ext.run_spec.resilience import ATTEMPT_ENV, ResilienceParams, PauseSchedule
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.node.resume_point import ResumePoint
from orchestration.node.run_state import RunState

MEMBERSHIP_RULE = ("the nodes of the attempt: every node, or, after a node is lost, the nodes left (at least "
                   "training.resilience.min_nodes), ranked in the order of the hosts")
RUN_TAG = "LAUNCHER_RUN"
ARTIFACT_ROOT_ENV = "ARTIFACT_ROOT"
"""Every process of a run carries its artifact root too: two runs of one name under two roots are two runs."""
RUN_ID_TAG = "LAUNCHER_RUN_ID"
NODE_TAG = "LAUNCHER_NODE_RANK"
DEFAULT_STOP_GRACE_S = 40.0
"""torchrun forwards SIGTERM to its workers and waits 30 s before SIGKILL; allow for that."""
SUPERVISE_COMMAND = "node-supervise"
TokenizerFile = NamedTuple("TokenizerFile", [("kind", str), ("path", str)])
"""A tokenizer every node must load (:attr:`CheckRequest.tokenizer`): data.tokenizer's type and model path, a list on the wire."""


def node_label(node_rank: int, host: str) -> str:
    """How every line about a node starts: ``[node1 g0034]``."""
    return f"[node{node_rank} {host}]"


def torchrun_argv(python: str, program: Sequence[str], *, nnodes: int, node_rank: int, nproc_per_node: int, master_addr: str,
                  master_port: int) -> tuple[str, ...]:
    """torchrun with a fixed node rank (static rendezvous: stable ranks) running ``program``
    (``-m megatron_ext.pretrain ...`` or ``pretrain_gpt.py ...``, see orchestration/megatron_lm/program.py)."""
    return (python, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc-per-node",
            str(nproc_per_node), "--master-addr", master_addr, "--master-port", str(master_port), *program)


@dataclass(frozen=True)
class CheckpointChoice:
    """Megatron-LM's: node 0 picks each attempt's checkpoint and every node names it
    (orchestration/node/resume_point.py)."""

    step_flag: str = "--ckpt-step"
    integrity_args: tuple[str, ...] = ()
    """``--verify-integrity`` where the checkout has it and the stage saves torch_dist."""
    init_checkpoint: str = ""
    """training.init_checkpoint: what an attempt without a checkpoint of the run's own loads."""


@dataclass(frozen=True, kw_only=True)
class NodePlan:
    """One node's part of a start: everything the node side needs, nothing it works out again."""

    command: ClassVar[str] = "node-start"
    run: str
    run_id: str
    node_rank: int
    host: str
    nnodes: int
    """The nodes of the start (an attempt may run on fewer: :meth:`attempt_argv`)."""
    nproc_per_node: int
    master_addr: str
    master_port: int
    """torchrun's rendezvous (node 0's supervisor keeps the run's coordination store one above)."""
    argv: tuple[str, ...]
    """The torchrun command this node runs (:func:`torchrun_argv` of the fields above and the program)."""
    env: dict[str, str]
    """Every variable set for torchrun and the ranks on this node, on top of the node's own
    environment: the launcher's, the forwarded ones, the program's, the run tags, and the
    supervisor's (the attempt, the progress directory, the flight recorder), with attempt 1's values."""
    unset: tuple[str, ...]
    """Variables removed from the node's own environment (e.g. CUDA_DEVICE_MAX_CONNECTIONS for
    Megatron-FSDP)."""
    cwd: str
    log_path: str
    pid_path: str
    engine: str = MEGATRON_CORE.name
    """Which program the ranks run: this project's (progress files) or Megatron-LM's (log lines)."""
    resilience: ResilienceParams = field(default_factory=ResilienceParams)
    """The watchdog's limits, the restarts."""
    pauses: PauseSchedule | None = None
    """When the run pauses between its iteration lines by itself (saves, validation passes; None:
    neither): the Megatron-LM log watch's limits between two lines."""
    checkpoint_bytes: int = 0
    """One checkpoint of the run, estimated from the model (model_size.py ``checkpoint_bytes``; 0:
    unknown): the save limit of an attempt with nothing on disk to measure."""
    initial_weights: str = ""
    """What an attempt without a checkpoint of the run's own loads first (training.init_checkpoint, or
    the Hugging Face directory with training.init: pretrained; empty: nothing): the setup limit
    allows for its size on disk."""
    first_attempt: int = 1
    """The attempt this start begins with (a requeued Slurm job continues the count)."""
    save_signal: str = "SIGUSR1"
    """What the supervisor sends each rank to save and end: SIGUSR1, or SIGTERM for a Megatron-LM
    checkout without ``--exit-signal``."""
    secret_names: tuple[str, ...] = ()
    """Variables every process of the run gets whose values are secrets (WANDB_API_KEY, HF_TOKEN,
    ...): names only. The values reach ``node-start`` on its standard input (srun: the step's
    inherited environment) and go from there into the supervisor's environment, never into this plan."""
    per_attempt: dict[str, str] = field(default_factory=dict)
    """Variables of :attr:`env` whose value changes with each attempt -> the rule (``env`` holds attempt 1's)."""
    resets_run_state: bool = False
    """This node clears the run's failure and attempt files before its supervisor starts (node 0
    of a start; the ledger is kept when :attr:`first_attempt` > 1, a requeued batch job)."""
    hosts: tuple[str, ...] = ()
    """Every node's host, by node rank (how the supervisors name a lost node)."""
    resume_args: tuple[str, ...] = ()
    """Appended to :attr:`argv` for an attempt that starts with a checkpoint in the run's folder
    (Megatron-LM's ``--load``, which must be absent while there is none)."""
    first_members: tuple[int, ...] = ()
    """The nodes of the first attempt (empty: every node): a start with NNODES=MIN:MAX leaves out
    the nodes its preflight refused, while enough are left (``rejoin`` brings one back)."""
    checkpoint_choice: CheckpointChoice | None = None
    """Megatron-LM: node 0 picks each attempt's checkpoint (None: the ranks do, this program's)."""
    rejoin: bool = False
    """This node comes back to the run going on without it (NNODES=MIN:MAX; ``rejoin``): its
    supervisor asks node 0 for a place and waits, ``joining``, for the next restart, instead of
    starting an attempt of its own."""
    restart_exclude: bool = True
    """Node 0 leaves out of the next attempt a node the evidence names (NNODES=MIN:MAX:
    orchestration/node/exclusion.py); RESTART_EXCLUDE=0: every restart keeps every node."""

    def attempt_argv(self, has_checkpoint: bool, members: Sequence[int] | None = None,
                     point: ResumePoint | None = None) -> tuple[str, ...]:
        """The torchrun command of an attempt: :attr:`argv` rendered for the nodes ``members`` (default
        all: --nnodes their count, --node-rank this node's place among them), plus :attr:`resume_args`
        once there is a checkpoint, plus what :attr:`checkpoint_choice` makes of node 0's ``point``."""
        members = range(self.nnodes) if members is None else list(members)
        head = dict(python=self.argv[0], nproc_per_node=self.nproc_per_node, master_addr=self.master_addr, master_port=self.master_port)
        program = self.argv[len(torchrun_argv(program=(), nnodes=self.nnodes, node_rank=self.node_rank, **head)):]
        argv = list(torchrun_argv(program=program, nnodes=len(members), node_rank=members.index(self.node_rank), **head))
        if has_checkpoint:
            argv += self.resume_args
        choice = self.checkpoint_choice
        if choice is not None and point is not None:
            argv += [choice.step_flag, str(point.iteration)] if point.iteration is not None else []
            argv += choice.integrity_args if point.verify else ()
        return tuple(argv)

    def to_json(self) -> str:
        return json.dumps(unstructure(self))

    @classmethod
    def from_json(cls, text: str) -> "NodePlan":
        return decode_payload(cls, json.loads(text))

    @property
    def pid_file(self) -> Path:
        return Path(self.pid_path)

    @property
    def artifact_root(self) -> Path:
        return Path(self.env[ARTIFACT_ROOT_ENV])

    @property
    def target(self) -> NodeTarget:
        return NodeTarget(self.run, self.node_rank, self.host, self.artifact_root)

    def process_environment(self, node_env: Mapping[str, str], attempt: int | None = None,
                            members: Sequence[int] | None = None) -> dict[str, str]:
        """The environment of torchrun on the node for ``attempt`` (default the first) on the nodes
        ``members`` (default all): the node's own, less ``unset``, plus ``env`` with that attempt's
        values (:attr:`per_attempt`)."""
        env = {**{k: v for k, v in node_env.items() if k not in self.unset}, **self.env}
        if attempt is not None and ATTEMPT_ENV in self.per_attempt:
            env[ATTEMPT_ENV] = str(attempt)
        if members is not None:
            env.update(NNODES=str(len(members)), NODE_RANK=str(list(members).index(self.node_rank)))
        return env


# -- node commands, as the launcher sends them -------------------------------------------------
#
# One typed request per node command, sent as one JSON argument (``--request``) and read back on
# the node with the same converter (megatron_ext/run_spec/convert.py): written once, here.

@dataclass(frozen=True)
class NodeTarget:
    """The run and the node a command is about (every command but ``node-start``, whose plan says)."""

    run: str
    node_rank: int
    host: str
    artifact_root: Path

    @property
    def paths(self) -> RunPaths:
        return RunPaths(self.artifact_root, self.run)


@dataclass(frozen=True)
class StatusRequest:
    """``node-status``."""

    command: ClassVar[str] = "node-status"
    target: NodeTarget
    seq_length: int | None = None
    """Tokens per sequence, for tokens/s."""
    by_heartbeat: bool = False
    """Answered from another machine that shares the files (alive = the node's supervisor's
    heartbeat record is there, its exit record not), not from the node's process table."""
    run_id: str | None = None
    """With ``by_heartbeat``: the start whose records count (its resolved run id); an earlier
    start's heartbeat and exit records, still there or seen late, are not this start's."""


@dataclass(frozen=True)
class StopRequest:
    """``node-stop``."""

    command: ClassVar[str] = "node-stop"
    target: NodeTarget
    grace_s: float
    """After SIGTERM to torchrun's group, how long before the sweep of what is left."""
    dry_run: bool = False
    """Say what would be signalled (a :class:`StopPreview`), signal nothing."""


@dataclass(frozen=True)
class SaveRequest:
    """``node-save``: the node's supervisor asked (SIGUSR1) to have every node save at the next
    step and end; it passes the request on over the board."""

    command: ClassVar[str] = "node-save"
    target: NodeTarget


@dataclass(frozen=True)
class CheckpointSpace:
    """Where a run's checkpoints go and what they take: the free space there is checked."""

    directory: str
    parameters: int
    """The model's parameters (a checkpoint's size)."""
    keep: int
    """Checkpoints kept on disk (training.keep_checkpoints): with the one being written, keep + 1 must fit."""
    zero_stage: int = 0
    """The run's stage: what a checkpoint holds per parameter depends on it (run_spec/model_size.py)."""


@dataclass(frozen=True, kw_only=True)
class CheckRequest:
    """What ``node-check`` checks on every node of a start (the same for each)."""

    master_addr: str
    nproc_per_node: int
    nnodes: int
    """Nodes in the run: with more than one, node 0 also needs MASTER_PORT + 1 (the coordination store)."""
    shared_token: str | None = None
    """A file the launcher wrote under the artifact root: every node must see it."""
    required_paths: tuple[str, ...] = ()
    tokenizer: TokenizerFile | None = None
    required_modules: tuple[str, ...] = ()
    """Optional modules the run imports (wandb)."""
    needs_cuda: bool = False
    """The ranks need CUDA (Megatron-LM's pretrain_gpt.py): a node without GPUs checks that torch sees one
    in the ranks' environment."""
    checkpoints: CheckpointSpace | None = None
    """None: no checkpoints, or their size is not known."""
    fp8: str | None = None
    """training.fp8: every node checks transformer-engine and its GPUs' compute capability."""
    python: PythonRequirement | None = None
    """The Python the ranks' program needs (a Megatron-LM checkout's requires-python): every node checks
    its own interpreter against it."""


@dataclass(frozen=True)
class NodeCheckRequest:
    """``node-check``: one node's part of the preflight."""

    command: ClassVar[str] = "node-check"
    target: NodeTarget
    check: CheckRequest
    master_port: int | None = None
    """None: node 0 picks the first free port (MASTER_PORT unset); others: node 0 must answer there."""


@dataclass(frozen=True, kw_only=True)
class LinktestRequest:
    """``node-linktest``: this node's exchanges with its ring neighbours (all nodes at once)."""

    command: ClassVar[str] = "node-linktest"
    target: NodeTarget
    nnodes: int
    master_addr: str
    port: int
    backend: Literal["gloo", "nccl"]
    interface: str | None = None
    """The interface the ranks will get (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME); None: the node's own setting."""
    seconds: float | None = None
    """How long to keep exchanging (LINK_TEST_S); None: linktest.py's MEASURE_S."""


NODE_REQUESTS: dict[str, type] = {r.command: r for r in (NodePlan, NodeCheckRequest, StopRequest, SaveRequest, StatusRequest,
                                                         LinktestRequest)}
"""Each node command (but ``node-supervise`` and ``node-pod``, which read plan files) and its request."""
NODE_COMMANDS = (*NODE_REQUESTS, SUPERVISE_COMMAND, "node-pod")


@dataclass(frozen=True)
class NodeCall:
    """``python -m orchestration <command> --request JSON`` on one node, with ``stdin`` (secrets) written to it."""

    command: str
    request: str = field(repr=False)
    """The command's request (:data:`NODE_REQUESTS`) as JSON."""
    stdin: str | None = field(default=None, repr=False)
    """One line for the command's standard input (None: /dev/null); never shown."""

    @property
    def args(self) -> tuple[str, ...]:
        return ("--request", self.request)

    def argv(self, python: str) -> list[str]:
        return [python, "-m", "orchestration", self.command, *self.args]


def node_call(request: Any, stdin: str | None = None) -> NodeCall:
    """The node command of ``request`` (its type's ``command``) with the request as its JSON argument."""
    return NodeCall(request.command, json.dumps(unstructure(request)), stdin)


def start_call(plan: NodePlan, secrets: Mapping[str, str] | None = None) -> NodeCall:
    """``node-start`` with the node's plan as its request and the values of its ``secret_names``
    (taken from ``secrets``) on standard input."""
    wanted = {name: (secrets or {})[name] for name in plan.secret_names if name in (secrets or {})}
    return node_call(plan, encode_secrets(wanted) if plan.secret_names else None)


def encode_secrets(values: Mapping[str, str]) -> str:
    """The secrets' line on ``node-start``'s standard input."""
    return json.dumps({"secrets": dict(values)}) + "\n"


def decode_secrets(line: str, names: Sequence[str]) -> dict[str, str]:
    """The values of ``names`` from the secrets' line (empty line: none arrived); a ValueError
    (which names no value) for a line that is not one."""
    if not line.strip():
        return {}
    try:
        raw = json.loads(line)
    except json.JSONDecodeError:
        raise ValueError("the secrets' line on standard input is not JSON") from None
    values = raw.get("secrets") if isinstance(raw, dict) else None
    if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
        raise ValueError('the secrets\' line on standard input is not {"secrets": {NAME: VALUE}}')
    return {k: values[k] for k in names if k in values}


LINKTEST_TIMEOUT_S = 90.0
"""A node's link test: rendezvous, the measurement and the teardown, at most (seconds)."""


def coordination_port(master_port: int) -> int:
    """Where node 0's supervisor keeps a multi-node run's coordination store (a TCPStore:
    orchestration/node/board.py): one above torchrun's MASTER_PORT."""
    return master_port + 1


def supervise_argv(python: str, plan_file: str) -> list[str]:
    """The node's supervisor for the plan in ``plan_file`` (``{node}`` = SLURM_NODEID under srun)."""
    return [python, "-m", "orchestration", SUPERVISE_COMMAND, "--plan-file", plan_file]


PACKED_PLANS = "plans.json.gz"
"""A Kubernetes run's plans when they would not fit one ConfigMap readable: every node's, a gzipped JSON list."""


def pod_argv(python: str, plan_dir: str) -> list[str]:
    """A Kubernetes pod's command: its node's supervisor for the plan ``plan_dir/node<JOB_COMPLETION_INDEX>.json``
    (or that entry of :data:`PACKED_PLANS`: orchestration/node/pod.py)."""
    return [python, "-m", "orchestration", "node-pod", "--plan-dir", plan_dir]


def decode_request(command: str, text: str):
    """A node command's request from its JSON; a ValueError naming what does not fit."""
    try:
        return structure(NODE_REQUESTS[command], json.loads(text))
    except ValueError as exc:  # not JSON, or a value that does not fit
        raise ValueError(f"{command}'s request is not a {NODE_REQUESTS[command].__name__} ({exc})") from None


# -- the answers ------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class NodeStarted:
    """``node-start``'s answer: the node's torchrun runs."""

    node_rank: int
    host: str
    pid: int
    pgid: int
    supervisor_pid: int
    log: str
    run_id: str


@dataclass(frozen=True, kw_only=True)
class NodeStatus:
    """``node-status``'s answer."""

    node_rank: int
    host: str
    alive: bool
    state: RunState
    exit: str | None
    """How the node's run ended, as its supervisor recorded it."""
    run_failure: str | None
    """The run's failure file's first line (node 0 writes it: the first failure the board holds)."""
    pid: int | None
    last_iteration: int | None
    train_iters: int | None
    tokens_per_s: float | None
    last_line: str
    log: str
    attempt: int | None = None
    """The supervisor's current (or last) attempt."""
    failure_reason: str | None = None
    """Once the node's run ended failed: the most telling line of its log (node/failure.py)."""
    failure_score: int = 0
    """How telling that line is (a rank's exception beats torchrun's summary beats the last line)."""
    slow_ranks: str | None = None
    """The latest attempt's slow-rank warning in the node's log, while it stands (rank 0's node)."""
    beat: int | None = None
    """The counter of the supervisor's heartbeat record: one more at every write, every 2 s while
    the supervisor lives. Two statuses a while apart that show the same number: it has stopped."""


@dataclass(frozen=True, kw_only=True)
class StopResult:
    """What a stop did on one node (``node-stop``'s answer)."""

    node_rank: int
    host: str
    was_running: bool
    """The recorded process was alive and ours."""
    signalled_group: int | None
    """The process group SIGTERMed (None: only torchrun, or nothing)."""
    swept: list[int] = field(default_factory=list)
    """Leftover tagged processes SIGTERMed after the grace."""
    killed: list[int] = field(default_factory=list)
    """Those SIGKILLed after a few seconds more."""
    left: list[int] = field(default_factory=list)
    """Still alive after all that."""

    @property
    def ok(self) -> bool:
        return not self.left


@dataclass(frozen=True)
class SaveAsked:
    """What ``node-save`` did on one node."""

    node_rank: int
    host: str
    supervisor_pid: int | None
    """The node's supervisor signalled (SIGUSR1), or None: none of the run's runs there."""

    @property
    def ok(self) -> bool:
        return self.supervisor_pid is not None


@dataclass(frozen=True, kw_only=True)
class StopPreview:
    """What a stop would signal on one node (``node-stop --dry-run``'s answer); signals nothing."""

    node_rank: int
    host: str
    recorded_pid: int | None
    """torchrun's pid from the pid file (None: no pid file)."""
    recorded_alive: bool
    """That process still runs and is the one started (start time and run id)."""
    group: int | None
    """The process group a stop would SIGTERM (only when the recorded process is alive)."""
    tagged: list[int] = field(default_factory=list)
    """Every live process carrying the run's and node's tags: what the sweep after the grace would reach."""
    grace_s: float = DEFAULT_STOP_GRACE_S


@dataclass(kw_only=True)
class NodeReport:
    """``node-check``'s answer: every problem this node has, and the facts a plan settles on."""

    node_rank: int
    host: str
    problems: list[str] = field(default_factory=list)
    software: dict[str, str | None] = field(default_factory=dict)
    """python, torch, megatron-core, transformer-engine, apex, project (git revision): None = absent."""
    interface: str | None = None
    """The interface that routes to MASTER_ADDR here."""
    master_address: str | None = None
    """The IPv4 address MASTER_ADDR resolves to here (None: it does not resolve)."""
    free_port: int | None = None
    """Node 0 with MASTER_PORT unset: the first free port from 6000."""
    local_dir: str | None = None
    """A node-local directory (tmpfs where there is one) for the ranks' progress files."""
    visible_gpus: int = 0
    notes: list[str] = field(default_factory=list)
    """Checks that could not run here, and why (no problem, but no all-clear either)."""


@dataclass(kw_only=True)
class LinkReport:
    """``node-linktest``'s answer: this node's exchanges with its ring neighbours."""

    node_rank: int
    host: str
    rates_gbs: dict[str, float] = field(default_factory=dict)
    """Neighbour node rank (as text) -> GB/s of the exchange with it (both directions at once)."""
    transport: str = ""
    """gloo's TCP, or what NCCL chose (NET/IB, NET/Socket, P2P): empty when unknown."""
    seconds: float = 0.0
    """The measurement's wall time on this node, rendezvous included."""
    error: str | None = None
    allreduce_s: dict[str, float] = field(default_factory=dict)
    """NCCL: neighbour node rank (as text) -> seconds of one 256 MB all-reduce in the pair's own
    group; empty on gloo (skipped)."""



# -- encoding ---------------------------------------------------------------------------------------

T = TypeVar("T")


def encode_payload(payload: Any) -> str:
    """One JSON line of a payload dataclass (megatron_ext/run_spec/convert.py: enums as their values)."""
    return json.dumps(unstructure(payload))


def encode_error(message: str) -> str:
    """The JSON line of a node command that could not do its work."""
    return json.dumps({"error": message})


def decode_payload(cls: type[T], raw: Mapping[str, Any]) -> T:
    """A payload dataclass from its JSON object (unknown keys dropped, enums and tuples restored:
    megatron_ext/run_spec/convert.py)."""
    return structure(cls, raw)
