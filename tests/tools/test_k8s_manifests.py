"""tools/k8s: the image definition and the Kubernetes manifests.

Every YAML file parses; every resource validates offline against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields fail) except the Kubeflow CRD, checked structurally; labels, selectors, Services,
volumes and the kustomization hang together; and each daemon's command line is parsed with the real
``tigana`` parser (and torchrun's) in the environment its pod would have, so an unknown flag fails, and the
ports, probes and health names are compared with what the daemons serve (two of them started here).
``kubectl kustomize`` renders the kustomization, with and without its components, when kubectl is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tigana.ps.daemon import COPIES_HEALTH_NAME
from tigana.ps.scheduler import SERVICE_NAME as SCHEDULER_HEALTH_NAME
from tigana.ps.scheduler import SchedulerConfig, start_scheduler
from tigana.ps.scheduler.stores.etcd import parse_store_url
from tigana.tools import cli, scheduler_cmd, server_cmd, train_cmd

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "tools" / "k8s"
NAMESPACE = "tigana-test"  # any namespace: nothing in the manifests names one
MIN_K8S = "1.29"  # the manifests are validated against this Kubernetes and the newest the package knows
KUSTOMIZE_KINDS = {"Kustomization", "Component"}
CRDS = {("kubeflow.org/v1", "PyTorchJob"), ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
        ("monitoring.coreos.com/v1", "PodMonitor")}
IMAGES = {"tigana", "tigana-server"}  # tools/k8s/Dockerfile's two flavours
SNAPSHOT_MARGIN_S = 30  # at least this much of terminationGracePeriodSeconds is left for the final snapshot
JOB_INDEX = "batch.kubernetes.io/job-completion-index"
# what training-operator v1.7+ puts in a PyTorchJob's pods for torchrun (pkg/controller.v1/pytorch)
PYTORCHJOB_PORT = 23456

Doc = dict[str, Any]


# --------------------------------------------------------------------------------------------- loading
def _yaml_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


def _load(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _raw() -> list[Doc]:
    return [d for p in _yaml_files() for d in _load(p) if d["kind"] not in KUSTOMIZE_KINDS]


def _one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _maybe(docs: list[Doc], kind: str, name: str) -> Doc | None:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found[0] if found else None


def _container(pod_spec: Doc, name: str) -> Doc:
    found = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"expected one container {name}"
    return found[0]


def _kustomize(directory: Path) -> list[Doc]:
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {directory}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


def _with_components(tmp_path: Path, skip: tuple[str, ...] = ()) -> Path:
    """A copy of tools/k8s with the commented-out ``components:`` block of its kustomization enabled, as the
    README tells users to (but the components in ``skip``: the two Kubeflow ones exclude each other)."""
    copy_dir = tmp_path / "k8s"
    shutil.copytree(K8S, copy_dir)
    path = copy_dir / "kustomization.yaml"
    text = path.read_text()
    enabled = re.sub(r"^# components:$", "components:", text, flags=re.M)
    enabled = re.sub(r"^#   - (components/\S+)", lambda m: m.group(0) if m.group(1) in skip else f"  - {m.group(1)}",
                     enabled, flags=re.M)
    assert enabled != text, "kustomization.yaml lost its commented-out components: block"
    path.write_text(enabled)
    return copy_dir


needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl is not installed: the kustomization is not rendered")


# -------------------------------------------------------------------------------- the pod's environment
def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values: defined names expand, others stay as
    written, $$ is a literal $."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _service_links(services: list[Doc]) -> dict[str, str]:
    """The variables the kubelet puts in every pod of the namespace unless ``enableServiceLinks: false``."""
    env: dict[str, str] = {}
    for k, svc in enumerate(services):
        if svc["spec"].get("clusterIP") == "None":
            continue
        name = svc["metadata"]["name"].upper().replace("-", "_")
        ip = f"10.96.0.{k + 10}"
        for n, port in enumerate(svc["spec"]["ports"]):
            number, proto = port["port"], port.get("protocol", "TCP")
            if n == 0:
                env[f"{name}_SERVICE_HOST"], env[f"{name}_SERVICE_PORT"] = ip, str(number)
                env[f"{name}_PORT"] = f"{proto.lower()}://{ip}:{number}"
            if "name" in port:
                env[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(number)
            prefix = f"{name}_PORT_{number}_{proto}"
            env[prefix] = f"{proto.lower()}://{ip}:{number}"
            env[f"{prefix}_PROTO"], env[f"{prefix}_PORT"], env[f"{prefix}_ADDR"] = proto.lower(), str(number), ip
    return env


def _pod_env(docs: list[Doc], pod_spec: Doc, container: Doc, pod_name: str, index: str = "0",
             extra: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment: what every pod gets (its hostname, the API server's Service), the
    service links when enabled, what an operator adds (``extra``), then the container's own ``env``."""
    env = {"HOSTNAME": pod_name, "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443",
           **(extra or {})}
    if pod_spec.get("enableServiceLinks", True):
        env.update(_service_links([d for d in docs if d["kind"] == "Service"]))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(str(var["value"]), env)
            continue
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        values = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE, "status.podIP": "10.1.2.3",
                  f"metadata.annotations['{JOB_INDEX}']": index}
        assert path in values, f"{container['name']}: env {var['name']} from an unexpected field {path}"
        env[var["name"]] = values[path]
    return env


