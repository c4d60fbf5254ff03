"""A run handed to a Kubernetes cluster as a JobSet (or a Kubeflow Trainer v2 TrainJob): plan, then
apply; its status and stop through kubectl.

    DRY_RUN=1 bash training_scripts/submit_training.sh gpt_smoke smoke demo --kubernetes --image reg/launcher:1 \\
        --volume-claim runs --nodes 2                      # the manifest, printed; nothing applied or written
    bash training_scripts/submit_training.sh ... --kubernetes ... --apply    # kubectl apply -f -

:func:`plan_kubernetes` checks everything a start would (parameters at the pods' world size, a
checkpoint it would resume, the artifact root it writes) and plans every node as a start does,
with the pods' stable names as hosts (no preflight: the pods do not exist until the JobSet is
applied), then renders those same node plans as the manifest (orchestration/cluster/kubernetes.py).
:func:`apply_kubernetes` runs the start's steps that are not the nodes' start (the parameters file
beside the logs; a Megatron-LM start's data and checks) and ``kubectl apply -f -`` with the
manifest, and the run's Secret first, on its standard input; it records the submission, which
``status`` and ``stop`` then use. The artifact root is one path that every pod (the volume claim,
mounted there) and this machine see, as on Slurm. Side effects: ``apply_kubernetes``,
:func:`stop_submission` and :func:`kubectl_view` only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_ext.run_spec.errors import Outcome, UserError
from megatron_ext.run_spec.resolved import read_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.cluster import kubernetes as kube
from orchestration.cluster.backends import statuses_from_records
from orchestration.launch_env import LaunchEnv
from orchestration.node.run_state import read_ledger
from orchestration.runner.control import StatusReport
from orchestration.runner.start_plan import StartInputs, StartNodes, StartPlan, Started, plan_start, read_start_inputs

NO_PREFLIGHT = "the nodes were not asked (no preflight)"
PODS_NOTE = ("no preflight: the pods do not exist before the manifest is applied; each pod has a network of its own, "
             "so MASTER_PORT {port} is free there, and the interface that routes to MASTER_ADDR is the pod's")


@dataclass(frozen=True, kw_only=True)
class KubernetesPlan:
    """A Kubernetes submission planned: the start's node plans and the manifest made of them."""

    launch: LaunchEnv
    """The pods' view: NNODES pods, their stable names as hosts, the image's python and directory."""
    request: kube.KubernetesRequest
    inputs: StartInputs
    plan: StartPlan
    manifest: kube.Manifest
    notes: tuple[str, ...] = ()


def pods_launch(launch: LaunchEnv, nodes: int, gpus_per_node: int | None, name: str, python: str | None,
                workdir: str | None) -> LaunchEnv:
    """The launch a start on the pods would see: the pods' stable names as hosts (node 0's is
    MASTER_ADDR), GPUs per pod as processes per node (else NPROC_PER_NODE), the image's python and
    working directory, and the forwarded variables less those of this machine's installation."""
    hosts = tuple(kube.pod_address(name, i) for i in range(nodes))
    return dataclasses.replace(
        launch, nnodes=nodes, nproc_per_node=gpus_per_node or launch.nproc_per_node, hosts=hosts, master_addr=hosts[0],
        hosts_explicit=False, use_srun=False, container_name=None, ssh_opts=(), visible_gpus=gpus_per_node or 0,
        node_rank=0, python=python or launch.python, cwd=workdir or launch.cwd,
        forwarded={k: v for k, v in launch.forwarded.items() if k not in kube.MACHINE_VARIABLES})


def check_launch(launch: LaunchEnv, nodes: int | None) -> int:
    """The nodes of a Kubernetes run (``--nodes``, else NNODES): a UserError where the launcher's
    environment says otherwise (HOSTS, NNODES=MIN:MAX, an NNODES that is not ``--nodes``)."""
    given = launch.environ.get("NNODES", "").strip()
    if launch.hosts_explicit:
        raise UserError("HOSTS/HOSTFILE name machines for ssh; a Kubernetes run's nodes are its pods: unset HOSTS and "
                        "HOSTFILE, and give the number of pods with --nodes")
    if launch.min_nodes is not None:
        raise UserError(f"NNODES={given}: a Kubernetes run has a fixed number of pods (a pod that fails fails its Job, "
                        "and JobSet restarts every pod); give one number, --nodes N")
    if nodes is not None and given and int(given) != nodes:
        raise UserError(f"NNODES={given} but --nodes {nodes}: give the number of pods once (unset NNODES, or drop --nodes)")
    count = nodes or launch.nnodes
    if count < 1:
        raise UserError(f"--nodes {count} must be at least 1")
    return count


