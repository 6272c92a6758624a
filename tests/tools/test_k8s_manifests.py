"""tools/k8s: the files, the resources and the kustomization.

Every YAML file parses; every resource validates offline against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields fail) except the Kubeflow CRD, checked structurally; labels, selectors, Services,
volumes and the kustomization hang together; the README's commands are kubectl, docker or parse as ``tigana``.
``kubectl kustomize`` renders the kustomization, with and without its components, when kubectl is installed.
The daemons' and the trainers' command lines, ports, probes and health names: test_k8s_daemons.py and
test_k8s_trainers.py; what they share: k8s_manifests.py (loading, the pod's environment, the parsers) and
k8s_checks.py (the checks run on the manifests as written and as rendered).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_checks import (
    _check_pytorchjob,
    _check_rendered,
    _check_selectors,
    _check_statefulsets,
    _check_trainer_job,
    _check_trainjob,
    _scheduler_config,
)
from k8s_manifests import (
    CRDS,
    IMAGES,
    K8S,
    KUSTOMIZE_KINDS,
    MIN_K8S,
    PYTORCHJOB_PORT,
    ROOT,
    Doc,
    _container,
    _environ,
    _image_user,
    _kustomize,
    _load,
    _maybe,
    _one,
    _pod_specs,
    _raw,
    _selects,
    _service_links,
    _tigana,
    _with_components,
    _yaml_files,
    needs_kubectl,
)

from tigana.ps.scheduler.stores.etcd import parse_store_url


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


def test_podmonitors_scrape_every_metrics_port() -> None:
    """Prometheus Operator ignores the prometheus.io annotations: a PodMonitor per component selects its pods
    and names a port every container of them declares."""
    docs = _raw()
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"tigana-scheduler", "tigana-shard", "tigana-train",
                                                        "tigana-serving"}
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


@needs_kubectl
def test_kustomize_renders_the_trainjob_and_podmonitors(tmp_path: Path) -> None:
    docs = _kustomize(_with_components(tmp_path, skip=("components/kubeflow",)))
    assert _maybe(docs, "Job", "tigana-train") is None and _maybe(docs, "PyTorchJob", "tigana-train") is None
    _check_trainjob(docs)
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "PodMonitor"} == {
        "tigana-scheduler", "tigana-shard", "tigana-train", "tigana-serving"}
    _check_rendered(docs)


@needs_kubectl
def test_kustomize_renders_the_serving_component(tmp_path: Path) -> None:
    """components/serving alone: the trainers publish into the shared volume, one follower writes it, several
    servers read it behind one Service, and each command line parses as tigana's."""
    docs = _kustomize(_with_components(tmp_path, skip=("components/kubeflow", "components/kubeflow-trainer",
                                                       "components/external-etcd",
                                                       "components/prometheus-operator")))
    trainer = _container(_one(docs, "Job", "tigana-train")["spec"]["template"]["spec"], "trainer")
    assert "--publish-dir=/published" in trainer["args"]
    assert {"name": "published", "mountPath": "/published"} in trainer["volumeMounts"]
    publish = _one(docs, "Deployment", "tigana-publish")
    assert publish["spec"]["replicas"] == 1 and publish["spec"]["strategy"]["type"] == "Recreate"
    serving = _one(docs, "Deployment", "tigana-serving")
    assert serving["spec"]["replicas"] >= 2
    assert _one(docs, "Service", "tigana-serving")["spec"]["selector"] == serving["spec"]["selector"]["matchLabels"]
    assert _one(docs, "PersistentVolumeClaim", "tigana-published")["spec"]["accessModes"] == ["ReadWriteMany"]
    for deployment, name in ((publish, "publish"), (serving, "serving")):
        _tigana(_container(deployment["spec"]["template"]["spec"], name)["args"])  # every flag is the command's
    _check_rendered(docs)


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
            if isinstance(target, list):  # a JSON patch (RFC 6902): its target names the resource
                base = _maybe(docs, patch["target"]["kind"], patch["target"]["name"])
                assert base is not None, f"{path}: patches {patch['target']}: undefined"
                for op in target:  # every op's parent path exists in the base (an add to a list appends)
                    node = base
                    for key in op["path"].strip("/").split("/")[:-1]:
                        node = node[int(key)] if isinstance(node, list) else node[key]
                    assert isinstance(node, list if op["path"].endswith("/-") else (dict, list)), f"{path}: {op}"
                continue
            base = _maybe(docs, target["kind"], target["metadata"]["name"])
            assert base is not None, f"{path}: patches {target['kind']} {target['metadata']['name']}: undefined"
            if target.get("$patch") != "delete":
                for c in target["spec"]["template"]["spec"]["containers"]:
                    container = _container(base["spec"]["template"]["spec"], c["name"])
                    names = {v["name"] for v in container.get("env", [])}
                    assert {v["name"] for v in c.get("env", [])} <= names, f"{path}: {c['name']}"
