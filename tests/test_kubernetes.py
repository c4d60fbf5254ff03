"""``submit --kubernetes``: the run's node plans as a JobSet (or a Kubeflow Trainer v2 TrainJob),
checked against the real CRD schemas (tests/data/kubernetes/, JobSet v0.12.0 and Trainer v2.3.0,
with ``jsonschema``), its bad inputs, kubectl's commands for status and stop (their argv: kubectl is
not installed here), and the manifest run pod by pod on the namespace cluster.

The pod-by-pod run is what a kubelet would start from the manifest, and nothing else: each of two
namespace nodes gets its pod's host name (a UTS namespace), the pods' stable names in its hosts file
(what the cluster's DNS answers for the headless service), the ConfigMap's files at their mount path
and a memory-backed /dev/shm (a mount namespace of its own), and its container's command started as
PID 1 of a PID namespace, in its working directory, with exactly the container's variables (values,
the completion index through the downward API, the Secret's keys) and JOB_COMPLETION_INDEX, which the
Job controller sets. What is not run here: the API server, the JobSet controller and the scheduler
(none can be installed from the registries this project reaches); ``kubectl`` is a stand-in script
that keeps what it is given.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from megatron_ext.host.procfs import process_environ
from megatron_ext.run_spec.checkpoints import latest_iteration
from megatron_ext.run_spec.errors import EXIT_PREEMPTED
from orchestration.cluster import kubernetes as kube
from orchestration.launch_env import read_launch_env
from orchestration.node.wire import PACKED_PLANS, NodePlan
from orchestration.runner.submit_kubernetes import plan_kubernetes

from conftest import TEST_DATA, clean_env, require, run_script, tagged_pids, wait_for
from netns_cluster import NamespaceCluster, missing_prerequisites

SCHEMAS = TEST_DATA / "kubernetes"
JOBSET_SCHEMA = json.loads((SCHEMAS / "jobset.x-k8s.io_v1alpha2_jobset.schema.json").read_text())
TRAINJOB_SCHEMA = json.loads((SCHEMAS / "trainer.kubeflow.org_v1alpha1_trainjob.schema.json").read_text())
SECRET = "pod-secret-0042"


def validate(document: dict, schema: dict) -> list[str]:
    """Every way ``document`` breaks the CRD's schema (Draft 7: the x-kubernetes-* extensions are
    not its keywords and are ignored)."""
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def request(**more) -> kube.KubernetesRequest:
    return kube.KubernetesRequest(**{"image": "registry.example/launcher:1", "volume_claim": "runs", "namespace": "team-a",
                                     "queue": "team-a-queue", "gpus_per_node": 8, "rdma_resource": ("rdma/ib", 1),
                                     "exclusive_topology": "cloud.google.com/gke-nodepool", "shm_size": "64Gi", **more})


def planned(tmp_path: Path, nodes: int, run: str = "k8s-demo", **more):
    env = clean_env(ARTIFACT_ROOT=str(tmp_path), HF_TOKEN=SECRET, NCCL_IB_HCA="mlx5")
    launch = read_launch_env(env, python="/usr/bin/python3", cwd="/workspace/launcher")
    return plan_kubernetes(launch, "gpt_smoke", "smoke", run, request(**more), nodes=nodes)


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_the_jobset_of_1_2_and_4_nodes_is_the_start_s_plan_and_fits_the_crd(tmp_path, nodes):
    p = planned(tmp_path, nodes)
    config, jobset = p.manifest.documents
    assert validate(jobset, JOBSET_SCHEMA) == []
    assert (jobset["apiVersion"], jobset["kind"], config["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet", "ConfigMap")
    meta, spec = jobset["metadata"], jobset["spec"]
    assert meta["labels"][kube.QUEUE_LABEL] == "team-a-queue"
    assert meta["annotations"] == {kube.EXCLUSIVE_TOPOLOGY: "cloud.google.com/gke-nodepool"}
    assert spec["failurePolicy"] == {"maxRestarts": 3} and spec["network"]["subdomain"] == "k8s-demo"
    (rjob,) = spec["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert (job["completionMode"], job["parallelism"], job["completions"], job["backoffLimit"]) == ("Indexed", nodes, nodes, 0)
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 300
    (container,) = pod["containers"]
    assert container["command"] == ["/usr/bin/python3", "-m", "orchestration", "node-pod", "--plan-dir", kube.PLAN_MOUNT]
    assert container["workingDir"] == "/workspace/launcher"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/ib": 1}
    assert set(container["securityContext"]["capabilities"]["add"]) == {"IPC_LOCK", "SYS_PTRACE"}
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{kube.COMPLETION_INDEX}']"
    assert env["MASTER_ADDR"]["value"] == "k8s-demo-node-0-0.k8s-demo" and env["NNODES"]["value"] == str(nodes)
    assert env["NCCL_IB_HCA"]["value"] == "mlx5" and env["COORDINATION_PORT"]["value"] == str(int(env["MASTER_PORT"]["value"]) + 1)
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "k8s-demo-secrets", "key": "HF_TOKEN"}
    assert SECRET not in p.manifest.to_yaml() and "PATH" not in env and "PYTHONPATH" not in env
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[str(tmp_path)]]["persistentVolumeClaim"] == {"claimName": "runs"}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes[mounts[kube.PLAN_MOUNT]]["configMap"]["name"] == config["metadata"]["name"] == "k8s-demo-plan"
    # The ConfigMap holds the start's own node plans, node i for pod i, named by its stable name.
    plans = [NodePlan.from_json(config["data"][f"node{i}.json"]) for i in range(nodes)]
    assert plans == list(p.plan.nodes)
    for i, plan in enumerate(plans):
        assert plan.node_rank == i and plan.host == f"k8s-demo-node-0-{i}.k8s-demo" and plan.env["NODE_RANK"] == str(i)
        argv = plan.argv
        assert argv[:3] == ("/usr/bin/python3", "-m", "torch.distributed.run") and "megatron_ext.pretrain" in argv
        assert [argv[argv.index(f) + 1] for f in ("--nnodes", "--node-rank", "--nproc-per-node", "--master-addr")] == \
            [str(nodes), str(i), "8", "k8s-demo-node-0-0.k8s-demo"]
        assert plan.secret_names == ("HF_TOKEN",) and plan.cwd == "/workspace/launcher"
    assert not (tmp_path / "run_state").exists()  # planned and printed: nothing written


def test_plans_of_more_nodes_than_a_config_map_holds_readable_go_gzipped_and_each_pod_reads_its_own(tmp_path):
    """200 nodes' readable plans would pass a ConfigMap's 1 MiB (each names every node): they go as one
    gzipped list, which node-pod reads as it reads ``node<i>.json``."""
    from orchestration.node.pod import read_plan

    p = planned(tmp_path / "art", 200)
    config, jobset = p.manifest.documents
    assert set(config) >= {"binaryData"} and "data" not in config and validate(jobset, JOBSET_SCHEMA) == []
    assert len(yaml.safe_dump(config)) < kube.CONFIGMAP_LIMIT_BYTES
    packed, plain = tmp_path / "packed", tmp_path / "plain"
    packed.mkdir(), plain.mkdir()
    (packed / PACKED_PLANS).write_bytes(base64.b64decode(config["binaryData"][PACKED_PLANS]))
    assert read_plan(str(packed), {"JOB_COMPLETION_INDEX": "199"}) == p.plan.nodes[199]
    small = planned(tmp_path / "art", 2).manifest.documents[0]["data"]
    for key, text in small.items():
        (plain / key).write_text(text)
    assert read_plan(str(plain), {"JOB_COMPLETION_INDEX": "1"}).host == "k8s-demo-node-0-1.k8s-demo"
    with pytest.raises(ValueError, match="node2.json does not exist: the plans' ConfigMap holds node0.json, node1.json"):
        read_plan(str(plain), {"JOB_COMPLETION_INDEX": "2"})
    with pytest.raises(ValueError, match="not a pod index"):
        read_plan(str(plain), {})


def test_the_trainjob_fits_kubeflow_trainer_s_crd(tmp_path):
    p = planned(tmp_path, 2, trainjob="torch-distributed")
    trainjob = p.manifest.workload
    assert validate(trainjob, TRAINJOB_SCHEMA) == []
    assert trainjob["spec"]["runtimeRef"]["name"] == "torch-distributed" and trainjob["spec"]["trainer"]["numNodes"] == 2
    patch = trainjob["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert patch["name"] == kube.REPLICATED_JOB and "volumes" in patch["template"]["spec"]["template"]["spec"]


def test_the_schema_check_finds_a_bad_manifest(tmp_path):
    """The validator is not a no-op: a count of the wrong type, a policy out of its enum, a missing name."""
    jobset = planned(tmp_path, 2).manifest.workload
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    job["backoffLimit"] = "none"
    jobset["spec"]["successPolicy"]["operator"] = "Most"
    del jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["name"]
    errors = validate(jobset, JOBSET_SCHEMA)
    assert any("backoffLimit" in e for e in errors) and any("successPolicy/operator" in e for e in errors)
    assert any("'name' is a required property" in e for e in errors), errors


SUBMIT = ("gpt_smoke", "smoke", "kdemo", "--kubernetes")


@pytest.mark.parametrize("args, env, message", [
    (("--volume-claim", "runs"), {}, "--image is empty"),
    (("--image", "reg/l:1"), {}, "--volume-claim '' is not a PersistentVolumeClaim name"),
    (("--image", "reg/l:1", "--volume-claim", "Runs_1"), {}, "--volume-claim 'Runs_1' is not"),
    (("--image", "reg/l:1", "--volume-claim", "runs", "--nodes", "2"), {"NNODES": "4"}, "NNODES=4 but --nodes 2"),
    (("--image", "reg/l:1", "--volume-claim", "runs"), {"NNODES": "1:2"}, "a fixed number of pods"),
    (("--image", "reg/l:1", "--volume-claim", "runs"), {"HOSTS": "a,b"}, "unset HOSTS"),
    (("--image", "reg/l:1", "--volume-claim", "runs", "--partition", "gpu"), {}, "--partition is for a Slurm batch job"),
    (("--image", "reg/l:1", "--volume-claim", "runs", "--rdma", "rdma/ib=x"), {}, "is not RESOURCE=COUNT"),
    (("--image", "reg/l:1", "--volume-claim", "runs", "--apply"), {"PATH": "bash and dirname alone"}, "kubectl is not installed here"),
])
def test_a_bad_input_is_one_message_and_nothing_is_written(tmp_path, args, env, message):
    if "PATH" in env:  # a machine without kubectl: a PATH of bash and dirname, the interpreter named
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for tool in ("bash", "dirname"):
            (bin_dir / tool).symlink_to(shutil.which(tool))
        env = {"PATH": str(bin_dir), "LAUNCHER_PYTHON": sys.executable}
    proc = run_script("submit_training.sh", *SUBMIT, *args, env=clean_env(ARTIFACT_ROOT=str(tmp_path / "art"), **env))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert not (tmp_path / "art" / "run_state").exists()


def test_kubernetes_options_without_kubernetes_are_refused(tmp_path):
    proc = run_script("submit_training.sh", "gpt_smoke", "smoke", "kdemo", "--image", "reg/l:1",
                      env=clean_env(ARTIFACT_ROOT=str(tmp_path), DRY_RUN="1"))
    assert proc.returncode == 2 and "--image is for --kubernetes" in proc.stderr, proc.stderr
    for given, message in ((["--max-restarts", "3"], "--max-restarts is for --kubernetes"),  # its default, given: refused too
                           (["--termination-grace-s", "0"], "--termination-grace-s is for --kubernetes"),
                           (["--kubernetes", "--signal-ahead-s", "300"], "--signal-ahead-s is for a Slurm batch job")):
        proc = run_script("submit_training.sh", "gpt_smoke", "smoke", "kdemo", *given,
                          env=clean_env(ARTIFACT_ROOT=str(tmp_path), DRY_RUN="1"))
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, (given, proc.stderr)


def test_status_and_stop_go_through_kubectl():
    """The plans (kubectl cannot run here): status asks for the JobSet and its pods, stop deletes the
    JobSet and the plans' ConfigMap and waits for the pods' saves (their grace, and a minute)."""
    s = kube.Submission("k8s-demo", "team-a", "JobSet", grace_s=300)
    assert kube.status_argvs(s) == [
        ["kubectl", "get", "jobset", "k8s-demo", "-n", "team-a", "-o", "wide"],
        ["kubectl", "get", "pods", "-n", "team-a", "-l", "jobset.sigs.k8s.io/jobset-name=k8s-demo", "-o", "wide"]]
    assert kube.delete_argv(s) == ["kubectl", "delete", "-n", "team-a", "jobset/k8s-demo", "configmap/k8s-demo-plan",
                                   "--ignore-not-found", "--cascade=foreground", "--wait=true", "--timeout=360s"]
    assert kube.logs_argv(kube.Submission("t", None, "TrainJob"), 1)[:4] == ["kubectl", "logs", "-l",
                                                                              f"jobset.sigs.k8s.io/jobset-name=t,{kube.COMPLETION_INDEX}=1"]


def test_a_run_name_that_is_no_host_name_is_refused():
    assert kube.resource_name("Qwen3_32gpu.z1", 4) == "qwen3-32gpu-z1"
    with pytest.raises(Exception, match="at most 63 characters"):
        kube.resource_name("r" * 60, 4)
    with pytest.raises(Exception, match="start with a letter"):
        kube.resource_name("1run", 2)


# -- pod by pod on the namespace cluster ---------------------------------------------------------------

KUBECTL_STAND_IN = """#!/bin/sh
# kubectl's stand-in: what it was asked, and the manifest apply was given on its standard input.
echo "$*" >> {log}
case "$1" in
  apply) cat > {applied}; echo "configmap/x configured"; echo "jobset.jobset.x-k8s.io/x created" ;;
  get) echo "Error from server (NotFound): not found" >&2; exit 1 ;;
  *) echo "done: $*" ;;