def _argv(container: Doc, env: dict[str, str]) -> list[str]:
    """The process's argv: command (or the image's entrypoint) + args, expanded."""
    command = container.get("command") or _dockerfile_json("ENTRYPOINT")
    argv = [_expand(a, env) for a in [*command, *container.get("args", [])]]
    if argv[:2] == ["tini", "--"]:  # the image's init (PID 1): the process it runs is what we check
        argv = argv[2:]
    left = [a for a in argv if re.search(r"\$\([A-Za-z_]\w*\)", a)]
    assert not left, f"{container['name']}: undefined $(VAR) in {left}"
    return argv


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """os.environ as in the pod: the commands' config loaders read TIGANA_* from it, torchrun PET_*."""
    with mock.patch.dict(os.environ, env, clear=True):
        yield


def _parse(parser: argparse.ArgumentParser, argv: list[str], what: str) -> argparse.Namespace:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{what} {' '.join(argv)}: {err.getvalue().strip()}")


def _tigana_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser ``tigana`` builds for ``argv`` (cli.main: find the subcommand, let its module add its flags)."""
    parser = cli.build_parser()
    known, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    assert getattr(known, "_module", None), f"tigana {' '.join(argv)}: no subcommand"
    module = importlib.import_module(known._module)
    parser = cli.build_parser()
    cli._attach(parser, argv, module)
    return parser


def _tigana(argv: list[str]) -> argparse.Namespace:
    return _parse(_tigana_parser(argv), argv, "tigana")


def _torchrun(argv: list[str]) -> argparse.Namespace:
    from torch.distributed.run import get_args_parser

    return _parse(get_args_parser(), argv, "torchrun")


# ------------------------------------------------------------------------------------------- helpers
def _quantity(text: str | int) -> float:
    """A Kubernetes quantity (memory: Ki/Mi/Gi/Ti, k/M/G/T, plain)."""
    m = re.fullmatch(r"([0-9.]+)([KMGT]i?|[kmgt])?", str(text))
    assert m, f"not a quantity: {text}"
    unit = m.group(2) or ""
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return float(m.group(1)) * scale[unit]


def _target_port(svc_port: Doc, container: Doc) -> int:
    target = svc_port.get("targetPort", svc_port["port"])
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    if isinstance(target, str):
        assert target in ports, f"targetPort {target!r} is no named port of container {container['name']}"
        return ports[target]
    return int(target)


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _services_of(docs: list[Doc], labels: dict[str, str]) -> list[Doc]:
    return [d for d in docs if d["kind"] == "Service" and _selects(d["spec"].get("selector", {}), labels)]


def _grpc_probe(container: Doc, kind: str) -> tuple[int, str]:
    probe = container.get(kind)
    assert probe and "grpc" in probe, f"{container['name']}: {kind} is not a native gRPC probe"
    return probe["grpc"]["port"], probe["grpc"].get("service", "")


def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of tools/k8s/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (K8S / "Dockerfile").read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def _dockerfile_json(instruction: str) -> list[str]:
    values = [json.loads(a) for i, a in _dockerfile() if i == instruction]
    assert len(values) == 1, f"expected one {instruction} in JSON form"
    return values[0]


def _image_user() -> tuple[int, int]:
    users = [a for i, a in _dockerfile() if i == "USER"]
    assert users and re.fullmatch(r"\d+:\d+", users[-1]), "USER must be numeric uid:gid (runAsNonRoot checks it)"
    uid, gid = (int(x) for x in users[-1].split(":"))
    return uid, gid


def _pod_specs(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """(resource, pod spec) of every pod template."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield d, d["spec"]["template"]["spec"]
        elif d["kind"] == "PyTorchJob":
            for spec in d["spec"]["pytorchReplicaSpecs"].values():
                yield d, spec["template"]["spec"]


