"""deploy/kubernetes/ validated offline: the kustomize base renders, every object is valid for the API
server, and it is wired the way the code needs (issue 43, item 4).

- Rendering: :func:`render` applies the kustomize features the base uses (``namespace``,
  ``resources``, ``images``) and refuses any other, so the base stays plain manifests and this test
  sees what ``kubectl apply -k`` would send.
- Core kinds: the Kubernetes OpenAPI schemas that ``kubernetes-validate`` (PyPI) carries, in strict
  mode (an unknown field is an error, as kubectl's default field validation makes it), for the oldest
  Kubernetes release docs/kubernetes.md supports and the newest the package knows.
- ``RayCluster``: the ``openAPIV3Schema`` of KubeRay's CRD (``ray.io/v1``; vendored in
  ``schemas/ray.io_rayclusters.v1.json`` with its release and commit), made strict the same way, plus
  the admission checks KubeRay's operator applies itself (``utils/validation.go``).
- What a reader cares about: every pod non-root under the restricted Pod Security Standard, every
  Secret/ConfigMap/claim reference resolvable, one image everywhere, only variable names that
  something reads, the web tier's shared state (``REDIS_URL``, the database, the keys) in every web
  pod, probes on ``/healthz`` and ``/readyz``, resources on every container, least privilege per pod,
  and the Ray wiring (head Service and port, token, ``rayVersion``, GPUs and ``strata_worker``).
- Run, not only read: the web container's own script, with ``ray`` and the server stubbed, hands
  production Django an environment in which it answers the kubelet's probes (Host: the pod's
  address) and refuses other hosts; the init container's script waits for unapplied migrations and
  for the Ray head, and passes once both are there.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kube

import strata_env

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes"
SECRETS_EXAMPLE = BASE / "secrets.example.yaml"
CRD_FILE = Path(__file__).parent / "schemas" / "ray.io_rayclusters.v1.json"
DOCS = ROOT / "docs" / "kubernetes.md"

KUSTOMIZE_KEYS = frozenset({"apiVersion", "kind", "namespace", "resources", "images"})
CLUSTER_SCOPED = frozenset({"Namespace"})  # the only cluster-scoped kind the base may hold
# The oldest Kubernetes release docs/kubernetes.md supports, and the newest the package knows.
KUBERNETES_VERSIONS = ("1.30", kube.latest_version())
PLACEHOLDER = "REPLACE_ME"
# Variables set in the manifests that Strata's code does not read, and who does.
OTHER_READERS = {
    "DJANGO_SETTINGS_MODULE": "Django",
    "RAY_AUTH_MODE": "Ray (token authentication)",
    "RAY_AUTH_TOKEN": "Ray (token authentication)",
    "RAY_worker_niceness": "Ray's raylet (workers/config.py RAY_PROCESS_ENV)",
    "POD_IP": "the web container's script: its address joins STRATA_ALLOWED_HOSTS",
}


# ------------------------------------------------------------------------------------------ rendering
def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def image_name(reference: str) -> str:
    """``registry/name:tag@digest`` -> ``registry/name`` (a port in the registry is not a tag)."""
    name = reference.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def retag(node, images: list[dict]) -> None:
    """kustomize's ``images``: every image of a list under a ``containers`` or ``initContainers`` key,
    at any depth and in any kind (so the RayCluster's pod templates too), whose name matches."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    for image in images:
                        if image_name(container.get("image", "")) == image["name"]:
                            new = image.get("newName", image["name"])
                            if "digest" in image:
                                new += "@" + image["digest"]
                            elif "newTag" in image:
                                new += ":" + str(image["newTag"])
                            container["image"] = new
            retag(value, images)
    elif isinstance(node, list):
        for item in node:
            retag(item, images)


def images_in(node) -> list[str]:
    """The images of every ``containers``/``initContainers`` list in ``node``, at any depth."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                found += [container["image"] for container in value]
            found += images_in(value)
    elif isinstance(node, list):
        for item in node:
            found += images_in(item)
    return found


def render(base: Path = BASE) -> list[dict]:
    """The objects ``kubectl apply -k base`` sends, for the kustomize features listed in
    :data:`KUSTOMIZE_KEYS`; any other feature is an error naming it (teach this function first)."""
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZE_KEYS
    assert not unknown, f"kustomization.yaml uses {sorted(unknown)}; render() knows {sorted(KUSTOMIZE_KEYS)}"
    namespace = kustomization.get("namespace")
    out = []
    for relative in kustomization["resources"]:
        for doc in load_documents(base / relative):
            doc = copy.deepcopy(doc)
            if namespace and doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
            if namespace and doc["kind"] == "Namespace":
                doc["metadata"]["name"] = namespace  # kustomize renames the Namespace object too
            retag(doc, kustomization.get("images", []))
            out.append(doc)
    return out


OBJECTS = render()


def objects(kind: str) -> list[dict]:
    return [doc for doc in OBJECTS if doc["kind"] == kind]


def one(kind: str, name: str) -> dict:
    found = [doc for doc in objects(kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def ident(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def pod_specs() -> Iterator[tuple[str, dict]]:
    """Every pod template of the base: Deployments, the Job, the RayCluster's head and worker groups."""
    for doc in OBJECTS:
        if doc["kind"] in ("Deployment", "Job"):
            yield ident(doc), doc["spec"]["template"]["spec"]
        elif doc["kind"] == "RayCluster":
            yield f"{ident(doc)} head", doc["spec"]["headGroupSpec"]["template"]["spec"]
            for group in doc["spec"]["workerGroupSpecs"]:
                yield f"{ident(doc)} group {group['groupName']}", group["template"]["spec"]


def all_containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def containers() -> Iterator[tuple[str, dict]]:
    for where, spec in pod_specs():
        for container in all_containers(spec):
            yield f"{where} container {container['name']}", container


def container_of(kind: str, name: str, container: str) -> dict:
    doc = one(kind, name)
    spec = doc["spec"]["template"]["spec"]
    return next(c for c in all_containers(spec) if c["name"] == container)


def ray_cluster() -> dict:
    (cluster,) = objects("RayCluster")
    return cluster


def ray_group_containers() -> list[tuple[str, dict]]:
    cluster = ray_cluster()
    groups = [("head", cluster["spec"]["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in cluster["spec"]["workerGroupSpecs"]]
    return [(name, group["template"]["spec"]["containers"][0]) for name, group in groups]


def env_sources(container: dict) -> dict[str, dict]:
    """Name -> the ``env`` entry (value, secretKeyRef, fieldRef) of one container."""
    return {item["name"]: item for item in container.get("env", [])}


def secret_ref(container: dict, name: str) -> tuple[str, str] | None:
    ref = env_sources(container).get(name, {}).get("valueFrom", {}).get("secretKeyRef")
    return (ref["name"], ref["key"]) if ref else None


def config_data() -> dict[str, str]:
    return one("ConfigMap", "strata-config")["data"]


def example_secrets() -> dict[str, dict[str, str]]:
    return {doc["metadata"]["name"]: doc["stringData"] for doc in load_documents(SECRETS_EXAMPLE)}


def filled_secrets() -> dict[str, dict[str, str]]:
    """The example Secrets with stand-in values that production settings accept."""
    made = {"STRATA_SECRET_KEY": secrets.token_urlsafe(50), "STRATA_AUDIT_KEY": secrets.token_hex(32),
            "STRATA_MASTER_KEY": base64.b64encode(secrets.token_bytes(32)).decode(),
            "auth_token": secrets.token_hex(32)}
    return {name: {key: made.get(key, value.replace(PLACEHOLDER, "pw")) for key, value in data.items()}
            for name, data in example_secrets().items()}


def container_environment(container: dict, *, pod_ip: str, given: dict[str, dict[str, str]]) -> dict[str, str]:
    """What the container's processes see: the ConfigMaps of ``envFrom``, then ``env`` (values,
    Secret keys from ``given``, the pod's address), as the kubelet assembles it."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(one("ConfigMap", source["configMapRef"]["name"])["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif ref := item["valueFrom"].get("secretKeyRef"):
            env[item["name"]] = given[ref["name"]][ref["key"]]
        elif item["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[item["name"]] = pod_ip
        else:
            raise AssertionError(f"unhandled env source {item}")
    return env


# ------------------------------------------------------------------------------------------ schemas
def strict(schema):
    """``schema`` with unknown fields refused wherever it lists properties and does not preserve
    unknown fields: what the API server does with kubectl's default (strict) field validation, where a
    CRD's own schema would only prune the field silently."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = strict(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [strict(sub) for sub in value]
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def strip_descriptions(schema):
    """``schema`` without its ``description`` texts (a property that is *named* description stays)."""
    if isinstance(schema, list):
        return [strip_descriptions(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: ({name: strip_descriptions(sub) for name, sub in value.items()} if key == "properties"
                  else strip_descriptions(value))
            for key, value in schema.items() if not (key == "description" and isinstance(value, str))}


def vendor_crd(crd_yaml: Path, *, release: str, commit: str, target: Path = CRD_FILE) -> None:
    """Refresh the vendored schema from KubeRay's ``ray.io_rayclusters.yaml`` of ``release``."""
    crd = yaml.safe_load(crd_yaml.read_text())
    (v1,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    wrapper = {
        "source": "https://github.com/ray-project/kuberay",
        "path": "ray-operator/config/crd/bases/ray.io_rayclusters.yaml",
        "release": release, "commit": commit, "crd": crd["metadata"]["name"], "version": "v1",
        "note": ("spec.versions[name=v1].schema.openAPIV3Schema of the CRD, with its description texts removed "
                 "(they take no part in validation). Apache-2.0 (KubeRay). Refresh from a newer release's CRD "
                 "with tests/deploy/test_kubernetes.py vendor_crd()."),
        "openAPIV3Schema": strip_descriptions(v1["schema"]["openAPIV3Schema"]),
    }
    target.write_text(json.dumps(wrapper, indent=0) + "\n")


VENDORED = json.loads(CRD_FILE.read_text())
RAYCLUSTER_VALIDATOR = jsonschema.Draft202012Validator(strict(VENDORED["openAPIV3Schema"]))


def crd_errors(doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
            for error in sorted(RAYCLUSTER_VALIDATOR.iter_errors(doc), key=lambda e: list(map(str, e.path)))]


def kube_error(doc: dict, version: str) -> str | None:
    try:
        kube.validate(doc, version, strict=True)
    except kube.ValidationError as error:
        return f"{'.'.join(map(str, error.path))}: {error.message}"
    return None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def kuberay_admission_errors(cluster: dict) -> list[str]:
    """The checks KubeRay's operator makes before it builds any pod (``ValidateRayClusterSpec`` in
    ray-operator/controllers/ray/utils/validation.go, v1.7.0), for the fields this base uses."""
    spec, errors = cluster["spec"], []
    autoscaling = spec.get("enableInTreeAutoscaling", False)
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
    for name, group in groups:
        if not group["template"]["spec"].get("containers"):
            errors.append(f"{name}: no container")
        params, resources = group.get("rayStartParams", {}), group.get("resources", {})
        if resources and any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")):
            errors.append(f"{name}: resources in both rayStartParams and the group's resources")
        if "labels" in params:
            errors.append(f"{name}: rayStartParams['labels'] is not supported")
    for name, group in groups[1:]:
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if not autoscaling and (low is None or high is None):
            errors.append(f"{name}: minReplicas and maxReplicas are required without autoscaling")
        elif low is not None and high is not None and not 0 <= low <= group.get("replicas", low) <= high:
            errors.append(f"{name}: replicas outside {low}..{high}")
    names = [name for name, _ in groups[1:]]
    if len(set(names)) != len(names):
        errors.append(f"worker group names repeat: {names}")
    token = spec.get("authOptions", {}).get("mode") == "token"
    if token and _version(spec.get("rayVersion", "0")) < (2, 52, 0):
        errors.append("authOptions.mode token needs rayVersion 2.52.0 or later")
    return errors


# ------------------------------------------------------------------------------------------ tests: rendering
def test_the_kustomization_lists_every_manifest_and_never_a_secret():
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml", SECRETS_EXAMPLE.name}
    assert set(kustomization["resources"]) == on_disk
    assert not objects("Secret"), "Secrets are made in the cluster (secrets.example.yaml), never committed"
    assert {doc["metadata"].get("namespace") for doc in OBJECTS if doc["kind"] not in CLUSTER_SCOPED} == {"strata"}
    assert one("Namespace", "strata")


def test_render_refuses_a_kustomize_feature_it_does_not_apply(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\npatches: []\n")
    with pytest.raises(AssertionError, match="patches"):
        render(tmp_path)


@pytest.mark.parametrize(("reference", "name"), [
    ("strata", "strata"), ("strata:1.2", "strata"), ("strata@sha256:abc", "strata"), ("strata-web", "strata-web"),
    ("registry.example.com:5000/strata:1.2", "registry.example.com:5000/strata"),
])
def test_image_name_strips_tag_and_digest_only(reference, name):
    assert image_name(reference) == name


def test_one_image_everywhere_rewritten_by_the_kustomization():
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    raw = {image for relative in kustomization["resources"] for doc in load_documents(BASE / relative)
           for image in images_in(doc)}
    assert raw == {"strata"}, "the manifests name the image `strata`; only the kustomization says where it is"
    rendered = [image for doc in OBJECTS for image in images_in(doc)]
    assert set(rendered) == {"registry.example.com/strata:set-your-tag"}
    assert len(rendered) == len(list(containers()))  # the RayCluster's templates were rewritten too


# ------------------------------------------------------------------------------------------ tests: schemas
CORE = [doc for doc in OBJECTS if doc["kind"] != "RayCluster"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("doc", CORE, ids=ident)
def test_core_kinds_are_valid_for_the_api_server_in_strict_mode(doc, version):
    assert kube_error(doc, version) is None, kube_error(doc, version)


def test_kubernetes_validate_rejects_a_misspelt_field_and_knows_every_kind_here():
    broken = copy.deepcopy(one("Deployment", "strata-web"))
    broken["spec"]["replica"] = broken["spec"].pop("replicas")
    assert "replica" in (kube_error(broken, KUBERNETES_VERSIONS[-1]) or "")
    assert kube_error(one("Deployment", "strata-web"), KUBERNETES_VERSIONS[-1]) is None
    with pytest.raises(kube.SchemaNotFoundError):  # no silent pass for a kind it has no schema for
        kube.validate(ray_cluster(), KUBERNETES_VERSIONS[-1], strict=True)


def test_the_raycluster_is_valid_for_kuberays_crd():
    assert VENDORED["release"] and re.fullmatch(r"[0-9a-f]{40}", VENDORED["commit"])
    assert crd_errors(ray_cluster()) == []


def test_the_crd_schema_rejects_a_misspelt_field_and_a_wrong_type():
    typo = copy.deepcopy(ray_cluster())
    typo["spec"]["workerGroupSpecs"][0]["replica"] = typo["spec"]["workerGroupSpecs"][0].pop("replicas")
    assert any("replica" in error for error in crd_errors(typo))
    wrong = copy.deepcopy(ray_cluster())
    wrong["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "64 GB"
    assert any("memory" in error for error in crd_errors(wrong))
    assert crd_errors(ray_cluster()) == []


def test_the_raycluster_passes_kuberays_own_admission_checks():
    assert kuberay_admission_errors(ray_cluster()) == []
    both = copy.deepcopy(ray_cluster())
    both["spec"]["workerGroupSpecs"][0]["rayStartParams"]["resources"] = '\'{"strata_worker": 8}\''
    assert kuberay_admission_errors(both) == ["gpu: resources in both rayStartParams and the group's resources"]
    old = copy.deepcopy(ray_cluster())
    old["spec"]["rayVersion"] = "2.50.0"
    assert kuberay_admission_errors(old) == ["authOptions.mode token needs rayVersion 2.52.0 or later"]


def test_vendor_crd_keeps_the_v1_schema_without_description_texts(tmp_path):
    crd = {"metadata": {"name": "rayclusters.ray.io"}, "spec": {"versions": [
        {"name": "v1alpha1", "schema": {"openAPIV3Schema": {"type": "object"}}},
        {"name": "v1", "schema": {"openAPIV3Schema": {"type": "object", "description": "a RayCluster",
                                                      "properties": {"description": {"type": "string"}}}}}]}}
    (tmp_path / "crd.yaml").write_text(yaml.safe_dump(crd))
    vendor_crd(tmp_path / "crd.yaml", release="v9", commit="0" * 40, target=tmp_path / "out.json")
    schema = json.loads((tmp_path / "out.json").read_text())["openAPIV3Schema"]
    assert schema == {"type": "object", "properties": {"description": {"type": "string"}}}


# ------------------------------------------------------------------------------------------ tests: pods
def test_every_pod_and_container_is_non_root_under_the_restricted_pod_security_standard():
    namespace = one("Namespace", "strata")["metadata"]["labels"]
    assert namespace["pod-security.kubernetes.io/enforce"] == "restricted"
    checked = 0
    for where, spec in pod_specs():
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) != 0, where
        assert pod.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
        assert all("hostPath" not in volume for volume in spec.get("volumes", [])), where
        assert spec.get("automountServiceAccountToken") is False and spec.get("serviceAccountName") == "strata", where
        for container in all_containers(spec):
            context = container.get("securityContext", {})
            assert context.get("allowPrivilegeEscalation") is False, (where, container["name"])
            assert context.get("capabilities", {}).get("drop") == ["ALL"], (where, container["name"])
            assert not context.get("capabilities", {}).get("add"), (where, container["name"])
            assert not context.get("privileged") and context.get("runAsUser", 1) != 0, (where, container["name"])
            checked += 1
    assert checked == len(list(containers())) == 9  # 3 Deployments (with init), the Job, Ray head and workers


def test_every_container_has_cpu_and_memory_requests_and_limits():
    for where, container in containers():
        resources = container.get("resources", {})
        for side in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources.get(side, {})), (where, side)


def test_the_control_plane_writes_only_its_scratch_volumes():
    """Web, sampler, Celery and migrate run with a read-only root: what they write (STRATA_HOME,
    Ray's /tmp/ray) is an emptyDir, and the weights are mounted read-only."""
    for where, spec in pod_specs():
        if "RayCluster" in where:
            continue
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        for container in all_containers(spec):
            assert container["securityContext"].get("readOnlyRootFilesystem") is True, (where, container["name"])
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/var/lib/strata"]["name"]], where
            assert "emptyDir" in volumes[mounts["/tmp"]["name"]], where
            if "/var/lib/strata/weights" in mounts:
                assert mounts["/var/lib/strata/weights"].get("readOnly") is True, where


def test_every_reference_resolves_secrets_configmaps_claims_and_accounts():
    known_secrets = example_secrets()
    cluster = ray_cluster()
    token_secret = cluster["spec"]["authOptions"]["secretName"]
    assert "auth_token" in known_secrets[token_secret]  # KubeRay reads that key (RAY_AUTH_TOKEN_SECRET_KEY)
    names = {(doc["kind"], doc["metadata"]["name"]) for doc in OBJECTS}
    used = set()
    for where, spec in pod_specs():
        assert ("ServiceAccount", spec["serviceAccountName"]) in names, where
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names, where
        for container in all_containers(spec):
            for source in container.get("envFrom", []):
                assert ("ConfigMap", source["configMapRef"]["name"]) in names, where
            for item in container.get("env", []):
                if ref := item.get("valueFrom", {}).get("secretKeyRef"):
                    assert ref["key"] in known_secrets.get(ref["name"], {}), (where, ref)
                    assert not ref.get("optional"), (where, ref)  # a missing key must stop the pod, not blank it
                    used.add((ref["name"], ref["key"]))
    used.add((token_secret, "auth_token"))
    listed = {(name, key) for name, data in known_secrets.items() for key in data}
    assert listed == used, f"listed in secrets.example.yaml but read by nobody: {sorted(listed - used)}"


def test_the_example_secrets_hold_placeholders_only():
    for name, data in example_secrets().items():
        for key, value in data.items():
            assert PLACEHOLDER in value, f"{name}.{key} looks like a real value: keep real secrets out of git"


class _Recording(dict):
    """An empty environment that records every name looked up."""

    def __init__(self) -> None:
        super().__init__()
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return default

    def __getitem__(self, key):
        self.read.add(key)
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return False


def names_strata_reads() -> set[str]:
    """Every variable Strata's views read (strata_env's control plane and worker views, the switches)."""
    recorder = _Recording()
    strata_env.load(recorder)
    strata_env.load_worker(recorder)
    strata_env.sampler(recorder)
    strata_env.warm_replicas(recorder)
    return recorder.read


def test_every_variable_set_is_one_that_something_reads():
    readable = names_strata_reads() | set(OTHER_READERS)
    assert "STRATA_L2MB" not in readable and "STRATA_L2_MB" in readable  # the check can tell a typo
    set_names = set(config_data())
    for _, container in containers():
        set_names |= set(env_sources(container))
    assert set_names - readable == set()


def test_the_web_tier_shares_its_state_through_the_database_redis_and_one_set_of_keys():
    web = container_of("Deployment", "strata-web", "web")
    assert one("Deployment", "strata-web")["spec"]["replicas"] >= 2
    # Shared by every web process: without REDIS_URL each pod keeps its own rate limits and lockouts.
    for name in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"):
        assert secret_ref(web, name) == ("strata-connections", name), name
    for name in ("STRATA_SECRET_KEY", "STRATA_AUDIT_KEY", "STRATA_MASTER_KEY"):
        assert secret_ref(web, name) == ("strata-keys", name), name
    celery = container_of("Deployment", "strata-celery", "celery")
    for name in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "STRATA_AUDIT_KEY", "STRATA_MASTER_KEY"):
        assert secret_ref(celery, name) == secret_ref(web, name), name
    # No key is left to a file in the per-pod home (each pod would generate its own).
    for where, container in containers():
        assert not any(name.endswith("_FILE") for name in env_sources(container)), where
    assert not any(name.endswith("_FILE") for name in config_data())


def test_exactly_one_process_runs_the_sampler_and_it_is_not_behind_the_service():
    sampler_deployment = one("Deployment", "strata-sampler")
    assert sampler_deployment["spec"]["replicas"] == 1
    assert sampler_deployment["spec"]["strategy"]["type"] == "Recreate"
    running = [where for where, c in containers() if env_sources(c).get("STRATA_SAMPLER", {}).get("value") == "1"]
    assert running == ["Deployment/strata-sampler container web"]
    assert "STRATA_SAMPLER" not in config_data()
    selector = one("Service", "strata-web")["spec"]["selector"]
    labels = {name: one("Deployment", name)["spec"]["template"]["metadata"]["labels"]
              for name in ("strata-web", "strata-sampler", "strata-celery")}
    assert selector.items() <= labels["strata-web"].items()
    assert not selector.items() <= labels["strata-sampler"].items()
    assert not selector.items() <= labels["strata-celery"].items()


def test_the_sampler_pod_is_the_web_pod_plus_the_sampler_switch():
    web = copy.deepcopy(one("Deployment", "strata-web")["spec"]["template"]["spec"])
    sampler_pod = copy.deepcopy(one("Deployment", "strata-sampler")["spec"]["template"]["spec"])
    server = sampler_pod["containers"][0]
    server["env"] = [item for item in server["env"] if item["name"] != "STRATA_SAMPLER"]
    web.pop("topologySpreadConstraints")
    assert sampler_pod == web


def test_the_service_and_probes_reach_the_web_servers_port():
    web = container_of("Deployment", "strata-web", "web")
    ports = {port["name"]: port["containerPort"] for port in web["ports"]}
    service = one("Service", "strata-web")
    assert service["spec"]["ports"][0]["targetPort"] in ports
    assert f"--port {ports['http']}" in web["args"][0]
    assert web["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert web["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert web["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    rolling = one("Deployment", "strata-web")["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0
    pdb = one("PodDisruptionBudget", "strata-web")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= \
        one("Deployment", "strata-web")["spec"]["template"]["metadata"]["labels"].items()


def test_every_long_running_container_has_a_liveness_probe():
    for where, spec in pod_specs():
        if where.startswith("Job/"):
            continue
        for container in spec["containers"]:
            assert "livenessProbe" in container, where
    for name, container in ray_group_containers():  # ours, not KubeRay's (they ask Ray's dashboard agent)
        assert "readinessProbe" in container and "livenessProbe" in container, name


def test_each_pod_gets_only_the_secrets_it_needs():
    holders: dict[tuple[str, str], set[str]] = {}
    for where, container in containers():
        for item in container.get("env", []):
            if ref := item.get("valueFrom", {}).get("secretKeyRef"):
                holders.setdefault((ref["name"], ref["key"]), set()).add(where.split(" container ")[0])
    # The schema owner's URL: the migrate Job alone.
    assert holders[("strata-connections", "MIGRATE_DATABASE_URL")] == {"Job/strata-migrate"}
    # L3: the replicas alone; they never see the database or the Django and audit keys.
    assert holders[("strata-connections", "STRATA_L3_URL")] == {"RayCluster/strata-ray group gpu"}
    assert "RayCluster/strata-ray group gpu" in holders[("strata-keys", "STRATA_MASTER_KEY")]
    for key in (("strata-connections", "DATABASE_URL"), ("strata-keys", "STRATA_SECRET_KEY"),
                ("strata-keys", "STRATA_AUDIT_KEY")):
        assert not any(holder.startswith("RayCluster/") for holder in holders[key]), key
    assert "Job/strata-migrate" not in holders[("strata-keys", "STRATA_AUDIT_KEY")]  # it appends no audit event


# ------------------------------------------------------------------------------------------ tests: Ray
def test_ray_address_is_the_head_service_and_its_gcs_port():
    cluster = ray_cluster()
    host, port = config_data()["RAY_ADDRESS"].rsplit(":", 1)
    assert host == f"{cluster['metadata']['name']}-head-svc"  # KubeRay's name for the head Service
    head = cluster["spec"]["headGroupSpec"]
    gcs = int(head["rayStartParams"].get("port", 6379))
    assert int(port) == gcs
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports["gcs-server"] == gcs


def test_ray_version_is_the_one_the_image_installs():
    pinned = re.search(r"^ray==(\S+)$", (ROOT / "requirements.txt").read_text(), re.MULTILINE).group(1)
    assert ray_cluster()["spec"]["rayVersion"] == pinned


def test_every_ray_node_and_driver_uses_the_one_token():
    cluster = ray_cluster()
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": "strata-ray-token"}
    starters = [(where, c) for where, c in containers() if "ray start" in " ".join(c.get("args", []))]
    assert {where.split(" container ")[0] for where, _ in starters} == {
        "Deployment/strata-web", "Deployment/strata-sampler", "Deployment/strata-celery"}
    for where, container in starters:
        assert env_sources(container)["RAY_AUTH_MODE"]["value"] == "token", where
        assert secret_ref(container, "RAY_AUTH_TOKEN") == ("strata-ray-token", "auth_token"), where
        args = container["args"][0]
        assert "--num-cpus=0" in args and "--num-gpus=0" in args, where  # drivers host no replica


def test_replicas_land_on_gpu_workers_and_never_on_the_head():
    cluster = ray_cluster()
    head = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert head["num-cpus"] == "0" and head["num-gpus"] == "0"
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["resources"] == {"strata_worker": "8"}  # workers.actor.WORKER_RESOURCE
    from workers.actor import WORKER_RESOURCE, placement

    assert WORKER_RESOURCE in group["resources"]
    worker = group["template"]["spec"]["containers"][0]
    gpus = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= 1 and worker["resources"]["requests"] == worker["resources"]["limits"]
    # What placement asks of a cluster made of such pods: GPUs (one node's worth at most), and the
    # custom resource when a cluster has no GPU.
    cluster_resources = {"GPU": gpus * group["replicas"], WORKER_RESOURCE: 8.0 * group["replicas"]}
    assert placement(cluster_resources)["num_gpus"] == 1
    assert placement({WORKER_RESOURCE: 8.0})["resources"] == {WORKER_RESOURCE: 1}
    assert any(t.get("key") == "nvidia.com/gpu" for t in group["template"]["spec"]["tolerations"])


def test_the_ray_workers_disruption_budget_uses_the_form_kubernetes_honours_for_operator_pods():
    pdb = one("PodDisruptionBudget", "strata-ray-workers")["spec"]
    assert isinstance(pdb["minAvailable"], int) and "maxUnavailable" not in pdb
    labels = ray_cluster()["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["minAvailable"] < ray_cluster()["spec"]["workerGroupSpecs"][0]["replicas"]


# ------------------------------------------------------------------------------------------ tests: run
def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


PROBE = """
import json, sys
import django
django.setup()
from django.core.management import call_command
from django.test import Client
client = Client()
answers = {host: client.get("/healthz", HTTP_HOST=host).status_code for host in sys.argv[1:]}
call_command("check", "--deploy", "--fail-level", "WARNING")
print("ANSWERS " + json.dumps(answers))
"""


@pytest.mark.parametrize(("pod_ip", "probe_host"), [("10.42.0.7", "10.42.0.7:8000"), ("fd00::7", "[fd00::7]:8000")])
def test_the_web_containers_script_serves_probes_on_its_own_address(tmp_path, pod_ip, probe_host):
    """The web container's command, run verbatim with `ray` and the server stubbed: it joins Ray as a
    node with no resources, and the server it starts gets an environment in which production Django
    answers the kubelet's probe (Host: the pod's address) and the Service's name, refuses any other
    host, and passes `check --deploy`."""
    web = container_of("Deployment", "strata-web", "web")
    env = container_environment(web, pod_ip=pod_ip, given=filled_secrets())
    env.update(STRATA_HOME=str(tmp_path / "home"), STRATA_WEIGHTS_ROOT=str(tmp_path / "weights"))
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (tmp_path / "probe.py").write_text(PROBE)
    _stub(stubs / "ray", f'echo "$*" > {tmp_path}/ray.args\n')
    hosts = [probe_host, "strata-web", "strata.example.com", "evil.example", "10.42.0.8:8000"]
    probe = shlex.join([sys.executable, str(tmp_path / "probe.py"), *hosts])
    _stub(stubs / "python", f'echo "$*" > {tmp_path}/python.args\nexec {probe}\n')
    child = {"PATH": f"{stubs}:{os.environ['PATH']}", "HOME": str(tmp_path),
             "PYTHONPATH": f"{ROOT}:{ROOT / 'platform'}", **env}
    result = subprocess.run([*web["command"], *web["args"]], cwd=ROOT, env=child, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "ray.args").read_text().split() == [
        "start", "--address=strata-ray-head-svc:6379", "--num-cpus=0", "--num-gpus=0",
        "--object-store-memory=100000000", "--disable-usage-stats"]
    assert (tmp_path / "python.args").read_text().split()[:6] == [
        "-m", "workers.webserver", "--host", "0.0.0.0", "--port", "8000"]
    answers = json.loads(result.stdout.split("ANSWERS ", 1)[1])
    assert answers == {probe_host: 200, "strata-web": 200, "strata.example.com": 200, "evil.example": 400,
                       "10.42.0.8:8000": 400}  # another pod's address is not this pod's


def _init_script_env(tmp_path: Path, database: Path, ray_port: int) -> dict[str, str]:
    init = container_of("Deployment", "strata-web", "wait-for-dependencies")
    env = container_environment(init, pod_ip="10.42.0.7", given=filled_secrets())
    env.update(STRATA_HOME=str(tmp_path / "home"), STRATA_WEIGHTS_ROOT=str(tmp_path / "weights"),
               DATABASE_URL=f"sqlite:///{database}", RAY_ADDRESS=f"127.0.0.1:{ray_port}")
    return {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(tmp_path), **env}


def _run_until(args: list[str], env: dict[str, str], seconds: float) -> tuple[int | None, str]:
    """Run ``args`` for at most ``seconds``: (exit code or None when still running, output)."""
    process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=seconds)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the shell and its sleep: this test's own process group
        output, _ = process.communicate()
        return None, output


@pytest.mark.slow
def test_the_init_container_waits_for_migrations_and_the_ray_head(tmp_path):
    """The init container's script, run verbatim against a SQLite database and a local port: it keeps
    waiting while migrations are unapplied, then while nothing listens at RAY_ADDRESS, and finishes
    once the schema is migrated and the head answers."""
    init = container_of("Deployment", "strata-web", "wait-for-dependencies")
    assert container_of("Deployment", "strata-celery", "wait-for-dependencies")["args"] == init["args"]
    script = [*init["command"], *init["args"]]
    database = tmp_path / "db.sqlite3"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        code, output = _run_until(script, _init_script_env(tmp_path, database, port), 15)
        assert code is None and "waiting for the strata-migrate Job" in output, output

        env = _init_script_env(tmp_path, database, port)
        migrated = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=240)
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr

        code, output = _run_until(script, env, 60)
        assert code == 0, output
    finally:
        listener.close()
    code, output = _run_until(script, _init_script_env(tmp_path, database, port), 15)
    assert code is None and "waiting for the Ray head" in output and "strata-migrate" not in output, output


def test_docs_say_how_to_install_it():
    text = DOCS.read_text()
    assert "kubectl apply -k deploy/kubernetes" in text
    for name in example_secrets():
        assert name in text, name
    assert VENDORED["release"] in text  # the KubeRay release the RayCluster is checked against