esac
"""


def pod_process(documents: list[dict], index: int) -> dict:
    """What a kubelet starts for pod ``index`` of the JobSet, from the applied documents alone: its
    host name and subdomain (JobSet's naming), the ConfigMap files by mount path, the working
    directory, the command (``$(VAR)`` expanded as the kubelet does) and every variable."""
    by_kind = {d["kind"]: d for d in documents}
    jobset, secret = by_kind["JobSet"], by_kind.get("Secret", {})
    (rjob,) = jobset["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    hostname = f"{jobset['metadata']['name']}-{rjob['name']}-0-{index}"
    annotations = {kube.COMPLETION_INDEX: str(index)}
    env = {"PATH": os.environ["PATH"], "HOSTNAME": hostname, "HOME": "/root", "JOB_COMPLETION_INDEX": str(index)}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
        elif "fieldRef" in item["valueFrom"]:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            env[item["name"]] = annotations[re.fullmatch(r"metadata\.annotations\['(.+)'\]", path).group(1)]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"]
            env[item["name"]] = secret["stringData"][ref["key"]]
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_maps = {d["metadata"]["name"]: d for d in documents if d["kind"] == "ConfigMap"}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in container["command"]]
    return {"hostname": hostname, "subdomain": jobset["spec"]["network"]["subdomain"], "argv": argv, "env": env,
            "cwd": container["workingDir"], "mounts": mounts, "config_maps": config_maps}


def start_pod(cluster: NamespaceCluster, node, pod: dict, folder: Path) -> subprocess.Popen:
    """The pod's process on ``node`` (over its sshd: its mount namespace sees the share), in UTS, mount
    and PID namespaces of its own; its output in ``folder``/output.log."""
    folder.mkdir(parents=True)
    steps = []
    for path, volume in pod["mounts"].items():
        if "configMap" in volume:
            files = folder / volume["name"]
            files.mkdir()
            config = pod["config_maps"][volume["configMap"]["name"]]
            for key, text in config.get("data", {}).items():
                (files / key).write_text(text)
            for key, text in config.get("binaryData", {}).items():
                (files / key).write_bytes(base64.b64decode(text))
            Path(path).mkdir(parents=True, exist_ok=True)
            steps.append(f"mount --bind {shlex.quote(str(files))} {shlex.quote(path)}")
        elif "emptyDir" in volume:
            steps.append(f"mount -t tmpfs -o size=1g tmpfs {shlex.quote(path)}")
        else:  # the volume claim: the cluster's share, at the same path on every node
            assert "persistentVolumeClaim" in volume and Path(path) == cluster.share, (path, volume)
    spec = folder / "process.json"  # the variables travel in a file, as a kubelet hands them over: not in an argv
    spec.write_text(json.dumps({"argv": pod["argv"], "env": pod["env"], "cwd": pod["cwd"], "hostname": pod["hostname"]}))
    spec.chmod(0o600)
    exec_spec = ("import json, os, socket, sys; s = json.load(open(sys.argv[1])); os.unlink(sys.argv[1]); "
                 "socket.sethostname(s['hostname']); os.chdir(s['cwd']); os.execvpe(s['argv'][0], s['argv'], s['env'])")
    steps.append(shlex.join(["exec", sys.executable, "-c", exec_spec, str(spec)]))
    inner = shlex.join(["unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private",
                        "sh", "-c", " && ".join(steps)])
    out = open(folder / "output.log", "wb")
    return subprocess.Popen(["ssh", "-F", str(cluster.ssh_config), node.alias, "--", inner], stdin=subprocess.DEVNULL,
                            stdout=out, stderr=subprocess.STDOUT)


def pod_main_pid(hostname: str) -> int | None:
    """The host's pid of the pod's PID 1 (its variables name its host, its PID namespace calls it 1)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if nspid[-1:] == ["1"] and len(nspid) > 1 and process_environ(int(entry.name)).get("HOSTNAME") == hostname:
            return int(entry.name)
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, artifact_root):
    """Two nodes; node 0 keeps the artifact root, node 1 sees it through sshfs (the volume claim)."""
    require(missing_prerequisites(share=True), "the pod-by-pod test")
    c = NamespaceCluster(2, tmp_path_factory.mktemp("k8s_cluster"), share=artifact_root).open()
    yield c
    c.close()