# ------------------------------------------------------------------------------------ files and schemas
def test_every_yaml_file_parses_into_named_resources() -> None:
    files = _yaml_files()
    assert {p.name for p in files} >= {"kustomization.yaml", "scheduler.yaml", "shard.yaml", "etcd.yaml",
                                       "trainer-job.yaml", "pytorchjob.yaml"}
    for path in files:
        docs = _load(path)
        assert docs, f"{path} holds no document"
        for d in docs:
            assert isinstance(d, dict) and d.get("apiVersion") and d.get("kind"), f"{path}: {d!r:.80}"
            if d["kind"] not in KUSTOMIZE_KINDS:
                assert d["metadata"]["name"].startswith("tigana-"), f"{path}: {d['metadata']['name']}"
                assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "tigana", path


def _schema_cases() -> list[Any]:
    cases = []
    for p in _yaml_files():
        for d in _load(p):
            if d["kind"] not in KUSTOMIZE_KINDS:
                cases.append(pytest.param(d, id=f"{p.relative_to(K8S)}:{d['kind']}/{d['metadata']['name']}"))
    return cases


@pytest.mark.parametrize("doc", _schema_cases())
def test_resource_validates_against_the_kubernetes_schemas(doc: Doc) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    if (doc["apiVersion"], doc["kind"]) in CRDS:
        with pytest.raises(kv.SchemaNotFoundError):
            kv.validate(doc, kv.latest_version(), strict=True)
        pytest.skip(f"{doc['kind']} ({doc['apiVersion']}) is a CRD without a schema in kubernetes-validate: "
                    "checked structurally (test_pytorchjob_structure, test_trainers_as_a_trainjob, "
                    "test_podmonitors_scrape_every_metrics_port)")
    for version in (MIN_K8S, kv.latest_version()):
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"Kubernetes {version}: {exc}")


def test_pytorchjob_structure() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    job = _one(_raw(), "PyTorchJob", "tigana-train")
    assert job["apiVersion"] == "kubeflow.org/v1"
    spec = job["spec"]
    assert set(spec) <= {"nprocPerNode", "runPolicy", "pytorchReplicaSpecs", "elasticPolicy"}
    assert isinstance(spec["nprocPerNode"], str) and spec["nprocPerNode"].isdigit()  # a string in the CRD
    assert set(spec["runPolicy"]) <= {"backoffLimit", "cleanPodPolicy", "ttlSecondsAfterFinished",
                                      "activeDeadlineSeconds", "schedulingPolicy", "suspend", "managedBy"}
    assert spec["runPolicy"]["cleanPodPolicy"] in ("All", "Running", "None")
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] >= 0
    for rtype, rspec in replicas.items():
        assert set(rspec) <= {"replicas", "restartPolicy", "template"}, rtype
        assert rspec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode"), rtype
        assert _container(rspec["template"]["spec"], "pytorch"), f"{rtype}: the operator needs container 'pytorch'"
        # the pod template itself is core Kubernetes: validate it as a PodTemplate
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"tigana-train-{rtype.lower()}"},
                   "template": rspec["template"]}
        for version in (MIN_K8S, kv.latest_version()):
            kv.validate(wrapped, version, strict=True)
    master = _container(replicas["Master"]["template"]["spec"], "pytorch")
    worker = _container(replicas["Worker"]["template"]["spec"], "pytorch")
    assert {"name": "pytorchjob-port", "containerPort": PYTORCHJOB_PORT} in master["ports"]
    assert master["command"] == worker["command"] and master["args"] == worker["args"]
    inits = [r["template"]["spec"]["initContainers"] for r in replicas.values()]
    assert inits[0] == inits[1]


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


