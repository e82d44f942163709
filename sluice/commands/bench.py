"""``sluice bench``: the same load through the gateway and directly at the worker.

Both paths get the same prompts, the same fixed output length (``ignore_eos``)
and greedy decoding, one concurrency level at a time, in one run; each run
starts its prompts with a fresh salt so the prefix cache favours neither path.
Printed per path and concurrency: output tokens/s, TTFT p50/p99, and the
gateway/direct ratios. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

import httpx
import orjson

from sluice.commands.bench_prefix import add_arguments as prefix_arguments

TOPICS = ["rivers", "canal locks", "tides", "dams", "harbours", "rain", "glaciers", "wells"]


@dataclass
class RunResult:
    path: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    ttfts_s: list[float]
    errors: int
    #: Time between consecutive chunks of one stream (inter-chunk gaps), all streams.
    gaps_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def ttft_ms(self, q: float) -> float:
        return _quantile_ms(self.ttfts_s, q)

    def gap_ms(self, q: float) -> float:
        return _quantile_ms(self.gaps_s, q)


def _quantile_ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def _prompts(count: int) -> list[str]:
    salt = uuid.uuid4().hex[:8]
    return [f"[{salt}-{i}] Write a few sentences about {TOPICS[i % len(TOPICS)]}." for i in range(count)]


class _Timing:
    """One stream's time to first chunk, and the gaps between its chunks (into ``gaps``)."""

    def __init__(self, gaps: list[float]) -> None:
        self.started = self._last = time.perf_counter()
        self.ttft = 0.0
        self._gaps = gaps

    def chunk(self) -> None:
        now = time.perf_counter()
        if not self.ttft:
            self.ttft = now - self.started
        else:
            self._gaps.append(now - self._last)
        self._last = now


async def _direct_one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, gaps: list[float]
) -> tuple[float, int]:
    body = {"request_id": uuid.uuid4().hex, "model": model, "prompt": prompt,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    clock = _Timing(gaps)
    tokens, buffer = 0, b""
    async with client.stream("POST", url + "/internal/generate", json=body) as resp:
        resp.raise_for_status()
        async for chunk in resp.aiter_raw():
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line:
                    continue
                data = orjson.loads(line)
                if "error" in data:
                    raise RuntimeError(data["error"]["message"])
                clock.chunk()
                tokens += len(data["ids"])
    return clock.ttft, tokens


async def _gateway_one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, gaps: list[float]
) -> tuple[float, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    clock = _Timing(gaps)
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"]["message"])
            if data["choices"]:
                clock.chunk()
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    return clock.ttft, tokens


async def run_load(path: str, url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> RunResult:
    one = _direct_one if path == "direct" else _gateway_one
    prompts = _prompts(requests)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    ttfts: list[float] = []
    gaps: list[float] = []
    totals = {"tokens": 0, "errors": 0}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=5), limits=limits) as client:

        async def user() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                try:
                    ttft, tokens = await one(client, url, model, prompt, max_tokens, gaps)
                except (httpx.HTTPError, RuntimeError):
                    totals["errors"] += 1
                    continue
                ttfts.append(ttft)
                totals["tokens"] += tokens

        started = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return RunResult(path, concurrency, requests, totals["tokens"], wall, ttfts, totals["errors"], gaps)


def _report(results: list[RunResult]) -> str:
    lines = [
        f"{'path':8} {'conc':>4} {'reqs':>5} {'errors':>6} {'tokens':>7} {'tok/s':>9} "
        f"{'ttft p50 ms':>12} {'ttft p99 ms':>12} {'gap p50 ms':>11} {'gap p99 ms':>11}"
    ]
    for r in results:
        lines.append(
            f"{r.path:8} {r.concurrency:>4} {r.requests:>5} {r.errors:>6} {r.tokens:>7} "
            f"{r.tokens_per_s:>9.1f} {r.ttft_ms(0.5):>12.1f} {r.ttft_ms(0.99):>12.1f} "
            f"{r.gap_ms(0.5):>11.2f} {r.gap_ms(0.99):>11.2f}"
        )
    lines.append("")
    for conc in sorted({r.concurrency for r in results}):
        pair = {r.path: r for r in results if r.concurrency == conc}
        if {"direct", "gateway"} <= set(pair):
            g, d = pair["gateway"], pair["direct"]
            lines.append(
                f"concurrency {conc}: gateway/direct tokens/s = {g.tokens_per_s / d.tokens_per_s:.3f}, "
                f"TTFT p50 = {g.ttft_ms(0.5) / d.ttft_ms(0.5):.3f}x, "
                f"TTFT p99 = {g.ttft_ms(0.99) / d.ttft_ms(0.99):.3f}x, "
                f"inter-chunk gap p50 = {g.gap_ms(0.5) / d.gap_ms(0.5):.3f}x"
            )
    return "\n".join(lines)


async def bench(gateway_url: str, worker_url: str, model: str, levels: list[int], requests: int,
                max_tokens: int, warmup: int) -> list[RunResult]:
    await run_load("gateway", gateway_url, model, 1, warmup, max_tokens)
    results = []
    for conc in levels:
        n = max(requests, conc * 2)
        # Alternate which path goes first, so neither always meets a warmer engine.
        order = ["direct", "gateway"] if conc % 2 else ["gateway", "direct"]
        for path in order:
            url = worker_url if path == "direct" else gateway_url
            results.append(await run_load(path, url, model, conc, n, max_tokens))
    return sorted(results, key=lambda r: (r.concurrency, r.path))


