"""Kubernetes: a run as a JobSet (or a Kubeflow Trainer v2 TrainJob), rendered from the start's
node plans, and the kubectl commands that apply, watch and delete it.

    DRY_RUN=1 bash training_scripts/submit_training.sh gpt_smoke smoke demo --kubernetes --image reg/launcher:1 \\
        --volume-claim runs --nodes 2

A run is one replicated job of ``NNODES`` pods (an Indexed Job, ``parallelism = completions =
NNODES``, ``backoffLimit: 0``, pods ``restartPolicy: Never``): pod ``i`` is node ``i``
(``JOB_COMPLETION_INDEX``), named ``<name>-node-0-<i>`` under the headless service ``<name>``
that JobSet makes, so that ``<name>-node-0-0.<name>`` is MASTER_ADDR. Each pod's container runs
``node-pod`` (orchestration/node/pod.py) with the plans of every node in a ConfigMap: the pod
picks its own plan by its index and runs that node's supervisor with it, exactly as ``node-start``
does over ssh. The project's supervisor restarts in place; ``failurePolicy.maxRestarts`` is the
outer budget (a pod that ended failed fails its Job and JobSet recreates every pod). Pure, but
for :func:`run_kubectl` and the submission record (:func:`record_submission`).
"""

from __future__ import annotations

import base64
import gzip
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from megatron_ext.host.json_files import read_json, write_json_atomic
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.node.wire import (NODE_TAG, PACKED_PLANS, RUN_ID_TAG, RUN_TAG, NodePlan, coordination_port, decode_payload,
                                     pod_argv)

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
REPLICATED_JOB = "node"
"""The replicated job's name, and the container's: Kubeflow Trainer's torch runtimes call theirs
``node`` too, so a TrainJob's pods get the same stable names as the JobSet's."""
PLAN_MOUNT = "/etc/megatron-launcher/plan"
"""Where each pod sees the ConfigMap of the nodes' plans (``node<i>.json``)."""
RUN_LABEL = "megatron-launcher/run"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
"""The pod annotation that holds its index in an Indexed Job (the Job controller also sets
JOB_COMPLETION_INDEX from it)."""
CONFIGMAP_LIMIT_BYTES = 1024 * 1024
CONFIGMAP_ROOM_BYTES = 4096
"""Left of a ConfigMap's 1 MiB for its metadata."""
GPU_RESOURCE = "nvidia.com/gpu"
CAPABILITIES = ("IPC_LOCK", "SYS_PTRACE")
"""IPC_LOCK: pinned memory for RDMA (NCCL over InfiniBand / RoCE); SYS_PTRACE: the watchdog's
py-spy stack dumps of a hung rank."""
DEFAULT_TERMINATION_GRACE_S = 300
DEFAULT_MAX_RESTARTS = 3
DELETE_SLACK_S = 60
"""A stop waits this long beyond the pods' grace for kubectl's delete to finish."""
MACHINE_VARIABLES = ("PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE",
                     "CUDA_VISIBLE_DEVICES")
"""Forwarded variables that describe the submitting machine's installation or devices, not the
run: the image's own (and the device plugin's) hold in a pod."""
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_RESOURCE = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


