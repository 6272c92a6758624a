"""Checks of each part of tools/k8s (Services and selectors, the shard servers, the scheduler, the trainers as
an indexed Job, a PyTorchJob or a TrainJob), run on the manifests as written and as ``kubectl kustomize``
renders them."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from k8s_manifests import (
    CRDS,
    IMAGES,
    NAMESPACE,
    NODE_NAME,
    PYTORCHJOB_PORT,
    SNAPSHOT_MARGIN_S,
    Doc,
    _argv,
    _container,
    _dockerfile_json,
    _environ,
    _grpc_probe,
    _one,
    _pod_env,
    _quantity,
    _selects,
    _services_of,
    _target_port,
    _tigana,
    _torchrun,
)

from tigana.ps.domains import FailureDomain
from tigana.ps.scheduler import SERVICE_NAME as SCHEDULER_HEALTH_NAME
from tigana.ps.scheduler import SchedulerConfig
from tigana.ps.shard.daemon import COPIES_HEALTH_NAME
from tigana.tools import scheduler_cmd, server_cmd, train_cmd


# ------------------------------------------------------------------------ labels, selectors, Services
def _check_selectors(docs: list[Doc]) -> None:
    pods = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert _selects(d["spec"]["selector"]["matchLabels"], labels), d["metadata"]["name"]
            pods.append(labels)
        elif d["kind"] == "Job":
            pods.append(d["spec"]["template"]["metadata"]["labels"])
        elif d["kind"] == "PyTorchJob":
            pods += [s["template"]["metadata"]["labels"] for s in d["spec"]["pytorchReplicaSpecs"].values()]
    for d in docs:
        if d["kind"] == "Service":
            assert any(_selects(d["spec"]["selector"], p) for p in pods), f"Service {d['metadata']['name']} " \
                                                                          "selects no pod"
        if d["kind"] == "PodDisruptionBudget":
            assert any(_selects(d["spec"]["selector"]["matchLabels"], p) for p in pods), d["metadata"]["name"]
    # a Service never mixes the pods of two components
    for d in docs:
        if d["kind"] == "Service":
            hit = {p["app.kubernetes.io/component"] for p in pods if _selects(d["spec"]["selector"], p)}
            assert len(hit) == 1, f"Service {d['metadata']['name']} selects {hit}"


def _check_statefulsets(docs: list[Doc]) -> None:
    for sts in (d for d in docs if d["kind"] == "StatefulSet"):
        svc = _one(docs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"].get("clusterIP") == "None", f"{svc['metadata']['name']} must be headless"
        assert _selects(svc["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
        claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
        for c in sts["spec"]["template"]["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in claims, f"{c['name']}: mount {m['name']} is no volumeClaimTemplate"


# ------------------------------------------------------------------------------------- the shard servers
def _check_shards(docs: list[Doc]) -> None:
    sts = _one(docs, "StatefulSet", "tigana-shard")
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    assert spec["podManagementPolicy"] == "Parallel"
    container = _container(pod, "shard")
    pod_name = "tigana-shard-0"
    env = _pod_env(docs, pod, container, pod_name)
    argv = _argv(container, env)
    assert argv[:2] == ["tigana", "server"], argv
    with _environ(env):
        args = _tigana(argv[1:])
        # the settings the daemon would run with, as `tigana server` loads them (flags > TIGANA_* > defaults)
        config = server_cmd.load(args).config

    # identity and address: the pod name, and its DNS name under the governing headless Service
    headless = _one(docs, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True  # copies catching up must be reachable
    assert config.server_id == pod_name
    assert config.advertise == f"{pod_name}.{spec['serviceName']}.{NAMESPACE}.svc:{config.port}"
    assert config.host == "0.0.0.0"

    # ports: the container, the Service and the probes use the ports the daemon binds
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": config.port, "metrics": config.metrics_port}
    for p in headless["spec"]["ports"]:
        assert _target_port(p, container) in ports.values(), p
    assert _grpc_probe(container, "startupProbe") == (config.port, "")
    assert _grpc_probe(container, "livenessProbe") == (config.port, "")
    assert _grpc_probe(container, "readinessProbe") == (config.port, COPIES_HEALTH_NAME)

    # metrics: scraped by annotation, on an endpoint reachable from outside the pod
    notes = sts["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == str(config.metrics_port)
    assert notes["prometheus.io/path"] == "/metrics"
    assert config.metrics_host == "0.0.0.0", "the metrics endpoint would bind 127.0.0.1 only"

    # data: the --data-dir is a volume from a claim template (one per pod), and snapshots are on
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert config.data_dir in mounts
    assert mounts[config.data_dir] in {c["metadata"]["name"] for c in spec["volumeClaimTemplates"]}
    assert config.snapshot_every_s > 0
    assert config.data_dir in _dockerfile_json("VOLUME")

    # graceful drain: the kubelet waits for the drain and the final snapshot before SIGKILL
    assert pod["terminationGracePeriodSeconds"] >= config.drain_grace_s + SNAPSHOT_MARGIN_S

    # memory: the budget of resident rows fits in the container with room for the rest
    limit = _quantity(container["resources"]["limits"]["memory"])
    assert config.memory_budget is not None and config.memory_budget <= 0.8 * limit

    for address in config.scheduler.split(","):
        _check_scheduler_address(docs, address)

    # failure domain: the node's name, and its zone where the pod carries the node's zone label
    assert config.failure_domain("container-hostname") == FailureDomain(host=NODE_NAME)
    zoned_env = _pod_env(docs, pod, container, pod_name, zone="eu-west-1a")
    with _environ(zoned_env):
        zoned = server_cmd.load(_tigana(_argv(container, zoned_env)[1:])).config
    assert zoned.failure_domain() == FailureDomain(zone="eu-west-1a", host=NODE_NAME)

    # at least --replicas + 1 servers (a slot's copies live on distinct servers), and what the first
    # placement waits for
    sched = _scheduler_config(docs)
    assert spec["replicas"] >= sched.replicas + 1 and spec["replicas"] >= sched.expect_servers


# ------------------------------------------------------------------------------------------ the scheduler
def _scheduler_container(docs: list[Doc]) -> tuple[Doc, Doc]:
    deploy = _one(docs, "Deployment", "tigana-scheduler")
    pod = deploy["spec"]["template"]["spec"]
    return pod, _container(pod, "scheduler")


def _scheduler_argv(docs: list[Doc]) -> tuple[list[str], dict[str, str]]:
    pod, container = _scheduler_container(docs)
    env = _pod_env(docs, pod, container, "tigana-scheduler-5d9c7-x2x4z")
    argv = _argv(container, env)
    assert argv[:2] == ["tigana", "scheduler"], argv
    return argv[1:], env


def _scheduler_config(docs: list[Doc]) -> SchedulerConfig:
    """The settings the scheduler runs with, loaded as `tigana scheduler` does in the pod's environment."""
    argv, env = _scheduler_argv(docs)
    with _environ(env):
        return scheduler_cmd.load(_tigana(argv)).config