def plan_kubernetes(launch: LaunchEnv, model: str, data: str, run: str, request: kube.KubernetesRequest,
                    nodes: int | None = None, python: str | None = None, workdir: str | None = None,
                    apply: bool = False) -> KubernetesPlan:
    """Every check first (one UserError, nothing written); then the start's plan on the pods and
    the manifest of it. Reads files (and, with ``apply``, asks kubectl whether the run is there already)."""
    count = check_launch(launch, nodes)
    kube.check_request(request)
    name = kube.resource_name(run, count)
    if apply:
        kube.find_kubectl(launch.environ.get("PATH"))
    pods = pods_launch(launch, count, request.gpus_per_node or None, name, python, workdir)
    inputs = read_start_inputs(pods, model, data, run, list(enumerate(pods.hosts)))
    plan = plan_start(pods, inputs)
    manifest = kube.render_manifest(request, run, plan.nodes, pods.python)
    if apply:
        check_not_running(launch, run)
    notes = [n for n in plan.notes if not n.startswith(NO_PREFLIGHT)] + [PODS_NOTE.format(port=plan.master_port)]
    if manifest.secret_name:
        notes.append(f"the secret variable(s) {', '.join(manifest.secret_keys)} reach the pods from the Secret "
                     f"{manifest.secret_name} (secretKeyRef); --apply applies it first from this environment (never printed)")
    return KubernetesPlan(launch=pods, request=request, inputs=inputs, plan=plan, manifest=manifest, notes=tuple(notes))


def check_not_running(launch: LaunchEnv, run: str) -> None:
    submitted = kube.recorded_submission(RunPaths(launch.artifact_root, run))
    if submitted is None:
        return
    argv = kube.status_argvs(submitted)[0][:-2] + ["-o", "name"]
    if kube.run_kubectl(argv, launch.environ).returncode == 0:
        raise UserError(f"run {run!r} is already submitted as {kube.describe(submitted)}; stop it first "
                        f"(stop_multinode_training.sh {run}) or choose another RUN name")


def apply_kubernetes(launch: LaunchEnv, planned: KubernetesPlan) -> tuple[kube.Submission, tuple[str, ...]]:
    """The start's steps but the nodes' start (here, on the shared artifact root), then ``kubectl
    apply -f -`` (the Secret first, from this environment); the recorded submission and the steps' notes."""
    started = Started(launch=planned.launch, plan=planned.plan, inputs=planned.inputs, data_ready=planned.inputs.data_ready)
    notes = tuple(n for step in planned.plan.steps if not isinstance(step, StartNodes) for n in step.run(started))
    manifest = planned.manifest
    documents = manifest.documents
    if manifest.secret_name:  # the plans name the secrets this environment holds (launch_env.py)
        documents = (kube.secret_document(manifest, launch.secrets), *documents)
    proc = kube.run_kubectl(["kubectl", "apply", "-f", "-"], launch.environ, stdin=kube.render_yaml(documents))
    if proc.returncode:
        raise UserError(f"kubectl apply refused the manifest: {(proc.stderr or proc.stdout).strip()}; nothing was started "
                        "(the run's parameters file is written: a submit again replaces it)")
    paths = RunPaths(launch.artifact_root, planned.plan.run)
    return kube.record_submission(paths, manifest, planned.request.termination_grace_s), notes


# -- status, stop -----------------------------------------------------------------------------------

def submission_of(launch: LaunchEnv, run: str, only_this_node: bool) -> kube.Submission | None:
    """The Kubernetes submission recorded for ``run`` (None: not submitted there, or HOSTS given)."""
    if only_this_node or launch.hosts_explicit:
        return None
    return kube.recorded_submission(RunPaths(launch.artifact_root, run))


def kubectl_view(launch: LaunchEnv, submission: kube.Submission) -> list[str]:
    """What kubectl says of the run's JobSet and pods (lines), or why it could not be asked."""
    lines = []
    for argv in kube.status_argvs(submission):
        try:
            proc = kube.run_kubectl(argv, launch.environ, timeout_s=60)
        except UserError as exc:
            return [f"({exc})"]
        lines += [f"$ {' '.join(argv)}", *(proc.stdout or proc.stderr).rstrip().splitlines()]
    return lines


def collect_status(launch: LaunchEnv, run: str) -> StatusReport:
    """Every node as its records on the shared artifact root show it (the pods write them there), and the ledger."""
    paths = RunPaths(launch.artifact_root, run)
    resolved = read_resolved(paths.params_path)
    hosts = resolved.runtime.hosts if resolved else ()
    seq = resolved.params.training.seq_length if resolved else None
    return StatusReport(run=run, nodes=tuple(statuses_from_records(launch, run, list(enumerate(hosts)), seq)),
                        attempts=tuple(read_ledger(paths)))


@dataclass(frozen=True)
class KubernetesStop(Outcome):
    submission: kube.Submission
    argv: tuple[str, ...]
    dry_run: bool
    returncode: int = 0
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.dry_run or self.returncode == 0


def stop_submission(launch: LaunchEnv, submission: kube.Submission, dry_run: bool) -> KubernetesStop:
    """``kubectl delete`` of the run's JobSet (or TrainJob) and its plans, waited for: every pod gets
    SIGTERM, its node saves at the next step (stop --save) and the pod ends within its grace."""
    argv = kube.delete_argv(submission)
    if dry_run:
        return KubernetesStop(submission, tuple(argv), True)
    proc = kube.run_kubectl(argv, launch.environ, timeout_s=submission.grace_s + kube.DELETE_SLACK_S + 30)
    return KubernetesStop(submission, tuple(argv), False, proc.returncode, (proc.stdout + proc.stderr).strip())
