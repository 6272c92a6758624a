"""tools/k8s as the k8s tests read it: the YAML files loaded (or rendered by ``kubectl kustomize``), the
environment a pod's container would have, and its command line parsed with the real ``tigana`` parser (and
torchrun's)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from tigana.tools import cli

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
NODE_NAME = "node-7"  # the node a checked pod runs on (downward API spec.nodeName)
ZONE_LABEL = "topology.kubernetes.io/zone"
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
             extra: dict[str, str] | None = None, zone: str = "") -> dict[str, str]:
    """The container's environment: what every pod gets (its hostname, the API server's Service), the
    service links when enabled, what an operator adds (``extra``), then the container's own ``env`` (the pod
    on node ``NODE_NAME``, with ``zone`` as its node's zone label: "" where Kubernetes does not copy it)."""
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
                  f"metadata.annotations['{JOB_INDEX}']": index, "spec.nodeName": NODE_NAME,
                  f"metadata.labels['{ZONE_LABEL}']": zone}
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