def _scheduler_port(docs: list[Doc]) -> int:
    return _scheduler_config(docs).port


def _check_scheduler_address(docs: list[Doc], address: str) -> None:
    """``address`` (a server's --scheduler, a trainer's --ps) reaches the scheduler: HOST is a Service that
    selects the scheduler's pods, PORT one of its ports, whose target is the port the scheduler binds."""
    host, port = address.rsplit(":", 1)
    svc = _one(docs, "Service", host)
    pod, container = _scheduler_container(docs)
    assert _selects(svc["spec"]["selector"], _one(docs, "Deployment", "tigana-scheduler")["spec"]["template"]
                    ["metadata"]["labels"]), address
    svc_port = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
    assert svc_port, f"{address}: Service {host} has no port {port}"
    assert _target_port(svc_port[0], container) == _scheduler_port(docs)


def _check_scheduler(docs: list[Doc]) -> None:
    deploy = _one(docs, "Deployment", "tigana-scheduler")
    pod, container = _scheduler_container(docs)
    config = _scheduler_config(docs)
    assert config.host == "0.0.0.0"
    assert deploy["spec"]["replicas"] >= 2, "a highly available scheduler"
    # every replica is Ready (a standby too), so a rollout completes: a new pod, then an old one goes
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 1
    [pdb] = [d for d in docs if d["kind"] == "PodDisruptionBudget"
             and _selects(d["spec"]["selector"]["matchLabels"], deploy["spec"]["template"]["metadata"]["labels"])]
    assert pdb["spec"]["maxUnavailable"] == 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": config.port, "metrics": config.metrics_port}
    assert config.metrics_host == "0.0.0.0", "the metrics endpoint would bind 127.0.0.1 only"
    assert _grpc_probe(container, "startupProbe") == (config.port, "")
    assert _grpc_probe(container, "livenessProbe") == (config.port, "")
    # "" is SERVING on leader and standbys alike (SCHEDULER_HEALTH_NAME would keep the standbys unready forever)
    assert _grpc_probe(container, "readinessProbe") == (config.port, "")
    assert container["image"].split(":")[0] == "tigana-server"  # no torch in a scheduler
    services = _services_of(docs, deploy["spec"]["template"]["metadata"]["labels"])
    assert {s["metadata"]["name"] for s in services} == {"tigana-scheduler", "tigana-scheduler-pods"}
    for svc in services:
        assert [_target_port(p, container) for p in svc["spec"]["ports"]] == [config.port]
    assert SCHEDULER_HEALTH_NAME  # still served (on the leader): tests/tools/test_k8s_scheduler_service.py
    assert _one(docs, "Service", "tigana-scheduler")["spec"].get("clusterIP") != "None"
    pods = _one(docs, "Service", "tigana-scheduler-pods")["spec"]
    assert pods["clusterIP"] == "None" and pods["publishNotReadyAddresses"] is True