@dataclass(frozen=True, kw_only=True)
class KubernetesRequest:
    """What a Kubernetes submission asks of the cluster (``submit --kubernetes`` options)."""

    image: str
    """The container image: this project, its Python and torch, at ``workdir``."""
    volume_claim: str
    """A ReadWriteMany PersistentVolumeClaim mounted at ARTIFACT_ROOT in every pod (logs, run
    state, checkpoints: the shared file system a run needs)."""
    namespace: str | None = None
    """None: the namespace of kubectl's context."""
    queue: str | None = None
    """Kueue's LocalQueue (the ``kueue.x-k8s.io/queue-name`` label): quota, all-or-nothing admission."""
    gpus_per_node: int = 0
    """``nvidia.com/gpu`` per pod (0: a CPU run)."""
    rdma_resource: tuple[str, int] | None = None
    """(resource name, count) of an RDMA device plugin's resource, e.g. (``rdma/ib``, 1)."""
    max_restarts: int = DEFAULT_MAX_RESTARTS
    """JobSet's ``failurePolicy.maxRestarts``: recreations of every pod after a pod ended failed
    (the project's supervisor has restarted in place first, MAX_RESTARTS times)."""
    termination_grace_s: int = DEFAULT_TERMINATION_GRACE_S
    """``terminationGracePeriodSeconds``: SIGTERM (a deletion, a preemption) asks every rank to save
    at its next step; the kubelet SIGKILLs what is left after this long."""
    shm_size: str | None = None
    """sizeLimit of the memory-backed ``/dev/shm`` (None: no limit but the pod's memory)."""
    exclusive_topology: str | None = None
    """A node label (e.g. ``cloud.google.com/gke-nodepool``, ``topology.kubernetes.io/zone``): every
    pod in one domain of it, no other JobSet there."""
    secret_name: str | None = None
    """The Secret holding the run's secret variables (each a key of it); None: ``<name>-secrets``."""
    trainjob: str | None = None
    """Render a Kubeflow Trainer v2 TrainJob on this ClusterTrainingRuntime instead of a JobSet."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What ``submit --kubernetes`` applies: the ConfigMap of the plans, then the JobSet (or TrainJob)."""

    name: str
    namespace: str | None
    kind: str
    documents: tuple[dict, ...]
    secret_name: str | None = None
    """The Secret the pods read the run's secret variables from (None: the run has none)."""
    secret_keys: tuple[str, ...] = ()

    @property
    def workload(self) -> dict:
        return self.documents[-1]

    def to_yaml(self) -> str:
        return render_yaml(self.documents)


def render_yaml(documents: Sequence[Mapping]) -> str:
    """Documents as one YAML stream (``---`` between), keys in the order they were built."""
    return "---\n".join(yaml.safe_dump(dict(d), sort_keys=False, width=1000) for d in documents)


def resource_name(run: str, nnodes: int) -> str:
    """The JobSet's name from the run's: lower case, ``_`` and ``.`` as ``-``; a UserError where it
    cannot be a DNS label or its pods' host names would pass 63 characters."""
    name = re.sub(r"-+", "-", re.sub(r"[._]", "-", run.lower())).strip("-")
    longest = pod_hostname(name, nnodes - 1)
    if not _DNS_LABEL.match(name) or len(longest) > 63:
        raise UserError(f"run {run!r} gives the Kubernetes name {name!r}, whose pods would be named like {longest!r}: a "
                        "host name must start with a letter and be at most 63 characters; choose a shorter RUN name "
                        "that starts with a letter")
    return name


def pod_hostname(name: str, index: int) -> str:
    """The host name of pod ``index`` (JobSet: ``<jobset>-<replicated job>-<job index>-<pod index>``)."""
    return f"{name}-{REPLICATED_JOB}-0-{index}"


def pod_address(name: str, index: int) -> str:
    """Pod ``index``'s stable name under the headless service (the JobSet's name): what every pod
    resolves through the cluster's DNS (namespace search path)."""
    return f"{pod_hostname(name, index)}.{name}"


def check_request(request: KubernetesRequest) -> None:
    """Every value the cluster would refuse, as one UserError before anything is rendered."""
    problems = []
    if not request.image.strip():
        problems.append("--image is empty: give the container image with this project (e.g. --image registry/launcher:1)")
    if request.namespace is not None and (not _DNS_LABEL.match(request.namespace) or len(request.namespace) > 63):
        problems.append(f"--namespace {request.namespace!r} is not a namespace name (lower-case letters, digits, '-')")
    if not request.volume_claim or not _DNS_SUBDOMAIN.match(request.volume_claim) or len(request.volume_claim) > 253:
        problems.append(f"--volume-claim {request.volume_claim!r} is not a PersistentVolumeClaim name (lower-case "
                        "letters, digits, '-', '.')")
    for flag, value in (("--queue", request.queue), ("--secret", request.secret_name), ("--trainjob", request.trainjob)):
        if value is not None and not _DNS_SUBDOMAIN.match(value):
            problems.append(f"{flag} {value!r} is not a Kubernetes name (lower-case letters, digits, '-', '.')")
    if request.rdma_resource and (not _RESOURCE.match(request.rdma_resource[0]) or request.rdma_resource[1] < 1):
        problems.append(f"--rdma {request.rdma_resource[0]}={request.rdma_resource[1]} is not RESOURCE=COUNT (e.g. rdma/ib=1)")
    if request.gpus_per_node < 0 or request.max_restarts < 0 or request.termination_grace_s < 1:
        problems.append("--gpus-per-node and --max-restarts must be >= 0, --termination-grace-s >= 1")
    if problems:
        raise UserError("; ".join(problems))