def test_labels_selectors_and_services_hang_together() -> None:
    docs = _raw()
    _check_selectors(docs)
    _check_statefulsets(docs)


def test_service_links_are_off_as_their_names_collide_with_tigana_settings() -> None:
    """The kubelet's service variables of Service tigana-X are TIGANA_X_...: the TIGANA_ prefix the command
    line and the config loaders read settings from (the scheduler reads TIGANA_SCHEDULER_PORT itself)."""
    docs = _raw()
    links = _service_links([d for d in docs if d["kind"] == "Service"])
    assert "TIGANA_SCHEDULER_PORT" in links and all(k.startswith("TIGANA_") for k in links)
    for resource, spec in _pod_specs(docs):
        assert spec.get("enableServiceLinks") is False, f"{resource['kind']} {resource['metadata']['name']}"


def test_pods_run_as_the_image_user() -> None:
    uid, gid = _image_user()
    assert uid != 0 and gid != 0
    for resource, spec in _pod_specs(_raw()):
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True, resource["metadata"]["name"]
        if any(c["image"].split(":")[0] in IMAGES for c in spec["containers"]):
            assert (sc["runAsUser"], sc["runAsGroup"]) == (uid, gid), resource["metadata"]["name"]
            assert sc.get("fsGroup", gid) == gid, resource["metadata"]["name"]
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]


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

    # at least --replicas + 1 servers (a slot's copies live on distinct servers), and what the first
    # placement waits for
    sched = _scheduler_config(docs)
    assert spec["replicas"] >= sched.replicas + 1 and spec["replicas"] >= sched.expect_servers


def test_shard_servers() -> None:
    _check_shards(_raw())


def test_the_shard_readiness_names_are_served(make_shard_server) -> None:
    """The health names the probes ask for are registered by a real shard server (NOT_FOUND otherwise)."""
    handle = make_shard_server(port=0)
    channel = grpc.insecure_channel(handle.address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", COPIES_HEALTH_NAME):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
    finally:
        channel.close()


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


def test_scheduler() -> None:
    _check_scheduler(_raw())


def test_scheduler_store_is_the_etcd_service() -> None:
    """--store names the etcd Service, on a port whose target is the one etcd serves clients on."""
    docs = _raw()
    [(host, port)], _prefix = parse_store_url(_scheduler_config(docs).store)  # the scheduler's own reading
    svc = _one(docs, "Service", host)
    etcd = _one(docs, "StatefulSet", "tigana-etcd")
    assert _selects(svc["spec"]["selector"], etcd["spec"]["template"]["metadata"]["labels"])
    container = _container(etcd["spec"]["template"]["spec"], "etcd")
    target = _target_port(next(p for p in svc["spec"]["ports"] if p["port"] == port), container)
    assert f"--listen-client-urls=http://0.0.0.0:{target}" in container["command"]


def test_the_scheduler_health_names_are_served(tmp_path: Path) -> None:
    """The names the scheduler's probes ask for are registered by a real scheduler (here a lone one on a file
    store, which leads: both SERVING)."""
    handle = start_scheduler(SchedulerConfig(port=0, data_dir=str(tmp_path)))
    channel = grpc.insecure_channel(handle.address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", SCHEDULER_HEALTH_NAME):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
    finally:
        channel.close()
        handle.close()


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


def test_trainers_as_an_indexed_job() -> None:
    _check_trainer_job(_raw())


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


def test_trainers_as_a_pytorchjob() -> None:
    _check_pytorchjob(_raw())


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


def test_trainers_as_a_trainjob() -> None:
    _check_trainjob(_raw())


def test_podmonitors_scrape_every_metrics_port() -> None:
    """Prometheus Operator ignores the prometheus.io annotations: a PodMonitor per component selects its pods
    and names a port every container of them declares."""
    docs = _raw()
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"tigana-scheduler", "tigana-shard", "tigana-train"}
    for monitor in monitors:
        [endpoint] = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["path"] == "/metrics"
        templates = [t for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job") for t in [d["spec"]["template"]]]
        templates += [r["template"] for d in docs if d["kind"] == "PyTorchJob"
                      for r in d["spec"]["pytorchReplicaSpecs"].values()]
        selected = [t for t in templates if _selects(monitor["spec"]["selector"]["matchLabels"], t["metadata"]["labels"])]
        assert selected, monitor["metadata"]["name"]
        for template in selected:
            for c in template["spec"]["containers"]:
                assert endpoint["port"] in {p.get("name") for p in c.get("ports", [])}, c["name"]


@needs_kubectl
def test_kustomize_renders_the_trainjob_and_podmonitors(tmp_path: Path) -> None:
    docs = _kustomize(_with_components(tmp_path, skip=("components/kubeflow",)))
    assert _maybe(docs, "Job", "tigana-train") is None and _maybe(docs, "PyTorchJob", "tigana-train") is None
    _check_trainjob(docs)
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "PodMonitor"} == {
        "tigana-scheduler", "tigana-shard", "tigana-train"}
    _check_rendered(docs)


def test_the_trainers_wait_until_a_real_cluster_is_placed(tmp_path: Path, make_shard_server) -> None:
    """The init container's check, run against a real scheduler: it holds before any server registered (no
    slot has a server) and lets the trainers go once one has and the scheduler placed the slots."""
    argv, text = _wait_for_cluster(_raw(), _one(_raw(), "Job", "tigana-train")["spec"]["template"]["spec"])
    sched = start_scheduler(SchedulerConfig(port=0, data_dir=str(tmp_path / "sched"), replicas=0,
                                            expect_servers=1, bootstrap_wait_s=0.0))
    argv = [sched.address if a == argv[argv.index("--scheduler") + 1] else a for a in argv]

    def check() -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), _environ({}):
            rc = cli.main(argv)
        return rc, out.getvalue()

    try:
        rc, out = check()
        assert rc == 0 and '"unavailable_slots": 4096' in out and text not in out
        make_shard_server(port=0, scheduler=sched.address, heartbeat_interval_s=0.1)
        deadline = time.monotonic() + 20
        while text not in check()[1]:
            assert time.monotonic() < deadline, "the cluster was never reported placed"
            time.sleep(0.2)
    finally:
        sched.close()