# ------------------------------------------------------------------------------------------- the trainers
def _check_trainer_args(docs: list[Doc], tigana_argv: list[str], env: dict[str, str]) -> None:
    assert tigana_argv[0] == "train"
    with _environ(env):
        config = train_cmd.load(_tigana(tigana_argv)).config  # as `tigana train` loads it
    assert config.ps, "the trainers must use the cluster (--ps), not an embedded one"
    for address in config.ps:
        _check_scheduler_address(docs, address)


WAIT = re.compile(r"^until (tigana .*?) \| grep -qF '([^']*)'; do sleep \d+; done$")


def _wait_for_cluster(docs: list[Doc], pod_spec: Doc) -> tuple[list[str], str]:
    """The trainers' init container: ``until tigana admin ... --json status | grep -qF TEXT; do sleep N; done``
    -> (the tigana argv, TEXT); the tigana command is parsed, its scheduler address checked."""
    [init] = pod_spec["initContainers"]
    assert init["name"] == "wait-for-cluster" and init["command"][:2] == ["sh", "-c"], init["command"]
    m = WAIT.match(init["command"][2])
    assert m, f"unexpected wait script {init['command'][2]!r}"
    argv = shlex.split(m.group(1))[1:]
    with _environ({}):
        args = _tigana(argv)
    assert (args.action, args.json) == ("status", True)
    _check_scheduler_address(docs, args.scheduler)
    return argv, m.group(2)