def parse_rdma(text: str | None) -> tuple[str, int] | None:
    """``--rdma RESOURCE=COUNT`` (``rdma/ib=1``; a bare RESOURCE means 1)."""
    if not text:
        return None
    name, _, count = text.partition("=")
    try:
        return name.strip(), int(count) if count else 1
    except ValueError:
        raise UserError(f"--rdma {text!r} is not RESOURCE=COUNT; e.g. --rdma rdma/ib=1") from None


def container_environment(plans: Sequence[NodePlan], secret_name: str | None) -> list[dict]:
    """The container's variables: NODE_RANK from the pod's completion index, every variable the
    plans give all nodes alike (MASTER_ADDR, MASTER_PORT, NNODES, the NCCL and forwarded ones, ...),
    and each secret by ``secretKeyRef`` (never a value). The run tags and the per-attempt variables
    are the plan's own: its supervisor takes them on (node/pod.py), with the node's per-node ones."""
    common = dict(plans[0].env)
    for plan in plans[1:]:
        common = {k: v for k, v in common.items() if plan.env.get(k) == v}
    tags = {RUN_TAG, RUN_ID_TAG, NODE_TAG, "NODE_RANK", *plans[0].per_attempt}
    env: list[dict] = [{"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}}]
    env += [{"name": k, "value": v} for k, v in sorted(common.items()) if k not in tags]
    env += [{"name": "COORDINATION_PORT", "value": str(coordination_port(plans[0].master_port))}]
    env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": k}}} for k in plans[0].secret_names]
    return env


def _metadata(name: str, namespace: str | None, **more: Any) -> dict:
    return {"name": name, **({"namespace": namespace} if namespace else {}), **{k: v for k, v in more.items() if v}}


def plan_config_map(name: str, namespace: str | None, run: str, plans: Sequence[NodePlan]) -> dict:
    """The nodes' plans, one readable ``node<i>.json`` each; where they would pass a ConfigMap's
    1 MiB (each plan names every node: about 180 nodes), all of them in one gzipped JSON list,
    ``binaryData`` ``plans.json.gz`` (node/pod.py reads either)."""
    metadata = _metadata(f"{name}-plan", namespace, labels={RUN_LABEL: run})
    data = {f"node{p.node_rank}.json": p.to_json() for p in plans}
    size = sum(len(k) + len(v.encode()) for k, v in data.items())
    if size <= CONFIGMAP_LIMIT_BYTES - CONFIGMAP_ROOM_BYTES:
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}
    packed = base64.b64encode(gzip.compress(("[" + ", ".join(data.values()) + "]").encode(), mtime=0)).decode()
    if len(packed) > CONFIGMAP_LIMIT_BYTES - CONFIGMAP_ROOM_BYTES:
        raise UserError(f"the {len(plans)} nodes' plans take {len(packed)} bytes even compressed, more than a ConfigMap "
                        f"holds ({CONFIGMAP_LIMIT_BYTES}); use fewer nodes per run")
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "binaryData": {PACKED_PLANS: packed}}