# the image (tools/k8s/Dockerfile): tests/tools/test_dockerfile.py
# ------------------------------------------------------------------------------------ the kustomization
def test_kustomization_lists_every_file_and_names_what_exists() -> None:
    listed: set[Path] = set()
    kustomizations = [p for p in _yaml_files() if p.name == "kustomization.yaml"]
    assert K8S / "kustomization.yaml" in kustomizations
    for path in kustomizations:
        k = _load(path)[0]
        assert k["kind"] in KUSTOMIZE_KINDS
        for entry in k.get("resources", []):
            assert (path.parent / entry).is_file(), f"{path}: {entry}"
            listed.add((path.parent / entry).resolve())
    orphans = {p for p in _yaml_files() if p.name != "kustomization.yaml"} - listed
    assert not orphans, f"not in any kustomization: {orphans}"
    top = _load(K8S / "kustomization.yaml")[0]
    text = (K8S / "kustomization.yaml").read_text()
    for component in re.findall(r"^#   - (components/\S+)", text, re.M):
        assert _load(K8S / component / "kustomization.yaml")[0]["kind"] == "Component", component
    docs = _raw()
    for r in top["replicas"]:
        assert [d for d in docs if d["metadata"]["name"] == r["name"] and d["kind"] in ("Deployment", "StatefulSet")]
    images = {c["image"] for _, spec in _pod_specs(docs) for c in spec["containers"]}
    assert {i["name"] for i in top["images"]} <= images


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


@needs_kubectl
def test_kustomize_renders_the_cluster_with_the_counts_it_sets() -> None:
    docs = _kustomize(K8S)
    top = _load(K8S / "kustomization.yaml")[0]
    counts = {r["name"]: r["count"] for r in top["replicas"]}
    assert _one(docs, "Deployment", "tigana-scheduler")["spec"]["replicas"] == counts["tigana-scheduler"]
    assert _one(docs, "StatefulSet", "tigana-shard")["spec"]["replicas"] == counts["tigana-shard"]
    images = {f"{i['newName']}:{i['newTag']}" for i in top["images"]}
    for _, spec in _pod_specs(docs):
        for c in spec["containers"]:
            assert c["image"] not in IMAGES, "the images: entry did not apply"
            if c["name"] != "etcd":
                assert c["image"] in images
    assert _maybe(docs, "PyTorchJob", "tigana-train") is None
    _check_rendered(docs)
    _check_trainer_job(docs)


