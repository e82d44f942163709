"""Sluice beside its peers, one run on one machine: the same load generator against an
OpenAI-compatible mock engine read directly, and through vllm-router, LiteLLM's proxy and
Sluice (fronting the mock with ``--engine openai``, relayed by the worker or, with
``--relay direct``, streamed by the gateway itself; and fronting its own simulator with
the same timing).

    loadtest/peers/setup.sh                      # the peers' venvs, once
    flock /tmp/sluice-heavy.lock .venv/bin/python loadtest/peers/bench_peers.py

Prints one table and writes ``loadtest/peers/peers.json`` and ``peers.png``. Every path
runs at each concurrency in turn (16, 64, then past the point where direct stops scaling),
with a warm-up before each measured window. Ports: ``--base-port`` and the next eleven.

Three more paths measure the floor under any Python gateway on Sluice's stack
(``floor_relay.py``): ``python floor (uvicorn)`` (a JSON parse and a pass-through hop),
``python floor (uvicorn) + 2 Redis calls`` (the same with an admission's two round trips),
``python floor (raw asyncio)`` (no uvicorn: a protocol of a few lines on httptools).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.peers import proc_cpu
from loadtest.peers.load import Window, percentile, run

VENVS = Path(os.environ.get("VENVS", "/work/venvs"))


@dataclass
class Path_:
    name: str
    url: str
    model: str
    api_key: str | None = None
    #: Each request with an Idempotency-Key of its own (a resumable stream).
    resumable: bool = False


class Procs:
    """Child processes, each in its own process group, all stopped at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[subprocess.Popen[bytes]] = []
        #: Process group (= the child's pid, it leads its session) by name.
        self.groups: dict[str, int] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> None:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the child
        self.started.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                             env={**os.environ, **(env or {})}, start_new_session=True))
        self.groups[name] = self.started[-1].pid

    def stop(self) -> None:
        for proc in reversed(self.started):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self.started:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def group_cpu_s(pgid: int) -> float:
    """CPU seconds of a process group's live processes and of everything under them (a
    negative ``pgid``: the one process ``-pgid``, e.g. the embedded Redis; :data:`MACHINE`:
    every core's busy time)."""
    if pgid == MACHINE:
        return proc_cpu.machine_busy_s()
    table = proc_cpu.process_table()
    if pgid < 0:
        return table[-pgid][2] if -pgid in table else 0.0
    inside = proc_cpu.tree({pid for pid, (_, pgrp, _) in table.items() if pgrp == pgid}, table)
    return sum(table[pid][2] for pid in inside)


#: The Sluice processes whose CPU per streamed chunk is reported, by the name they were started under.
CPU_GROUPS = {"gateway": "sluice-gateway", "gateway x2": "sluice-gateway-2", "gateway baseline": "sluice-gateway-baseline",
              "gateway keyed": "sluice-gateway-keyed", "gateway logged": "sluice-gateway-logged",
              "openai worker": "sluice-worker-openai", "vllm-router": "vllm-router",
              "floor": "python-floor", "floor-raw": "python-floor-raw", "floor+redis": "python-floor-redis"}
#: Not a process group: the whole machine's busy CPU (``group_cpu_s``).
MACHINE = 0
#: Every path's window also reports the engine's CPU (the mock, or vLLM's server), the load
#: generator's (this process) and the whole machine's: on this 2-core machine a path's rate
#: is bounded by the sum of its processes' CPU per request once the cores are busy, and the
#: table's last columns say when they are.
#: The floor relay's paths (floor_relay.py), by the CPU group of their process.
FLOORS = {"python floor (uvicorn)": "floor", "python floor (raw asyncio)": "floor-raw",
          "python floor (uvicorn) + 2 Redis calls": "floor+redis"}


