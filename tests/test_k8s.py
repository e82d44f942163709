"""deploy/k8s cannot be applied here (no cluster), so render its overlays and check them.

``render()`` is a tiny kustomize: ``resources`` (files and folders), ``patches``
(strategic merge, target named by the patch's kind and name), ``images`` and
``namespace``. A kustomization using anything else fails the test, so the loader
cannot silently skip a feature. Where ``kubectl`` is installed, its own kustomize
must render the same objects.

Every ``check_*`` returns the problems it found; ``test_checks_catch_broken_manifests``
breaks a rendered overlay on purpose and expects the matching check to complain.
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from engine_worker.config import WorkerSettings
from gateway.config import GatewaySettings
from sluice.settings import RedisSettings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy/k8s"
OVERLAYS = ("cpu", "gpu")
# Kubernetes' own OpenAPI schemas (as JSON schemas, strict: unknown fields are errors),
# from the kubernetes-validate package: the oldest minor still commonly run in managed
# clusters when this was written, and the newest the package ships.
K8S_VERSIONS = ("1.30.0", "1.37.0")
WORKER_IMAGE = {"cpu": "sluice-cpu", "gpu": "sluice-gpu"}

Doc = dict[str, Any]

# --- the loader -------------------------------------------------------------------

_SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
# Lists that strategic merge patches merge item by item (by this key) instead of replacing.
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
               "ports": "containerPort", "volumeMounts": "mountPath"}
_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume"}


def render(folder: Path) -> list[Doc]:
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - _SUPPORTED
    assert not unknown, f"{folder}: kustomization fields this loader cannot apply: {unknown}"
    docs: list[Doc] = []
    for entry in k.get("resources", []):
        path = (folder / entry).resolve()
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        assert set(patch) == {"path"}, f"{folder}: only strategic merge patches by path: {patch}"
        body = yaml.safe_load((folder / patch["path"]).read_text())
        i = _index(docs, body["kind"], body["metadata"]["name"])
        docs[i] = _merge(docs[i], body, "")
    for image in k.get("images", []):
        for container in (c for d in docs for c in containers(d)):
            name, tag = split_image(container["image"])
            if name == image["name"]:
                name = image.get("newName", name)
                tag = image.get("newTag", tag)
                container["image"] = f"{name}:{tag}" if tag else name
    if "namespace" in k:
        for d in docs:
            if d["kind"] not in _CLUSTER_SCOPED:
                d["metadata"]["namespace"] = k["namespace"]
    return docs


def _index(docs: list[Doc], kind: str, name: str) -> int:
    found = [i for i, d in enumerate(docs) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"patch target {kind}/{name}: {len(found)} matches"
    return found[0]


def _merge(base: Any, patch: Any, key: str) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = _merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in _MERGE_KEYS:
        mk = _MERGE_KEYS[key]
        out = copy.deepcopy(base)
        for item in patch:
            at = [i for i, old in enumerate(out) if old.get(mk) == item.get(mk)]
            if at:
                out[at[0]] = _merge(out[at[0]], item, "")
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def split_image(image: str) -> tuple[str, str]:
    name, _, tag = image.rpartition(":")
    return (name, tag) if name and "/" not in tag else (image, "")


@functools.cache
def _rendered(overlay: str) -> list[Doc]:
    return render(K8S / "overlays" / overlay)


def overlay_docs(overlay: str) -> list[Doc]:
    """A fresh copy of the rendered overlay (tests may break it)."""
    return copy.deepcopy(_rendered(overlay))


# --- reading rendered objects ------------------------------------------------------

def pod_spec(doc: Doc) -> Doc | None:
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return doc["spec"]["template"]["spec"]
    return None


def containers(doc: Doc) -> list[Doc]:
    spec = pod_spec(doc)
    return spec["containers"] if spec else []


def workloads(docs: list[Doc]) -> Iterator[Doc]:
    return (d for d in docs if pod_spec(d) is not None)


def component(docs: list[Doc], name: str) -> Doc:
    found = [d for d in workloads(docs)
             if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == name]
    assert len(found) == 1, f"{len(found)} workloads of component {name}"
    return found[0]


def get(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def env(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def port_number(container: Doc, port: int | str) -> int | None:
    for p in container.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            return int(p["containerPort"])
    return None


def cli_port(container: Doc) -> int:
    args = container.get("args", [])
    return int(args[args.index("--port") + 1])


def prestop_s(container: Doc) -> float:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def setting(container: Doc, env_name: str, default: float) -> float:
    entry = env(container).get(env_name)
    return float(entry["value"]) if entry else default


# --- checks -----------------------------------------------------------------------

def check_probes(docs: list[Doc]) -> list[str]:
    problems = []
    for d in workloads(docs):
        for c in containers(d):
            for probe in ("readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if not p:
                    problems.append(f"{d['metadata']['name']}/{c['name']}: no {probe}")
                elif "httpGet" in p and port_number(c, p["httpGet"]["port"]) is None:
                    problems.append(f"{c['name']}: {probe} on undeclared port {p['httpGet']['port']}")
    expected = {"gateway": ("/ready", "/health"), "worker": ("/health", "/health")}
    for name, (ready, live) in expected.items():
        c = containers(component(docs, name))[0]
        for probe, path in (("readinessProbe", ready), ("livenessProbe", live)):
            http = c.get(probe, {}).get("httpGet", {})
            if http.get("path") != path:
                problems.append(f"{name}: {probe} path {http.get('path')} is not {path}")
            if port_number(c, http.get("port", -1)) != cli_port(c):
                problems.append(f"{name}: {probe} is not on the port the process binds ({cli_port(c)})")
    return problems


def check_grace(docs: list[Doc]) -> list[str]:
    problems = []
    limits = {
        "gateway": ("SLUICE_GATEWAY_SHUTDOWN_GRACE_S", GatewaySettings.model_fields["shutdown_grace_s"].default),
        "worker": ("SLUICE_WORKER_DRAIN_TIMEOUT_S", WorkerSettings.model_fields["drain_timeout_s"].default),
    }
    for name, (env_name, default) in limits.items():
        d = component(docs, name)
        c = containers(d)[0]
        if prestop_s(c) <= 0:
            problems.append(f"{name}: no preStop sleep")
        need = prestop_s(c) + setting(c, env_name, default)
        grace = pod_spec(d).get("terminationGracePeriodSeconds", 30)
        if grace <= need:
            problems.append(f"{name}: terminationGracePeriodSeconds {grace} <= preStop + {env_name} ({need})")
    return problems


def check_gpu(docs: list[Doc], overlay: str) -> list[str]:
    c = containers(component(docs, "worker"))[0]
    limits = c.get("resources", {}).get("limits", {})
    requests = c.get("resources", {}).get("requests", {})
    if overlay == "gpu":
        if int(limits.get("nvidia.com/gpu", 0)) < 1:
            return ["gpu worker: no nvidia.com/gpu limit"]
        if "nvidia.com/gpu" in requests and requests["nvidia.com/gpu"] != limits["nvidia.com/gpu"]:
            return ["gpu worker: nvidia.com/gpu request differs from its limit"]
        return []
    asking = [c["name"] for d in workloads(docs) for c in containers(d)
              if "nvidia.com/gpu" in str(c.get("resources", {}))]
    return [f"{overlay}: {name} asks for a GPU" for name in asking]


def check_advertise_url(docs: list[Doc]) -> list[str]:
    c = containers(component(docs, "worker"))[0]
    names = [e["name"] for e in c.get("env", [])]
    e = env(c)
    url = e.get("SLUICE_WORKER_ADVERTISE_URL", {}).get("value", "")
    match = re.fullmatch(r"http://\$\((\w+)\):(\d+)", url)
    if not match:
        return [f"worker: SLUICE_WORKER_ADVERTISE_URL {url!r} is not http://$(VAR):port"]
    var, port = match.group(1), int(match.group(2))
    problems = []
    source = e.get(var, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if source != "status.podIP":
        problems.append(f"worker: {var} does not come from status.podIP")
    elif names.index(var) > names.index("SLUICE_WORKER_ADVERTISE_URL"):
        problems.append(f"worker: {var} is defined after the URL that uses it")
    if port != cli_port(c) or port_number(c, port) is None:
        problems.append(f"worker: advertised port {port} is not the port it binds")
    return problems


def check_redis(docs: list[Doc]) -> list[str]:
    problems = []
    sets = [d for d in get(docs, "StatefulSet") if d["metadata"]["name"] == "redis"]
    if not sets:
        return ["no redis StatefulSet"]
    redis = sets[0]
    c = containers(redis)[0]
    args = c.get("args", [])
    flags = {a[2:]: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    if flags.get("appendonly") != "yes":
        problems.append("redis: appendonly is not yes")
    if flags.get("maxmemory-policy") != "noeviction":
        problems.append("redis: maxmemory-policy is not noeviction")
    claims = {t["metadata"]["name"] for t in redis["spec"].get("volumeClaimTemplates", [])}
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    if not claims:
        problems.append("redis: no PersistentVolumeClaim template")
    elif not any(mounts.get(name) == flags.get("dir", "/data") for name in claims):
        problems.append("redis: the claim is not mounted at Redis's --dir")
    services = {s["metadata"]["name"]: s for s in get(docs, "Service")}
    for name in ("gateway", "worker"):
        url = env(containers(component(docs, name))[0]).get("SLUICE_REDIS_URL", {}).get("value", "")
        m = re.fullmatch(r"redis://([\w-]+):(\d+)/\d+", url)
        service = services.get(m.group(1)) if m else None
        if not service or int(m.group(2)) not in [p["port"] for p in service["spec"]["ports"]] \
                or not selects(service["spec"]["selector"], redis["spec"]["template"]["metadata"]["labels"]):
            problems.append(f"{name}: SLUICE_REDIS_URL {url!r} does not reach the redis pods")
    return problems


def _hpa_for(docs: list[Doc], name: str) -> Doc | None:
    target = component(docs, name)["metadata"]["name"]
    found = [h for h in get(docs, "HorizontalPodAutoscaler")
             if (h["spec"]["scaleTargetRef"]["kind"], h["spec"]["scaleTargetRef"]["name"]) == ("Deployment", target)]
    return found[0] if len(found) == 1 else None


def adapter_rules() -> dict[str, Doc]:
    """External metrics the prometheus-adapter values serve, by name."""
    values = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    return {r["name"]["as"]: r for r in values["rules"]["external"]}


def check_autoscaling(docs: list[Doc]) -> list[str]:
    """Gateways scale on CPU; workers on the slot-demand ratio the adapter serves."""
    problems = []
    gateway = component(docs, "gateway")
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    for hpa in get(docs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        if (ref["kind"], ref["name"]) not in {("Deployment", component(docs, c)["metadata"]["name"])
                                              for c in ("gateway", "worker")}:
            problems.append(f"HPA targets {ref['kind']}/{ref['name']}, not the gateway Deployment or the workers'")
    hpa = _hpa_for(docs, "gateway")
    if hpa is None:
        problems.append("no HorizontalPodAutoscaler for the gateway Deployment")
    else:
        uses_cpu = any(m.get("resource", {}).get("name") == "cpu" for m in hpa["spec"].get("metrics", []))
        if not uses_cpu:
            problems.append("the gateway HPA does not scale on CPU")
        elif not all("cpu" in c.get("resources", {}).get("requests", {}) for c in containers(gateway)):
            problems.append("HPA scales on CPU but the gateway requests no CPU")
    hpa = _hpa_for(docs, "worker")
    if hpa is None:
        problems.append("no HorizontalPodAutoscaler for the workers")
    else:
        served = adapter_rules()
        for m in hpa["spec"]["metrics"]:
            if m["type"] != "External" or m["external"]["metric"]["name"] not in served:
                problems.append(f"worker HPA metric {m} is not an external metric the adapter serves")
        if hpa["spec"]["minReplicas"] < 1:
            problems.append("worker HPA may scale to zero: a queued request would find no worker")
    pdbs = get(docs, "PodDisruptionBudget")
    if not pdbs:
        problems.append("no PodDisruptionBudget")
    for pdb in pdbs:
        selector = pdb["spec"]["selector"]["matchLabels"]
        if not selects(selector, labels):
            problems.append("PDB does not select the gateway pods")
        if selects(selector, component(docs, "worker")["spec"]["template"]["metadata"]["labels"]):
            problems.append("PDB also selects worker pods")
    return problems


def check_selectors(docs: list[Doc]) -> list[str]:
    problems = []
    for d in workloads(docs):
        if not selects(d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"]):
            problems.append(f"{d['kind']}/{d['metadata']['name']}: selector does not match its pods")
    for s in get(docs, "Service"):
        selector = s["spec"]["selector"]
        pods = [d for d in workloads(docs) if selects(selector, d["spec"]["template"]["metadata"]["labels"])]
        if not pods:
            problems.append(f"Service/{s['metadata']['name']} selects no pods")
        for p in s["spec"]["ports"]:
            if pods and all(port_number(c, p["targetPort"]) is None for d in pods for c in containers(d)):
                problems.append(f"Service/{s['metadata']['name']}: targetPort {p['targetPort']} not in its pods")
    return problems


def check_resources(docs: list[Doc]) -> list[str]:
    problems = []
    for d in workloads(docs):
        for c in containers(d):
            r = c.get("resources", {})
            if not {"cpu", "memory"} <= set(r.get("requests", {})) or "memory" not in r.get("limits", {}):
                problems.append(f"{d['metadata']['name']}/{c['name']}: needs cpu+memory requests and a memory limit")
    return problems


def check_images(docs: list[Doc], overlay: str) -> list[str]:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    built = {split_image(s["image"])[0]: s["build"] for s in compose.values() if "build" in s and "image" in s}
    problems = []
    for name, expected in (("gateway", "sluice"), ("worker", WORKER_IMAGE[overlay])):
        image, tag = split_image(containers(component(docs, name))[0]["image"])
        if image != expected:
            problems.append(f"{name}: image {image}, expected {expected}")
        if tag != version:
            problems.append(f"{name}: image tag {tag!r} is not the package version {version}")
        if expected not in built:
            problems.append(f"{expected}: no docker-compose.yml service builds it")
    return problems


def check_secrets(docs: list[Doc]) -> list[str]:
    secrets = {s["metadata"]["name"]: {**s.get("data", {}), **s.get("stringData", {})} for s in get(docs, "Secret")}
    problems = []
    for d in workloads(docs):
        for c in containers(d):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["key"] not in secrets.get(ref["name"], {}):
                    problems.append(f"{c['name']}: {e['name']} refers to missing {ref['name']}/{ref['key']}")
    return problems


def check_settings(docs: list[Doc]) -> list[str]:
    """Every SLUICE_* variable names a real setting, so a typo cannot silently do nothing."""
    known = {f"SLUICE_GATEWAY_{f.upper()}" for f in GatewaySettings.model_fields}
    known |= {f"SLUICE_WORKER_{f.upper()}" for f in WorkerSettings.model_fields}
    known |= {alias for field in RedisSettings.model_fields.values()  # shared settings, by alias
              for alias in getattr(field.validation_alias, "choices", ()) if str(alias).startswith("SLUICE_")}
    return [f"{c['name']}: unknown setting {name}" for d in workloads(docs) for c in containers(d)
            for name in env(c) if name.startswith("SLUICE_") and name not in known]


def check_otel(docs: list[Doc]) -> list[str]:
    maps = [m for m in get(docs, "ConfigMap") if m["metadata"]["name"] == "otel-collector"]
    if not maps:
        return ["no otel-collector ConfigMap"]
    config = yaml.safe_load(maps[0]["data"]["config.yaml"])
    problems = []
    if config != yaml.safe_load((ROOT / "deploy/otel-collector.yaml").read_text()):
        problems.append("otel-collector ConfigMap differs from deploy/otel-collector.yaml")
    endpoint = config.get("extensions", {}).get("health_check", {}).get("endpoint", ":0")
    health = int(endpoint.rsplit(":", 1)[1])
    c = containers(component(docs, "otel-collector"))[0]
    if port_number(c, c.get("readinessProbe", {}).get("httpGet", {}).get("port", -1)) != health:
        problems.append("otel-collector: readiness probe is not on the health_check port")
    return problems


def check_schema(docs: list[Doc]) -> list[str]:
    """Every rendered object against Kubernetes' schemas for each version in K8S_VERSIONS."""
    problems = []
    for version in K8S_VERSIONS:
        for d in docs:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = "/".join(str(p) for p in e.absolute_path)
                problems.append(f"{version} {d['kind']}/{d['metadata']['name']} at {where}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                problems.append(f"{version} {d['kind']}/{d['metadata']['name']}: {e.message}")
    return problems


CHECKS: dict[str, Callable[[list[Doc], str], list[str]]] = {
    "probes": lambda docs, _: check_probes(docs),
    "grace": lambda docs, _: check_grace(docs),
    "gpu": check_gpu,
    "advertise_url": lambda docs, _: check_advertise_url(docs),
    "redis": lambda docs, _: check_redis(docs),
    "autoscaling": lambda docs, _: check_autoscaling(docs),
    "selectors": lambda docs, _: check_selectors(docs),
    "resources": lambda docs, _: check_resources(docs),
    "images": check_images,
    "secrets": lambda docs, _: check_secrets(docs),
    "settings": lambda docs, _: check_settings(docs),
    "otel": lambda docs, _: check_otel(docs),
    "schema": lambda docs, _: check_schema(docs),
}


# --- tests ------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_overlay(overlay: str, check: str) -> None:
    assert CHECKS[check](overlay_docs(overlay), overlay) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_is_namespaced_and_the_namespace_exists(overlay: str) -> None:
    docs = overlay_docs(overlay)
    namespaces = [d["metadata"]["name"] for d in get(docs, "Namespace")]
    assert len(namespaces) == 1
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == namespaces[0], d["metadata"]["name"]
    assert not any("sluice-worker" in c["image"] for d in docs for c in containers(d)), "placeholder image left"


def _worker(docs: list[Doc]) -> Doc:
    return containers(component(docs, "worker"))[0]


def _gateway(docs: list[Doc]) -> Doc:
    return containers(component(docs, "gateway"))[0]


def _hpa(docs: list[Doc], name: str) -> Doc:
    hpa = _hpa_for(docs, name)
    assert hpa is not None, name
    return hpa


def _set_env(container: Doc, name: str, value: str) -> None:
    env(container)[name]["value"] = value


BREAKAGES: list[tuple[str, str, Callable[[list[Doc]], object]]] = [
    ("probes", "no readinessProbe", lambda d: _gateway(d).pop("readinessProbe")),
    ("probes", "path /health is not /ready", lambda d: _gateway(d)["readinessProbe"]["httpGet"].update(path="/health")),
    ("probes", "undeclared port", lambda d: _worker(d)["livenessProbe"]["httpGet"].update(port=9999)),
    ("grace", "worker: terminationGracePeriodSeconds",
     lambda d: _set_env(_worker(d), "SLUICE_WORKER_DRAIN_TIMEOUT_S", "120")),
    ("grace", "gateway: terminationGracePeriodSeconds",
     lambda d: pod_spec(component(d, "gateway")).update(terminationGracePeriodSeconds=30)),
    ("grace", "no preStop", lambda d: _worker(d).pop("lifecycle")),
    ("gpu", "no nvidia.com/gpu limit", lambda d: _worker(d)["resources"]["limits"].pop("nvidia.com/gpu")),
    ("advertise_url", "status.podIP",
     lambda d: env(_worker(d))["POD_IP"]["valueFrom"]["fieldRef"].update(fieldPath="status.hostIP")),
    ("advertise_url", "is not http://",
     lambda d: _set_env(_worker(d), "SLUICE_WORKER_ADVERTISE_URL", "http://0.0.0.0:8100")),
    ("redis", "appendonly", lambda d: containers(get(d, "StatefulSet")[0])[0]["args"].remove("--appendonly")),
    ("redis", "noeviction", lambda d: (a := containers(get(d, "StatefulSet")[0])[0]["args"]).__setitem__(
        a.index("noeviction"), "allkeys-lru")),
    ("redis", "no PersistentVolumeClaim", lambda d: get(d, "StatefulSet")[0]["spec"].pop("volumeClaimTemplates")),
    ("redis", "does not reach", lambda d: _set_env(_gateway(d), "SLUICE_REDIS_URL", "redis://redis-main:6379/0")),
    ("autoscaling", "no HorizontalPodAutoscaler for the gateway", lambda d: _hpa(d, "gateway")["spec"]
     ["scaleTargetRef"].update(name="worker")),
    ("autoscaling", "not an external metric the adapter serves", lambda d: _hpa(d, "worker")["spec"]["metrics"][0]
     ["external"]["metric"].update(name="sluice_gateway_queue_depth")),
    ("autoscaling", "scale to zero", lambda d: _hpa(d, "worker")["spec"].update(minReplicas=0)),
    ("schema", "Additional properties", lambda d: pod_spec(component(d, "gateway")).update(
        terminationGracePeriod=60)),
    ("schema", "is not of type 'integer'", lambda d: component(d, "worker")["spec"].update(replicas="two")),
    ("schema", "'containerPort' is a required property", lambda d: _gateway(d)["ports"][0].pop("containerPort")),
    ("schema", "Couldn't find schema", lambda d: _hpa(d, "worker").update(apiVersion="autoscaling/v2beta2")),
    ("autoscaling", "PDB does not select", lambda d: get(d, "PodDisruptionBudget")[0]["spec"]["selector"]
     ["matchLabels"].update({"app.kubernetes.io/component": "gatway"})),
    ("selectors", "selects no pods", lambda d: get(d, "Service")[0]["spec"]["selector"].update(extra="x")),
    ("resources", "needs cpu+memory", lambda d: _gateway(d).pop("resources")),
    ("images", "expected sluice", lambda d: _gateway(d).update(image="sluice-gateway:0.1.0")),
    ("images", "package version", lambda d: _worker(d).update(image=_worker(d)["image"].split(":")[0] + ":9.9")),
    ("secrets", "missing", lambda d: [s.update(stringData={}) for s in get(d, "Secret")]),
    ("settings", "unknown setting",
     lambda d: _worker(d)["env"].append({"name": "SLUICE_WORKER_DRAIN_S", "value": "9"})),
    ("otel", "differs", lambda d: get(d, "ConfigMap")[0]["data"].update({"config.yaml": "receivers: {}\n"})),
]


@pytest.mark.parametrize(("check", "expected", "breakage"), BREAKAGES,
                         ids=[f"{c}-{e}" for c, e, _ in BREAKAGES])
def test_checks_catch_broken_manifests(check: str, expected: str, breakage: Callable[[list[Doc]], object]) -> None:
    docs = overlay_docs("gpu")
    assert CHECKS[check](docs, "gpu") == []
    breakage(docs)
    problems = CHECKS[check](docs, "gpu")
    assert any(expected in p for p in problems), problems


def test_cpu_overlay_asks_for_no_gpu() -> None:
    docs = overlay_docs("cpu")
    _worker(docs)["resources"]["limits"]["nvidia.com/gpu"] = 1
    assert check_gpu(docs, "cpu") == ["cpu: worker asks for a GPU"]


def test_loader_refuses_what_it_cannot_apply(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(AssertionError, match="commonLabels"):
        render(tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_loader_agrees_with_kubectl_kustomize(overlay: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    done = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr

    def keyed(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    theirs = keyed([d for d in yaml.safe_load_all(done.stdout) if d])
    ours = keyed(overlay_docs(overlay))
    assert sorted(theirs) == sorted(ours)
    for key, doc in ours.items():
        assert doc == theirs[key], key


def test_prometheus_scrape_config_finds_the_pods() -> None:
    docs = overlay_docs("gpu")
    config = yaml.safe_load((K8S / "prometheus-scrape.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"sluice-gateway", "sluice-worker"}
    for name, job in jobs.items():
        keep = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
        pod = component(docs, keep[("__meta_kubernetes_pod_label_app_kubernetes_io_component",)])
        assert pod["metadata"]["namespace"] in job["kubernetes_sd_configs"][0]["namespaces"]["names"], name
        assert port_number(containers(pod)[0], keep[("__meta_kubernetes_pod_container_port_name",)]), name
    secret_key = env(_gateway(docs))["SLUICE_GATEWAY_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["key"]
    assert jobs["sluice-gateway"]["authorization"]["credentials_file"].endswith("/" + secret_key)
    token_key = env(_gateway(docs))["SLUICE_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]["key"]
    assert jobs["sluice-worker"]["authorization"]["credentials_file"].endswith("/" + token_key)


def test_the_worker_scaling_metric_is_built_from_exported_metrics() -> None:
    """The adapter's query names only series the code exports, each filtered by the HPA's
    namespace and selector, on series the scrape config labels with their namespace."""
    from tests.test_compose import METRIC_SOURCES, exposed_metrics

    known = set().union(*(exposed_metrics(p.read_text()) for p in METRIC_SOURCES))
    (rule,) = adapter_rules().values()
    selectors = re.findall(r"\b(sluice_[a-z0-9_]+)\{([^}]*)\}", rule["metricsQuery"])
    assert {name for name, _ in selectors} == {
        "sluice_gateway_queue_depth", "sluice_worker_in_flight_requests", "sluice_worker_capacity"}
    assert {name for name, _ in selectors} <= known
    assert {matchers for _, matchers in selectors} == {"<<.LabelMatchers>>"}
    assert re.match(r"(\w+)\{", rule["seriesQuery"]).group(1) in known
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    scrape = yaml.safe_load((K8S / "prometheus-scrape.yml").read_text())
    for job in scrape["scrape_configs"]:
        assert {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"} in job[
            "relabel_configs"], job["job_name"]


def worker_demand_query(label_matchers: str) -> str:
    """The adapter's query as Prometheus receives it (tests/test_compose.py runs it)."""
    (rule,) = adapter_rules().values()
    return rule["metricsQuery"].replace("<<.LabelMatchers>>", label_matchers)


def test_gateway_pods_run_as_the_images_user() -> None:
    user = re.search(r"^USER (\d+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE).group(1)
    for overlay in OVERLAYS:
        gateway = component(overlay_docs(overlay), "gateway")
        pod = pod_spec(gateway)["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == int(user), overlay
        assert containers(gateway)[0]["securityContext"]["allowPrivilegeEscalation"] is False