@pytest.mark.multinode
@pytest.mark.slow
def test_the_manifest_run_pod_by_pod_trains_like_one_node_and_saves_on_sigterm(cluster, artifact_root, unattended, tmp_path):
    """``submit --kubernetes --apply`` (kubectl a stand-in) writes the run's parameters and applies the
    ConfigMap and the JobSet (the Secret first); each of its two pods, started as a kubelet would on a
    namespace node, trains (1 process each, world 2) with the losses of the uninterrupted one-node run
    of the same data set (``unattended``, conftest.py: 2 processes, which the ssh tests show equal to 2
    nodes); the secret reaches the ranks; SIGTERM to each pod's PID 1 (a deletion) saves a checkpoint at
    the next step and both pods end preempted (exit 3); status reads the records the pods left."""
    data, reference = unattended
    run = "kpods"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(KUBECTL_STAND_IN.format(log=tmp_path / "kubectl.log", applied=tmp_path / "applied.yaml"))
    kubectl.chmod(0o755)
    env = clean_env(ARTIFACT_ROOT=str(artifact_root), NPROC_PER_NODE="1", HF_TOKEN=SECRET, MASTER_PORT="29670",
                    PATH=f"{bin_dir}:{os.environ['PATH']}")
    submit = run_script("submit_training.sh", "gpt_smoke", data, run, "--kubernetes", "--image", "local/launcher:test",
                        "--volume-claim", "artifacts", "--nodes", "2", "--python", sys.executable, "--apply", env=env)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    assert "applied Kubernetes JobSet kpods" in submit.stdout and SECRET not in submit.stdout + submit.stderr
    documents = list(yaml.safe_load_all((tmp_path / "applied.yaml").read_text()))
    assert [d["kind"] for d in documents] == ["Secret", "ConfigMap", "JobSet"]
    assert validate(documents[-1], JOBSET_SCHEMA) == []
    assert (tmp_path / "kubectl.log").read_text().splitlines()[-1] == "apply -f -"
    pods = [pod_process(documents, i) for i in (0, 1)]
    names = {f"{p['hostname']}.{p['subdomain']}": n.address for p, n in zip(pods, cluster.nodes)}
    names |= {p["hostname"]: n.address for p, n in zip(pods, cluster.nodes)}
    created = not Path(kube.PLAN_MOUNT).exists()
    procs = []
    try:
        for node in cluster.nodes:
            cluster.set_hosts(node, names)
        procs = [start_pod(cluster, node, pod, tmp_path / f"pod{i}") for i, (node, pod) in enumerate(zip(cluster.nodes, pods))]
        metrics = artifact_root / "runs" / run / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 120, interval_s=0.2,
                 what="3 iterations of the pods' run")
        ranks = [p for p in tagged_pids(run) if "LOCAL_RANK" in process_environ(p)]
        assert len(ranks) == 2 and all(process_environ(p).get("HF_TOKEN") == SECRET for p in ranks)
        assert sorted(process_environ(p)["LAUNCHER_NODE_RANK"] for p in ranks) == ["0", "1"]
        mains = [pod_main_pid(p["hostname"]) for p in pods]
        assert all(mains), mains
        for pid in mains:  # what the kubelet does to a pod being deleted: SIGTERM to the container's PID 1
            os.kill(pid, signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if tagged_pids(run):
            run_script("stop_multinode_training.sh", run, env=clean_env(ARTIFACT_ROOT=str(artifact_root), HOSTS="node0,node1",
                                                                        SSH_OPTS=cluster.ssh_opts))
        for node in cluster.nodes:
            cluster.set_hosts(node)
        if created:
            Path(kube.PLAN_MOUNT).rmdir()
            Path(kube.PLAN_MOUNT).parent.rmdir()
    outputs = [(tmp_path / f"pod{i}" / "output.log").read_text(errors="replace") for i in (0, 1)]
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], (codes, outputs[0][-3000:], outputs[1][-3000:])
    for i in (0, 1):  # the pod's own lines, and the node log copied to its output (kubectl logs)
        assert f"[pod] [node{i} kpods-node-0-{i}.kpods] run kpods" in outputs[i] and "iteration" in outputs[i]
        assert "SIGTERM: asked every node to save" in outputs[i] and "preempted" in outputs[i]
        exit_record = json.loads((artifact_root / "run_state" / f"{run}_node{i}.exit.json").read_text())
        assert exit_record["state"] == "preempted", exit_record
    records = [json.loads(line) for line in (artifact_root / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    saved = latest_iteration(artifact_root / "runs" / run / "checkpoints")
    assert saved is not None and saved == records[-1]["iteration"] >= 3, (saved, records[-1])
    assert [r["iteration"] for r in records] == list(range(1, saved + 1)) and records[-1]["world_size"] == 2
    for r in records:
        assert abs(r["lm_loss"] - reference[r["iteration"]]) <= 1e-6 * abs(reference[r["iteration"]]), r
    status = run_script("status_training.sh", run, env=env)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "Kubernetes JobSet kpods" in status.stdout and "kubectl get jobset kpods -o wide" in status.stdout
    assert re.search(r"^0 +kpods-node-0-0\.kpods +preempted", status.stdout, re.M), status.stdout
    stop = run_script("stop_multinode_training.sh", run, env=env)
    assert stop.returncode == 0 and "deleted; every pod was asked to save" in stop.stdout, stop.stdout + stop.stderr
    assert (tmp_path / "kubectl.log").read_text().splitlines()[-1].startswith("delete jobset/kpods configmap/kpods-plan")
    assert SECRET not in (tmp_path / "kubectl.log").read_text()  # the Secret's value went on kubectl's standard input only