@needs_kubectl
def test_kustomize_renders_the_components(tmp_path: Path) -> None:
    docs = _kustomize(_with_components(tmp_path, skip=("components/kubeflow-trainer",)))
    # external-etcd: no etcd of ours, --store names the external endpoints
    assert not [d for d in docs if "etcd" in d["metadata"]["name"]]
    endpoints, _prefix = parse_store_url(_scheduler_config(docs).store)
    assert len(endpoints) == 3 and "tigana-etcd" not in {host for host, _ in endpoints}
    # kubeflow: a PyTorchJob instead of the Job and its Service
    assert _maybe(docs, "Job", "tigana-train") is None and _maybe(docs, "Service", "tigana-train") is None
    _check_pytorchjob(docs)
    _check_rendered(docs)


@needs_kubectl
def test_trainer_count_patch_keeps_the_numbers_together(tmp_path: Path) -> None:
    """Changing the trainer count as the kustomization says (its three numbers) renders a consistent Job."""
    copy_dir = tmp_path / "k8s"
    shutil.copytree(K8S, copy_dir)
    path = copy_dir / "kustomization.yaml"
    text = path.read_text()
    changed = re.sub(r"(completions|parallelism): 2\b", r"\1: 4", text)
    changed = changed.replace('value: "2"', 'value: "4"')
    assert changed.count("4") - text.count("4") == 3
    path.write_text(changed)
    docs = _kustomize(copy_dir)
    assert _one(docs, "Job", "tigana-train")["spec"]["completions"] == 4
    _check_trainer_job(docs)


# ------------------------------------------------------------------------------------------ the README
def test_readme_commands_are_kubectl_docker_or_parse_as_tigana() -> None:
    text = (K8S / "README.md").read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    assert blocks
    commands = 0
    for lang, body in blocks:
        if lang == "yaml":
            snippet = yaml.safe_load(body)
            for component in snippet.get("components", []):
                assert (K8S / component / "kustomization.yaml").is_file(), component
            continue
        assert lang == "sh", f"a code block of unknown kind {lang!r}"
        for line in body.replace("\\\n", " ").splitlines():
            words = line.split("#")[0].split()
            if not words:
                continue
            commands += 1
            if words[0] == "tigana" or (words[0] == "kubectl" and "--" in words):
                tail = words[words.index("--") + 1:] if "--" in words else words
                assert tail[0] == "tigana", line
                with _environ({}):
                    _tigana(tail[1:])
            elif words[:2] in (["kubectl", "apply"], ["kubectl", "kustomize"]):
                target = words[words.index("-k") + 1] if "-k" in words else words[2]
                assert (ROOT / target / "kustomization.yaml").is_file(), line
            elif words[:2] == ["docker", "build"]:
                assert (ROOT / words[words.index("-f") + 1]).is_file() and words[-1] == ".", line
            else:
                assert words[0] in ("kubectl", "docker"), f"README command not covered: {line}"
    assert commands >= 5


def test_components_patch_what_the_base_defines() -> None:
    """Every patch of a component names a resource (and container) of the base, so enabling it cannot
    silently miss."""
    docs = _raw()
    for path in (K8S / "components").glob("*/kustomization.yaml"):
        for patch in _load(path)[0].get("patches", []):
            target = yaml.safe_load(patch["patch"])
            base = _maybe(docs, target["kind"], target["metadata"]["name"])
            assert base is not None, f"{path}: patches {target['kind']} {target['metadata']['name']}: undefined"
            if target.get("$patch") != "delete":
                for c in target["spec"]["template"]["spec"]["containers"]:
                    container = _container(base["spec"]["template"]["spec"], c["name"])
                    names = {v["name"] for v in container.get("env", [])}
                    assert {v["name"] for v in c.get("env", [])} <= names, f"{path}: {c['name']}"
