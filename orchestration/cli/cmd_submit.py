"""python -m orchestration submit gpt_smoke smoke demo --nodes 2"""

from megatron_ext.run_spec.errors import EXIT_OK, UserError
from orchestration.cli.console import note
from orchestration.cluster import slurm
from orchestration.cluster.kubernetes import (DEFAULT_MAX_RESTARTS, DEFAULT_TERMINATION_GRACE_S, KubernetesRequest,
                                               describe as describe_submission, parse_rdma)
from orchestration.launch_env import LaunchEnv
from orchestration.node.run_state import stop_command
from orchestration.runner import submit_kubernetes as kubernetes
from orchestration.runner.submit import plan_submit, submit_batch

HELP = ("sbatch a job that runs MODEL DATA RUN on its nodes and waits for it, or with --kubernetes render it as a JobSet; "
        "DRY_RUN=1: print the batch script or the manifest")
KUBERNETES_OPTIONS = ("image", "namespace", "volume_claim", "queue", "rdma", "max_restarts", "termination_grace_s", "shm_size",
                      "exclusive_topology", "secret", "trainjob", "python", "workdir", "apply")
SLURM_OPTIONS = ("time", "partition", "account", "signal_ahead_s")


def add_arguments(parser) -> None:
    parser.add_argument("model"), parser.add_argument("data"), parser.add_argument("run")
    parser.add_argument("--nodes", type=int, help="nodes (default NNODES, 1)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs (and processes) per node (default: CPUs, NPROC_PER_NODE)")
    parser.add_argument("--time", help="time limit (default SBATCH_TIMELIMIT, else the partition's)")
    parser.add_argument("--partition", help="partition (default SBATCH_PARTITION, else the cluster's default)")
    parser.add_argument("--account", help="account (default SBATCH_ACCOUNT)")
    parser.add_argument("--signal-ahead-s", type=int,
                        help=f"save this long before the time limit and requeue (default {slurm.DEFAULT_SIGNAL_AHEAD_S}; "
                             "0: no save, no requeue)")
    k8s = parser.add_argument_group("Kubernetes (docs/kubernetes.md)")
    k8s.add_argument("--kubernetes", action="store_true", help="render the run as a JobSet of --nodes pods (printed; "
                     "--apply: kubectl apply)")
    k8s.add_argument("--image", help="the container image with this project (required)")
    k8s.add_argument("--volume-claim", help="a ReadWriteMany PersistentVolumeClaim, mounted at ARTIFACT_ROOT (required)")
    k8s.add_argument("--namespace", help="default: kubectl's context's")
    k8s.add_argument("--queue", help="Kueue LocalQueue (label kueue.x-k8s.io/queue-name)")
    k8s.add_argument("--rdma", metavar="RESOURCE=COUNT", help="an RDMA device resource per pod, e.g. rdma/ib=1")
    k8s.add_argument("--max-restarts", type=int, help="JobSet failurePolicy.maxRestarts: "
                     f"recreations of every pod after one ended failed (default {DEFAULT_MAX_RESTARTS})")
    k8s.add_argument("--termination-grace-s", type=int, help="the pods' "
                     "terminationGracePeriodSeconds: SIGTERM saves at the next step, SIGKILL after this (default "
                     f"{DEFAULT_TERMINATION_GRACE_S})")
    k8s.add_argument("--shm-size", help="sizeLimit of the memory-backed /dev/shm (e.g. 64Gi; default: none)")
    k8s.add_argument("--exclusive-topology", metavar="NODE_LABEL", help="every pod in one domain of this node label, "
                     "alone there (alpha.jobset.sigs.k8s.io/exclusive-topology)")
    k8s.add_argument("--secret", help="the Secret the secret variables are read from (default <name>-secrets)")
    k8s.add_argument("--trainjob", metavar="RUNTIME", help="a Kubeflow Trainer v2 TrainJob on this "
                     "ClusterTrainingRuntime instead of a JobSet")
    k8s.add_argument("--python", help="the image's interpreter (default: this launcher's)")
    k8s.add_argument("--workdir", help="this project's directory in the image (default: this one's)")
    k8s.add_argument("--apply", action="store_true", help="kubectl apply -f - the manifest (and the Secret first)")


