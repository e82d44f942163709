"""docker-compose.yml cannot run here (no Docker engine), so check its structure."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


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


def test_prometheus_scrapes_gateway_with_the_admin_key() -> None:
    compose = _compose()["services"]
    prom = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    assert jobs["sluice-gateway"]["authorization"]["credentials"] == compose["gateway"]["environment"][
        "SLUICE_GATEWAY_ADMIN_KEY"]
    assert jobs["sluice-gateway"]["static_configs"][0]["targets"] == ["gateway:8000"]
    otel = yaml.safe_load((ROOT / "deploy/otel-collector.yaml").read_text())
    assert "otlp" in otel["service"]["pipelines"]["traces"]["receivers"]


def test_referenced_files_exist() -> None:
    for name, service in _compose()["services"].items():
        build = service.get("build")
        if build:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            assert context.is_dir(), name
            dockerfile = build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile"
            assert (context / dockerfile).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name}: {source}"