def _worker_url(redis_url: str, model: str) -> str:
    from sluice import keys
    from sluice.redis_url import sync_client

    client = sync_client(redis_url)
    try:
        records = client.hvals(keys.workers(model))
    finally:
        client.close()
    if not records:
        raise SystemExit(f"sluice bench: no worker registered for {model!r}")
    return str(orjson.loads(records[0])["url"])


def main(args: argparse.Namespace) -> int:
    from sluice.commands.up import Supervisor, UpOptions

    if args.scenario == "priority":
        from sluice.commands.bench_priority import main as priority_main

        return priority_main(args)
    if args.scenario == "flood":
        from sluice.commands.bench_flood import main as flood_main

        return flood_main(args)
    if args.scenario == "resilience":
        from sluice.commands.bench_resilience import main as resilience_main

        return resilience_main(args)
    if args.scenario == "prefix":
        from sluice.commands.bench_prefix import main as prefix_main

        return prefix_main(args)
    if args.scenario == "nemesis":
        from sluice.commands.bench_nemesis import main as nemesis_main

        return nemesis_main(args)
    args.requests = args.requests or 32

    options = UpOptions(engine=args.engine, workers=1, port=args.port, model=args.model,
                        log_level="WARNING", worker_args=list(args.worker_arg))
    stack = Supervisor(options)
    try:
        failed = stack.start()
        if failed is not None:
            return failed
        model = httpx.get(stack.url() + "/ready", timeout=5).json()["models"][0]
        worker_url = _worker_url(stack.redis_url or "", model)
        levels = [int(c) for c in args.concurrency.split(",")]
        print(f"sluice bench: engine={args.engine} model={model} max_tokens={args.max_tokens} "
              f"requests>={args.requests} per level, levels={levels}", flush=True)
        results = asyncio.run(bench(stack.url(), worker_url, model, levels, args.requests,
                                    args.max_tokens, args.warmup))
        print(_report(results), flush=True)
        if any(r.errors for r in results):
            return 1
        return 0
    finally:
        stack.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=["overhead", "priority", "flood", "resilience", "prefix", "nemesis"],
                   default="overhead",
                   help="overhead: gateway vs direct worker (default); priority: per-class TTFT and "
                        "shedding at 0.5x and 2x capacity (sim engine); flood: 10k streams over three "
                        "gateways, a gateway kill, a Redis Cluster, fairness between tenants (sim engine); "
                        "resilience: journal cost, worker SIGKILLs under load, a gateway SIGKILL under "
                        "resumable streams (sim engine); prefix: cache-aware vs least-loaded vs "
                        "round-robin routing on shared-prefix workloads (sim engine); nemesis: random faults of every kind "
                        "under load, every stream checked against its exact reference (sim engine)")
    p.add_argument("--duration-s", type=float, default=20.0, help="priority: seconds per phase")
    p.add_argument("--queue-timeout-s", type=float, default=2.0, help="priority: gateway queue timeout")
    p.add_argument("--sim-max-seqs", type=int, default=8, help="priority: sim worker slots")
    p.add_argument("--sim-token-ms", type=float, default=10.0, help="priority: sim decode step")
    p.add_argument("--engine", choices=["sim", "vllm"], default="vllm", help="engine to measure (default vllm)")
    p.add_argument("--model", help="model folder (default: the prepared default model)")
    p.add_argument("--concurrency", default="1,16", help="comma-separated levels (default 1,16)")
    p.add_argument("--requests", type=int, help="requests per path and level (default 32); "
                   "flood: requests in the flood (default 10000)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests before measuring (default 4)")
    p.add_argument("--port", type=int, default=8799, help="gateway port for the private stack")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for the worker (repeatable)")
    flood = p.add_argument_group("flood scenario")
    flood.add_argument("--phases", default="flood,kill,cluster,fair", help="phases to run, in order")
    flood.add_argument("--redis", choices=["single", "cluster"], default="single",
                       help="Redis of the flood, kill and fair phases (the cluster phase always uses a cluster)")
    flood.add_argument("--flood-queue-timeout-s", type=float, default=120.0,
                       help="gateway queue timeout of the flood, kill and cluster phases")
    flood.add_argument("--flood-token-ms", type=float, default=40.0,
                       help="sim decode step of the flood, kill and cluster phases: sets the slots' capacity")
    flood.add_argument("--launch-s", type=float, default=5.0, help="seconds over which a flood is launched")
    flood.add_argument("--load-processes", type=int, default=1, help="load generator processes")
    flood.add_argument("--cluster-requests", type=int, default=5000, help="requests in the cluster flood")
    flood.add_argument("--kill-requests", type=int, default=3000, help="requests in the kill phase")
    flood.add_argument("--kill-load", type=float, default=0.65,
                       help="kill phase arrivals, as a share of what the workers' slots serve")
    flood.add_argument("--kill-lease-ttl-s", type=float, default=3.0, help="kill phase lease TTL")
    flood.add_argument("--fair-duration-s", type=float, default=20.0, help="seconds of load per fairness run")
    flood.add_argument("--fair-rate-a", type=float, default=60.0, help="tenant A req/s (B sends a tenth)")
    flood.add_argument("--fair-b-scale", type=int, default=4, help="second fairness run: B's requests this much larger")
    flood.add_argument("--fair-queue-timeout-s", type=float, default=10.0, help="fairness runs' queue timeout")
    flood.add_argument("--plot", default="loadtest/flood.png", help="chart path")
    flood.add_argument("--json", default="loadtest/flood.json", help="JSON summary path")
    from sluice.commands.bench_resilience import add_arguments as resilience_arguments

    resilience_arguments(p)
    prefix_arguments(p)
    from sluice.commands.bench_nemesis import add_arguments as nemesis_arguments

    nemesis_arguments(p)