def run(args, launch: LaunchEnv) -> int:
    """sbatch a batch script that runs the start inside the job (srun transport) and waits for it;
    with --kubernetes, the run as a JobSet (:func:`run_kubernetes`)."""
    check_submit_options(args)
    if args.kubernetes:
        return run_kubernetes(args, launch)
    plan = plan_submit(launch, args.model, args.data, args.run, args.nodes, args.gpus_per_node, args.time,
                       args.partition, args.account, _or(args.signal_ahead_s, slurm.DEFAULT_SIGNAL_AHEAD_S))
    if launch.dry_run:
        print(plan.script, end="", flush=True)
        note(f"DRY_RUN=1: nothing submitted; the batch script above would be written to {plan.script_path} and sbatched")
        return EXIT_OK
    job = submit_batch(launch, plan)
    r = plan.request
    print(f"submitted slurm job {job} for run {args.run}: {r.nodes} node(s) x {r.nproc_per_node} processes; batch script "
          f"{plan.script_path}; status: status_training.sh {args.run}; stop: {stop_command(args.run, True)}", flush=True)
    return EXIT_OK


def check_submit_options(args) -> None:
    """Slurm's options with --kubernetes, or Kubernetes' without it, given at all (their defaults too):
    one error naming them."""
    wrong = [name for name in (SLURM_OPTIONS if args.kubernetes else KUBERNETES_OPTIONS)
             if getattr(args, name) is not None and getattr(args, name) is not False]  # 0 is given; --apply unset is False
    if wrong:
        flags = ", ".join("--" + name.replace("_", "-") for name in wrong)
        raise UserError(f"{flags} {'are' if len(wrong) > 1 else 'is'} for "
                        + ("a Slurm batch job, not --kubernetes; leave them out" if args.kubernetes else
                           "--kubernetes; add --kubernetes, or leave them out for a Slurm batch job"))


def _or(given: int | None, default: int) -> int:
    """An option's value: as given, else its default (None until then: check_submit_options sees what was given)."""
    return default if given is None else given


def run_kubernetes(args, launch: LaunchEnv) -> int:
    """The run's node plans as a JobSet (or a TrainJob): printed, or with --apply applied through kubectl (DRY_RUN=1: printed only)."""
    request = KubernetesRequest(image=args.image or "", volume_claim=args.volume_claim or "", namespace=args.namespace,
                                queue=args.queue, gpus_per_node=args.gpus_per_node or 0, rdma_resource=parse_rdma(args.rdma),
                                max_restarts=_or(args.max_restarts, DEFAULT_MAX_RESTARTS),
                                termination_grace_s=_or(args.termination_grace_s, DEFAULT_TERMINATION_GRACE_S),
                                shm_size=args.shm_size, exclusive_topology=args.exclusive_topology, secret_name=args.secret,
                                trainjob=args.trainjob)
    apply = args.apply and not launch.dry_run
    planned = kubernetes.plan_kubernetes(launch, args.model, args.data, args.run, request, args.nodes, args.python,
                                         args.workdir, apply=apply)
    note(*planned.notes)
    manifest = planned.manifest
    if not apply:
        print(manifest.to_yaml(), end="", flush=True)
        note(f"{'DRY_RUN=1: ' if launch.dry_run else ''}nothing applied or written; --apply runs kubectl apply -f - with "
             "this manifest" + (f" (and the Secret {manifest.secret_name} before it)" if manifest.secret_name else ""))
        return EXIT_OK
    submission, notes = kubernetes.apply_kubernetes(launch, planned)
    note(*notes)
    print(f"applied {describe_submission(submission)} for run {args.run}: {len(planned.plan.nodes)} pod(s) x "
          f"{planned.launch.nproc_per_node} processes; status: status_training.sh {args.run}; stop (every pod saves "
          f"first): {stop_command(args.run, True)}", flush=True)
    return EXIT_OK