def pod_spec(request: KubernetesRequest, name: str, plans: Sequence[NodePlan], python: str, secret: str | None) -> dict:
    """The pod template's spec, alike for every pod: the node's supervisor with its plan (``secret``: the
    Secret of the run's secret variables), the devices, the volumes and SIGTERM's grace."""
    first = plans[0]
    port = first.master_port
    limits: dict[str, Any] = {}
    if request.gpus_per_node:
        limits[GPU_RESOURCE] = request.gpus_per_node
    if request.rdma_resource:
        limits[request.rdma_resource[0]] = request.rdma_resource[1]
    container = {
        "name": REPLICATED_JOB,
        "image": request.image,
        "workingDir": first.cwd,
        "command": pod_argv(python, PLAN_MOUNT),
        "env": container_environment(plans, secret),
        "ports": [{"name": "torchrun", "containerPort": port}, {"name": "coordination", "containerPort": coordination_port(port)}],
        "resources": {"limits": limits, "requests": dict(limits)} if limits else {},
        "securityContext": {"capabilities": {"add": list(CAPABILITIES)}},
        "volumeMounts": [{"name": "artifacts", "mountPath": str(first.artifact_root)},
                         {"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True}],
    }
    shm: dict[str, Any] = {"medium": "Memory", **({"sizeLimit": request.shm_size} if request.shm_size else {})}
    return {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": request.termination_grace_s,
        "containers": [container],
        "volumes": [{"name": "artifacts", "persistentVolumeClaim": {"claimName": request.volume_claim}},
                    {"name": "dshm", "emptyDir": shm},
                    {"name": "plan", "configMap": {"name": f"{name}-plan"}}],
    }


def render_manifest(request: KubernetesRequest, run: str, plans: Sequence[NodePlan], python: str) -> Manifest:
    """The documents ``kubectl apply`` gets for the start's node plans (node rank = pod index). Pure."""
    check_request(request)
    nnodes = len(plans)
    name = resource_name(run, nnodes)
    labels = {RUN_LABEL: run, **({QUEUE_LABEL: request.queue} if request.queue else {})}
    annotations = {EXCLUSIVE_TOPOLOGY: request.exclusive_topology} if request.exclusive_topology else {}
    metadata = _metadata(name, request.namespace, labels=labels, annotations=annotations)
    secret = (request.secret_name or f"{name}-secrets") if plans[0].secret_names else None
    spec = pod_spec(request, name, plans, python, secret)
    config = plan_config_map(name, request.namespace, run, plans)
    if request.trainjob:
        workload = render_trainjob(request, metadata, spec, nnodes)
    else:
        workload = {
            "apiVersion": JOBSET_API, "kind": "JobSet", "metadata": metadata,
            "spec": {
                "failurePolicy": {"maxRestarts": request.max_restarts},
                "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
                "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
                "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": {
                    "completionMode": "Indexed", "parallelism": nnodes, "completions": nnodes, "backoffLimit": 0,
                    "template": {"metadata": {"labels": {RUN_LABEL: run}}, "spec": spec}}}}],
            },
        }
    return Manifest(name=name, namespace=request.namespace, kind=workload["kind"], documents=(config, workload),
                    secret_name=secret, secret_keys=tuple(plans[0].secret_names))


def render_trainjob(request: KubernetesRequest, metadata: dict, spec: dict, nnodes: int) -> dict:
    """A Kubeflow Trainer v2 TrainJob on the ClusterTrainingRuntime ``request.trainjob``: the trainer's
    image, command, variables and devices, and, as a runtime patch of its ``node`` job, the volumes,
    mounts, capabilities and grace (Trainer renders the JobSet; its PET_* variables go unused: the
    plan names the rendezvous)."""
    container = spec["containers"][0]
    resources = container["resources"]
    trainer = {"image": container["image"], "command": container["command"], "env": container["env"], "numNodes": nnodes,
               **({"resourcesPerNode": resources} if resources else {})}
    patch_container = {"name": REPLICATED_JOB, "volumeMounts": container["volumeMounts"],
                       "securityContext": container["securityContext"]}
    pod_patch = {"terminationGracePeriodSeconds": spec["terminationGracePeriodSeconds"], "volumes": spec["volumes"],
                 "containers": [patch_container]}
    job_patch = {"name": REPLICATED_JOB, "template": {"spec": {"template": {"spec": pod_patch}}}}
    return {"apiVersion": TRAINJOB_API, "kind": "TrainJob", "metadata": metadata,
            "spec": {"runtimeRef": {"name": request.trainjob, "kind": "ClusterTrainingRuntime", "apiGroup": "trainer.kubeflow.org"},
                     "trainer": trainer,
                     "runtimePatches": [{"manager": "megatron-launcher", "trainingRuntimeSpec": {
                         "template": {"spec": {"replicatedJobs": [job_patch]}}}}]}}