def _check_trainer_job(docs: list[Doc]) -> None:
    from tigana.trainer.distributed import read_env
    from tigana.trainer.launch import under_launcher
    from tigana.trainer.preemption import EXIT_PREEMPTED

    job = _one(docs, "Job", "tigana-train")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and pod["restartPolicy"] == "Never"  # podFailurePolicy needs Never
    container = _container(pod, "trainer")
    _wait_for_cluster(docs, pod)
    # a preempted rank (SIGTERM: checkpoint, exit 75) and a pod the cluster disrupted restart; other failures
    # count against backoffLimit
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                "values": [EXIT_PREEMPTED]}} in rules
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert spec["backoffLimit"] >= 1
    for index in range(spec["completions"]):
        env = _pod_env(docs, pod, container, f"tigana-train-{index}-abcde", index=str(index))
        argv = _argv(container, env)
        # tigana train itself (under tini), so that its exit status 75 is the pod's (torchrun would make it 1)
        assert argv[:2] == ["tigana", "train"], argv
        assert under_launcher(env)
        dist_env = read_env(None, env)
        assert (dist_env.rank, dist_env.world_size) == (index, spec["completions"]) == (index, spec["parallelism"])
        # the rendezvous: rank 0's pod by its hostname (JOB-0) under the Job's subdomain, a headless Service
        assert dist_env.master_addr == f"{job['metadata']['name']}-0.{pod['subdomain']}"
        svc = _one(docs, "Service", pod["subdomain"])
        assert svc["spec"]["clusterIP"] == "None"
        assert _selects(svc["spec"]["selector"], job["spec"]["template"]["metadata"]["labels"])
        assert [_target_port(p, container) for p in svc["spec"]["ports"]] == [dist_env.master_port]
        _check_trainer_args(docs, argv[1:], env)
        with _environ(env):
            config = train_cmd.load(_tigana(argv[1:])).config
        # checkpoints on a volume every pod mounts; a restarted pod resumes from the newest, a first one starts
        assert config.resume == "auto" and config.checkpoint_every > 0
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volume = next(v for v in pod["volumes"] if v["name"] == mounts[config.checkpoint_dir])
        claim = _one(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        # metrics on a named port, on every interface
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == config.metrics_port
        assert config.metrics_host == "0.0.0.0"


def _check_pytorchjob(docs: list[Doc]) -> None:
    job = _one(docs, "PyTorchJob", "tigana-train")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    nodes = sum(r["replicas"] for r in replicas.values())
    rank = 0
    for rtype in ("Master", "Worker"):
        pod = replicas[rtype]["template"]["spec"]
        container = _container(pod, "pytorch")
        _wait_for_cluster(docs, pod)
        for index in range(replicas[rtype]["replicas"]):
            operator = {"PET_NNODES": str(nodes), "PET_NODE_RANK": str(rank),
                        "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
                        "PET_MASTER_ADDR": f"{job['metadata']['name']}-master-0",
                        "PET_MASTER_PORT": str(PYTORCHJOB_PORT)}
            env = _pod_env(docs, pod, container, f"tigana-train-{rtype.lower()}-{index}", extra=operator)
            argv = _argv(container, env)
            assert argv[0] == "torchrun"
            with _environ(env):
                run = _torchrun(argv[1:])
            assert (run.nnodes, run.node_rank, run.nproc_per_node) == (str(nodes), rank, job["spec"]["nprocPerNode"])
            assert (run.master_addr, run.master_port) == (operator["PET_MASTER_ADDR"], PYTORCHJOB_PORT)
            assert run.no_python and run.training_script == "tigana"
            _check_trainer_args(docs, run.training_script_args, env)
            rank += 1


def _check_trainjob(docs: list[Doc]) -> None:
    """Kubeflow Trainer v2: torchrun on numNodes pods of the torch-distributed runtime, which sets PET_*."""
    job = _one(docs, "TrainJob", "tigana-train")
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert set(job["spec"]) <= {"runtimeRef", "trainer", "initializer", "labels", "annotations", "suspend",
                                "managedBy", "podTemplateOverrides", "runtimePatches"}
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = job["spec"]["trainer"]
    assert set(trainer) <= {"image", "command", "args", "env", "numNodes", "resourcesPerNode", "numProcPerNode"}
    assert trainer["image"].split(":")[0] in IMAGES - {"tigana-server"}  # torch is in the train image only
    nodes = trainer["numNodes"]
    for rank in range(nodes):
        env = {"PET_NNODES": str(nodes), "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "1",
               "PET_MASTER_ADDR": "tigana-train-node-0-0.tigana-train", "PET_MASTER_PORT": "29400"}
        argv = [*trainer["command"], *trainer.get("args", [])]
        assert argv[0] == "torchrun"
        with _environ(env):
            run = _torchrun(argv[1:])
        assert (run.nnodes, run.node_rank) == (str(nodes), rank)
        assert run.no_python and run.training_script == "tigana"
        _check_trainer_args(docs, run.training_script_args, env)


def _check_rendered(docs: list[Doc]) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    seen = set()
    for d in docs:
        key = json.dumps(d, sort_keys=True)
        if (d["apiVersion"], d["kind"]) in CRDS or key in seen:
            continue
        seen.add(key)
        kv.validate(d, kv.latest_version(), strict=True)
    _check_selectors(docs)
    _check_statefulsets(docs)
    _check_scheduler(docs)
    _check_shards(docs)