def wait_ready(url: str, timeout_s: float = 120, json_body: dict[str, object] | None = None,
               api_key: str | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    while time.monotonic() < deadline:
        try:
            if json_body is None:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            elif httpx.post(url, json=json_body, headers=headers, timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} not ready after {timeout_s}s")


def start_vllm(procs: Procs, base: int, redis_url: str, baseline: Path | None = None,
               only: set[str] | None = None) -> list[Path_]:
    """vLLM's own server (CPU, the default model) read directly and through Sluice (and
    through ``baseline``'s gateway, when given)."""
    from sluice.models import default_model_dir

    py = sys.executable
    name = default_model_dir().name
    procs.start("vllm-serve", [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(default_model_dir()),
                               "--served-model-name", name, "--port", str(base), "--dtype", "float32",
                               "--max-model-len", "2048", "--max-num-seqs", "16", "--enforce-eager",
                               "--block-size", "32", "--kv-cache-memory-bytes", str(512 * 2**20),
                               "--scheduling-policy", "priority", "--generation-config", "vllm"],
                env={"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    server = f"http://127.0.0.1:{base}"
    wait_ready(server + "/health", 600)
    return [Path_("direct", server, name)] + start_sluice(procs, base, redis_url, server, name, sim=None,
                                                          baseline=baseline, only=only)


def _commit(root: Path) -> str:
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, check=False,
                          text=True).stdout.strip() or root.name


#: The direct relay through a gateway of its own with one setting changed, each started when
#: ``--only`` names it (or runs every path): one that enforces an API key (limits far above
#: the bench's rate), what a key adds to a request (its record read, its charge and settlement
#: in Redis); one that logs at INFO, the product's default (every other gateway here logs at
#: WARNING), what a request's access line costs.
KEYED = "sluice (direct relay) with an API key"
LOGGED = "sluice (direct relay) with access lines"
#: The direct relay's gateway, each request with an Idempotency-Key of its own: what a
#: resumable stream adds (the key's claim and settlement, the journal's writes).
RESUMABLE = "sluice (direct relay) with Idempotency-Key"


def start_sluice(procs: Procs, base: int, redis_url: str, upstream: str, model: str,
                 sim: tuple[float, float] | None, baseline: Path | None = None,
                 only: set[str] | None = None) -> list[Path_]:
    """A gateway, an openai worker fronting ``upstream``, and a sim worker when ``sim``
    gives its (ttft_ms, token_ms). Every gateway runs open (no key asked), but the keyed
    path's (:data:`KEYED`); the variants started when ``only`` names them or is None."""
    py = sys.executable
    # Open, whatever keys the registry holds: the keyed path's key must not make them ask.
    env = {"PYTHONPATH": str(ROOT), "SLUICE_LOG_FORMAT": "json", "SLUICE_GATEWAY_AUTH": "open"}
    procs.start("sluice-worker-openai", [py, "-m", "sluice", "--log-level", "WARNING", "worker", "--engine", "openai",
                                         "--upstream-url", upstream, "--served-model-name", model, "--port",
                                         str(base + 3), "--redis-url", redis_url, "--upstream-capacity", "256"],
                env=env)
    if sim is not None:
        procs.start("sluice-worker-sim", [py, "-m", "sluice", "--log-level", "WARNING", "worker", "--engine", "sim",
                                          "--served-model-name", "sim", "--port", str(base + 4), "--redis-url",
                                          redis_url, "--sim-ttft-ms", str(sim[0]), "--sim-token-ms", str(sim[1]),
                                          "--sim-max-seqs", "256"], env=env)
    # The same server registered by a worker that only advertises it: gateways stream from it.
    procs.start("sluice-worker-direct", [py, "-m", "sluice", "--log-level", "WARNING", "worker", "--engine", "openai",
                                         "--upstream-url", upstream, "--served-model-name", f"{model}-direct",
                                         "--port", str(base + 6), "--redis-url", redis_url, "--upstream-capacity",
                                         "256", "--relay", "direct"], env=env)
    procs.start("sluice-gateway", [py, "-m", "sluice", "--log-level", "WARNING", "gateway", "--port", str(base + 5),
                                   "--redis-url", redis_url, "--procs", "1"], env=env)
    gateway = f"http://127.0.0.1:{base + 5}"
    # The same, from two gateway processes on one port (SO_REUSEPORT): what --procs buys here.
    procs.start("sluice-gateway-2", [py, "-m", "sluice", "--log-level", "WARNING", "gateway", "--port",
                                     str(base + 7), "--redis-url", redis_url, "--procs", "2"], env=env)
    paths = [Path_("sluice (openai worker)", gateway, model), Path_("sluice (direct relay)", gateway, f"{model}-direct"),
             Path_(RESUMABLE, gateway, f"{model}-direct", resumable=True),
             Path_("sluice (direct relay) on 2 gateway procs", f"http://127.0.0.1:{base + 7}", f"{model}-direct")]
    if baseline is not None:
        # Another checkout's gateway (an older commit) on the same registry: before and after
        # measured in one run. The registry and the scripts' keys are the same across versions.
        procs.start("sluice-gateway-baseline", [py, "-m", "sluice", "--log-level", "WARNING", "gateway", "--port",
                                                str(base + 8), "--redis-url", redis_url, "--procs", "1"],
                    env={**env, "PYTHONPATH": str(baseline)}, cwd=baseline)
        paths.insert(2, Path_(f"sluice (direct relay) at {_commit(baseline)}", f"http://127.0.0.1:{base + 8}",
                              f"{model}-direct"))
        paths.insert(4, Path_(f"{RESUMABLE} at {_commit(baseline)}", f"http://127.0.0.1:{base + 8}",
                              f"{model}-direct", resumable=True))
    if sim is not None:
        paths.append(Path_("sluice (sim worker)", gateway, "sim"))
    if only is None or KEYED in only:
        paths.append(_start_variant(procs, KEYED, "sluice-gateway-keyed", base + 13, redis_url, f"{model}-direct",
                                    {**env, "SLUICE_GATEWAY_AUTH": "keys"}, api_key=create_key(redis_url)))
    if only is None or LOGGED in only:
        paths.append(_start_variant(procs, LOGGED, "sluice-gateway-logged", base + 14, redis_url, f"{model}-direct",
                                    env, log_level="INFO"))
    probe = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    for p in paths:
        wait_ready(p.url + "/v1/chat/completions", 180, {**probe, "model": p.model}, p.api_key)
    return paths


def create_key(redis_url: str) -> str:
    """An API key whose limits no bench reaches (``sluice keys create``)."""
    made = subprocess.run([sys.executable, "-m", "sluice", "keys", "create", "--name", "bench-peers", "--rpm",
                           str(10**9), "--tpm", str(10**12), "--max-concurrent", "100000", "--redis-url", redis_url],
                          capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return made.stdout.split()[0]


def _start_variant(procs: Procs, name: str, group: str, port: int, redis_url: str, model: str, env: dict[str, str],
                   *, log_level: str = "WARNING", api_key: str | None = None) -> Path_:
    """One gateway process for the path ``name`` (its CPU counted as ``group``)."""
    procs.start(group, [sys.executable, "-m", "sluice", "--log-level", log_level, "gateway", "--port", str(port),
                        "--redis-url", redis_url, "--procs", "1"], env=env)
    return Path_(name, f"http://127.0.0.1:{port}", model, api_key=api_key)


def start_all(procs: Procs, base: int, ttft_ms: float, token_ms: float, redis_url: str,
              baseline: Path | None = None, only: set[str] | None = None) -> list[Path_]:
    """Every path's processes; a peer that ``only`` leaves out is not started (nor needs its venv)."""
    py = sys.executable
    mock_port = base
    procs.start("mock", [py, str(HERE / "mock_openai.py"), "--port", str(mock_port), "--vllm", "--no-eos",
                         "--ttft-ms", str(ttft_ms), "--token-ms", str(token_ms)])
    mock = f"http://127.0.0.1:{mock_port}"
    wait_ready(mock + "/health")
    paths = [Path_("direct", mock, "mock")]

    if only is None or "vllm-router" in only:
        _start_router(procs, base, mock, paths)
    if only is None or "litellm" in only:
        _start_litellm(procs, base, mock, paths)
    _start_floors(procs, base, mock, redis_url, paths, only)
    paths += start_sluice(procs, base, redis_url, mock, "mock", sim=(ttft_ms, token_ms), baseline=baseline, only=only)
    probe = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    for p in paths:
        if not p.name.startswith("sluice"):
            wait_ready(p.url + "/v1/chat/completions", 180, {**probe, "model": p.model})
    return paths


def _start_router(procs: Procs, base: int, mock: str, paths: list[Path_]) -> None:
    router = VENVS / "vllm-router" / "bin" / "vllm-router"
    procs.start("vllm-router", [str(router), "--host", "127.0.0.1", "--port", str(base + 1), "--worker-urls", mock,
                                "--policy", "round_robin", "--log-level", "warning"])
    paths.append(Path_("vllm-router", f"http://127.0.0.1:{base + 1}", "mock"))


def _start_floors(procs: Procs, base: int, mock: str, redis_url: str, paths: list[Path_],
                  only: set[str] | None) -> None:
    for port, (name, group) in enumerate(FLOORS.items(), start=base + 9):
        if only is not None and name not in only:
            continue
        calls = ["--redis", redis_url, "--redis-calls", "2"] if "Redis" in name else []
        calls += ["--server", "raw"] if "raw" in name else []
        procs.start(CPU_GROUPS[group], [sys.executable, str(HERE / "floor_relay.py"), "--port", str(port),
                                        "--upstream", mock, *calls], env={"PYTHONPATH": str(ROOT)})
        paths.append(Path_(name, f"http://127.0.0.1:{port}", "mock"))


def _start_litellm(procs: Procs, base: int, mock: str, paths: list[Path_]) -> None:
    config = procs.logs / "litellm.yaml"
    config.write_text(
        "model_list:\n  - model_name: mock\n    litellm_params:\n      model: openai/mock\n"
        f"      api_base: {mock}/v1\n      api_key: unused\n"
        "litellm_settings:\n  drop_params: false\n"
    )
    procs.start("litellm", [str(VENVS / "litellm" / "bin" / "litellm"), "--config", str(config), "--host",
                            "127.0.0.1", "--port", str(base + 2), "--num_workers", "1", "--telemetry", "False"],
                env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"})
    paths.append(Path_("litellm", f"http://127.0.0.1:{base + 2}", "mock"))


def summarize(win: Window, measure_s: float, cpu_s: dict[str, float]) -> dict[str, object]:
    return {
        # CPU µs per streamed chunk of each Sluice process in the window (whatever path ran).
        "cpu_us_per_chunk": {k: (1e6 * v / win.chunks if win.chunks else None) for k, v in cpu_s.items()},
        "cpu_us_per_request": {k: (1e6 * v / win.requests if win.requests else None) for k, v in cpu_s.items()},
        "chunks_per_s": win.chunks / measure_s,
        "requests_per_s": win.requests / measure_s,
        "ttft_p50_ms": None if not win.ttfts else 1000 * (percentile(win.ttfts, 0.5) or 0),
        "ttft_p99_ms": None if not win.ttfts else 1000 * (percentile(win.ttfts, 0.99) or 0),
        "requests": win.requests,
        "errors": win.errors,
        "error_kinds": win.error_kinds,
    }


def median_of(runs: list[dict[str, object]]) -> dict[str, object]:
    """One path's figures over repeated windows: the median of each, errors summed."""
    def mid(values: list[float | None]) -> float | None:
        known = sorted(v for v in values if v is not None)
        return None if not known else known[len(known) // 2]

    merged: dict[str, object] = {"runs": len(runs), "errors": sum(int(r["errors"]) for r in runs)}  # type: ignore[call-overload]
    for name in ("chunks_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms"):
        merged[name] = mid([r.get(name) for r in runs])  # type: ignore[misc]
    for name in ("cpu_us_per_chunk", "cpu_us_per_request"):
        groups = {g for r in runs for g in r.get(name) or {}}  # type: ignore[attr-defined]
        merged[name] = {g: mid([(r.get(name) or {}).get(g) for r in runs]) for g in groups}  # type: ignore[attr-defined]
    kinds: dict[str, int] = {}
    for r in runs:
        for kind, count in (r.get("error_kinds") or {}).items():  # type: ignore[attr-defined]
            kinds[kind] = kinds.get(kind, 0) + count
    merged["error_kinds"] = kinds
    # Each window's own rate, TTFT p50 and CPU, so a reader sees the spread behind the median.
    merged["windows"] = [{k: r.get(k) for k in ("requests_per_s", "ttft_p50_ms", "cpu_us_per_request")} for r in runs]
    return merged


def table(results: dict[str, dict[str, dict[str, object]]], levels: list[int]) -> str:
    lines = [("| path | streams | chunks/s | req/s | × direct | TTFT p50 ms | +p50 over direct | TTFT p99 ms | errors "
              "| gateway CPU µs/chunk | gateway CPU µs/request | openai worker CPU µs/chunk | Redis CPU µs/request "
              "| engine + load CPU µs/request | machine CPU µs/request | cores busy |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for level in levels:
        direct = results["direct"][str(level)]
        for name, by_level in results.items():
            r = by_level[str(level)]
            ratio = r["chunks_per_s"] / direct["chunks_per_s"] if direct["chunks_per_s"] else 0
            added = (None if r["ttft_p50_ms"] is None or direct["ttft_p50_ms"] is None
                     else r["ttft_p50_ms"] - direct["ttft_p50_ms"])
            fmt = lambda v: "-" if v is None else f"{v:,.1f}"
            cpu = r.get("cpu_us_per_chunk") or {}
            per_request = r.get("cpu_us_per_request") or {}
            group = ("gateway x2" if "2 gateway procs" in name else "gateway baseline" if " at " in name
                     else "gateway keyed" if name == KEYED else "gateway logged" if name == LOGGED else "gateway")
            if name == "vllm-router":  # the router's own process: its CPU beside the gateway's
                group = "vllm-router"
            group = FLOORS.get(name, group)
            proxy = name.startswith("sluice") or name == "vllm-router" or name in FLOORS
            gw = cpu.get(group) if proxy else None
            gw_req = per_request.get(group) if proxy else None
            rd = per_request.get("redis") if name.startswith("sluice") or "Redis" in name else None
            wk = cpu.get("openai worker") if name.startswith("sluice (openai") else None
            lines.append(f"| {name} | {level} | {r['chunks_per_s']:,.0f} | {r.get('requests_per_s') or 0:,.0f} "
                         f"| {ratio:.2f} | {fmt(r['ttft_p50_ms'])} | "
                         f"{'-' if added is None else f'{added:+.1f}'} | {fmt(r['ttft_p99_ms'])} | {r['errors']} "
                         f"| {'-' if gw is None else f'{gw:.0f}'} | {'-' if gw_req is None else f'{gw_req:.0f}'} "
                         f"| {'-' if wk is None else f'{wk:.0f}'} | {'-' if rd is None else f'{rd:.0f}'} "
                         f"| {shared(per_request, 'engine', 'load')} | {shared(per_request, 'machine')} "
                         f"| {busy_cores(r)} |")
    return "\n".join(lines)


def shared(per_request: dict[str, float | None], *groups: str) -> str:
    """The summed CPU µs per request of ``groups`` (absent from runs before they were measured)."""
    values = [per_request.get(g) for g in groups]
    return "-" if any(v is None for v in values) else f"{sum(values):.0f}"  # type: ignore[arg-type]


def busy_cores(r: dict[str, object]) -> str:
    """How many of the machine's cores were busy in the window, on average."""
    machine = (r.get("cpu_us_per_request") or {}).get("machine")  # type: ignore[union-attr]
    rate = r.get("requests_per_s")
    return "-" if machine is None or not rate else f"{machine * rate / 1e6:.2f} of {os.cpu_count()}"


def draw(results: dict[str, dict[str, dict[str, object]]], levels: list[int], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(14, 5))
    names = list(results)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(levels))]
        tp = [results[name][str(lv)]["chunks_per_s"] for lv in levels]
        ax_tp.bar(xs, tp, width, label=name)
        p50 = [results[name][str(lv)]["ttft_p50_ms"] or 0 for lv in levels]
        p99 = [results[name][str(lv)]["ttft_p99_ms"] or 0 for lv in levels]
        ax_ttft.bar(xs, p50, width, label=f"{name} p50")
        ax_ttft.scatter(xs, p99, marker="_", s=200, color="black")
    for ax in (ax_tp, ax_ttft):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(levels))], [f"{lv} streams" for lv in levels])
    ax_tp.set(title="streamed chunks/s (higher is better)", ylabel="chunks/s")
    ax_ttft.set(title="TTFT p50 (bars) and p99 (black marks)", ylabel="ms", yscale="log")
    ax_tp.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


async def window_cpu(groups: dict[str, int], warmup_s: float, measure_s: float) -> dict[str, float]:
    """CPU seconds each group spends in the measured window (it starts after the warm-up)."""
    await asyncio.sleep(warmup_s)
    before = {k: group_cpu_s(g) for k, g in groups.items()}
    await asyncio.sleep(measure_s)
    return {k: group_cpu_s(g) - before[k] for k, g in groups.items()}


async def measure(paths: list[Path_], levels: list[int], warmup_s: float, measure_s: float,
                  max_tokens: int, groups: dict[str, int], repeat: int = 1,
                  stream: bool = True, keep_alive: bool = False,
                  think_ms: float = 0.0) -> dict[str, dict[str, dict[str, object]]]:
    """Each path at each level; with ``repeat`` > 1 the paths take turns ``repeat`` times per
    level and each figure is the median of its windows (errors summed). Each round starts one
    path later than the one before (``direct, A, B``; ``A, B, direct``; ``B, direct, A``), so
    with as many rounds as paths each path runs once in each place: the place right after
    ``direct`` read up to 90 µs of gateway CPU a request more at 16 streams, whichever gateway
    was in it (README, 2026-12-07 morning)."""
    results: dict[str, dict[str, dict[str, object]]] = {p.name: {} for p in paths}
    for level in levels:
        runs: dict[str, list[dict[str, object]]] = {p.name: [] for p in paths}
        for turn in range(repeat):
            for p in paths[turn % len(paths):] + paths[:turn % len(paths)]:
                win, cpu = await asyncio.gather(run(p.url, p.model, level, warmup_s, measure_s, max_tokens,
                                                    api_key=p.api_key, stream=stream, keep_alive=keep_alive,
                                                    think_ms=think_ms, resumable=p.resumable),
                                                window_cpu(groups, warmup_s, measure_s))
                r = summarize(win, measure_s, cpu)
                runs[p.name].append(r)
                print(f"  {p.name:24s} {level:4d} streams: {r['chunks_per_s']:8,.0f} chunks/s "
                      f"{r['requests_per_s']:7,.0f} req/s  TTFT p50 {r['ttft_p50_ms'] or 0:7.1f} ms  "
                      f"p99 {r['ttft_p99_ms'] or 0:7.1f} ms  errors {r['errors']}", flush=True)
                await asyncio.sleep(1)  # let the last streams drain
        for name, windows in runs.items():
            results[name][str(level)] = windows[0] if repeat == 1 else median_of(windows)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description="Sluice vs vllm-router vs LiteLLM in front of one mock engine")
    parser.add_argument("--levels", default="16,64,128", help="concurrent streams, comma-separated")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--measure-s", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--token-ms", type=float, default=5.0)
    parser.add_argument("--base-port", type=int, default=18520)
    parser.add_argument("--only", help="comma-separated path names to run (default: all)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="windows per path and level, taken in turns (each round starting one path "
                             "later); figures are their medians")
    parser.add_argument("--no-stream", action="store_true",
                        help="non-streaming requests (one JSON body each; TTFT is the whole answer)")
    parser.add_argument("--keep-alive", action="store_true",
                        help="each client loop keeps its connection (as the openai SDK does); by default every "
                        "request opens one and sends Connection: close, as the issue-22 figures were measured")
    parser.add_argument("--think-ms", type=float, default=0.0,
                        help="each client loop pauses a random 0..N ms between requests (kept-alive loops without "
                        "a pause fall into step with the mock and reach the proxy in bursts)")
    parser.add_argument("--server", choices=["mock", "vllm"], default="mock",
                        help="the engine server: the mock (all peers), or vLLM's own server on CPU with the "
                        "default model (direct and Sluice only)")
    parser.add_argument("--out", default=str(HERE / "peers"), help="output prefix (.json, .png)")
    parser.add_argument("--baseline", type=Path,
                        help="another checkout of Sluice (e.g. a git worktree of an older commit): its gateway, "
                        "on the same registry, is measured beside this one's as 'sluice (direct relay) at <commit>'")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    from sluice.embedded_redis import EmbeddedRedis

    logs = Path(tempfile.mkdtemp(prefix="sluice-peers-"))
    procs = Procs(logs)
    try:
        with EmbeddedRedis() as redis:
            only = set(args.only.split(",")) if args.only else None
            if args.server == "vllm":
                paths = start_vllm(procs, args.base_port, redis.url, args.baseline, only)
            else:
                paths = start_all(procs, args.base_port, args.ttft_ms, args.token_ms, redis.url, args.baseline, only)
            if args.only:
                keep = set(args.only.split(","))
                paths = [p for p in paths if p.name in keep or p.name == "direct"]
            print(f"logs in {logs}; {len(paths)} paths x {levels} streams, {args.measure_s:g} s each", flush=True)
            groups = {k: procs.groups[name] for k, name in CPU_GROUPS.items() if name in procs.groups}
            groups["redis"] = -redis.pid  # only Sluice's paths use it
            engine = procs.groups.get("mock") or procs.groups.get("vllm-serve")
            if engine is not None:
                groups["engine"] = engine
            groups.update(load=-os.getpid(), machine=MACHINE)
            results = asyncio.run(measure(paths, levels, args.warmup_s, args.measure_s, args.max_tokens, groups,
                                          args.repeat, stream=not args.no_stream, keep_alive=args.keep_alive,
                                          think_ms=args.think_ms))
    finally:
        procs.stop()
    print(table(results, levels))
    meta = {"server": args.server, "levels": levels, "max_tokens": args.max_tokens, "ttft_ms": args.ttft_ms,
            "repeat": args.repeat, "stream": not args.no_stream, "keep_alive": args.keep_alive, "think_ms": args.think_ms,
            "token_ms": args.token_ms, "measure_s": args.measure_s, "cpus": os.cpu_count(), "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(args.out)
    out.with_suffix(".json").write_bytes(orjson.dumps({"meta": meta, "results": results}, option=orjson.OPT_INDENT_2))
    engine = ("vLLM's own server on CPU (SmolLM2-135M, float32)" if args.server == "vllm" else
              f"one mock engine (first token {args.ttft_ms:g} ms, {args.token_ms:g} ms/token)")
    draw(results, levels, out.with_suffix(".png"),
         f"{engine}, {args.max_tokens} tokens per stream, {os.cpu_count()} cores, "
         f"{'kept-alive connections' if args.keep_alive else 'a connection per request'}"
         f"{f', 0-{args.think_ms:g} ms think time' if args.think_ms else ''}, {meta['at']}")


if __name__ == "__main__":
    main()