def secret_document(manifest: Manifest, values: Mapping[str, str]) -> dict:
    """The Secret with the run's secret variables (applied on kubectl's standard input, never printed)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _metadata(manifest.secret_name, manifest.namespace),
            "stringData": {k: values[k] for k in manifest.secret_keys}}


# -- kubectl ----------------------------------------------------------------------------------------

def _namespace(submission: "Submission") -> list[str]:
    return ["-n", submission.namespace] if submission.namespace else []


def status_argvs(submission: "Submission") -> list[list[str]]:
    """What ``status`` asks: the JobSet (or TrainJob) and its pods, where each runs."""
    ns = _namespace(submission)
    return [["kubectl", "get", submission.kind.lower(), submission.name, *ns, "-o", "wide"],
            ["kubectl", "get", "pods", *ns, "-l", f"{JOBSET_NAME_LABEL}={submission.name}", "-o", "wide"]]


def logs_argv(submission: "Submission", index: int) -> list[str]:
    """One pod's output (the node's log is on the share too: ``logs RUN``)."""
    return ["kubectl", "logs", *_namespace(submission), "-l",
            f"{JOBSET_NAME_LABEL}={submission.name},{COMPLETION_INDEX}={index}", "--tail", "50"]


def delete_argv(submission: "Submission") -> list[str]:
    """``stop``: the JobSet (or TrainJob) and the plans' ConfigMap deleted, waited for: every pod
    gets SIGTERM (its node saves at the next step: node/pod.py) and up to its grace to end."""
    return ["kubectl", "delete", *_namespace(submission), f"{submission.kind.lower()}/{submission.name}",
            f"configmap/{submission.name}-plan", "--ignore-not-found", "--cascade=foreground", "--wait=true",
            f"--timeout={submission.grace_s + DELETE_SLACK_S}s"]


def find_kubectl(path: str | None) -> str:
    """kubectl on ``path`` (the launcher's PATH), or the UserError that says it is missing."""
    found = shutil.which("kubectl", path=path)
    if not found:
        raise UserError("kubectl is not installed here (not on PATH); install it and point it at the cluster "
                        "(KUBECONFIG), or leave out --apply and pipe the printed manifest to kubectl apply -f - where it is")
    return found


def run_kubectl(argv: Sequence[str], env: Mapping[str, str], stdin: str | None = None,
                timeout_s: float = 120) -> subprocess.CompletedProcess:
    """One kubectl command (KUBECONFIG and the like from ``env``); a missing kubectl is a UserError."""
    find_kubectl(env.get("PATH"))
    return subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=timeout_s, env=dict(env))


# -- the submission record --------------------------------------------------------------------------

@dataclass(frozen=True)
class Submission:
    """A run applied to a cluster: which object, where (``status`` and ``stop`` go through kubectl)."""

    name: str
    namespace: str | None
    """None: kubectl's context's namespace."""
    kind: str
    grace_s: int = DEFAULT_TERMINATION_GRACE_S
    """The pods' terminationGracePeriodSeconds (how long a stop waits for their saves)."""
    submitted_at: float = 0.0


def submission_file(paths: RunPaths) -> Path:
    return paths.run_state_dir / f"{paths.run}.kubernetes.json"


def record_submission(paths: RunPaths, manifest: Manifest, grace_s: int) -> Submission:
    submission = Submission(manifest.name, manifest.namespace, manifest.kind, grace_s, time.time())
    write_json_atomic(submission_file(paths), asdict(submission))
    return submission


def recorded_submission(paths: RunPaths) -> Submission | None:
    """The run's submission (a record this project wrote: read leniently), or None."""
    raw = read_json(submission_file(paths))
    try:
        return decode_payload(Submission, raw) if isinstance(raw, dict) else None
    except ValueError:
        return None


def describe(submission: Submission) -> str:
    where = f"{submission.namespace}/" if submission.namespace else ""
    return f"Kubernetes {submission.kind} {where}{submission.name}"
