"""``sluice bench --scenario prefix``: cache-aware routing against least-loaded and round robin.

Each arm runs one workload on a fresh stack (Redis, 4 sim workers with a prefix cache,
1 or 3 gateways; the client spreads requests over the gateways), one arm after another:

- ``w1``: shared prefixes: groups x prompts (2,048-word prefix + 256-word question),
  all shuffled, closed loop with 3/4 of the fleet's slots as users (SGLang's shape).
- ``w3``: prefixes whose total exceeds one worker's cache but fits the cluster's
  (about 80% of it: llm-d's shape), open loop: every round each group sends one request,
  in a shuffled order, at a fixed rate (above what round robin's prefill can serve).
- ``w5``: no shared prefix (control), closed loop.
- ``chat``: users x rounds, each round re-sends the whole history plus a new message,
  with the user's conversation as its ``prompt_cache_key``. A routing arm ``R+bounded`` or
  ``R+cost`` runs routing R with that session affinity (gateway/admission/affinity.py); a
  plain arm runs with affinity off.

The simulator is scaled to run in minutes on two cores: words are tokens; prefill costs
``--prefix-prefill-ms`` per uncached token in chunks of 512 per step; a decode step
takes ``--prefix-token-ms``; outputs are shorter than the peers' (``--prefix-max-tokens``).

Printed per arm: TTFT p50/p90/p99, output tokens/s, the engines' cache hit rate
(``cached_tokens / prompt_tokens`` from every response's usage), routing accuracy
(1 - |expected - reported cached tokens| / prompt tokens, from the gateways' /metrics),
the ACQUIRE script's time in Redis (p99, from SLOWLOG), Redis calls per request
(INFO commandstats, heartbeats included) and the busiest worker's share of all prompt
blocks (``busiest_pct``: 25 is an even spread over 4 workers; a hot spot shows above it).
Then the issue's ratios, a JSON summary and a chart.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.admission import scripts
from sluice import keys
from sluice.commands.bench_report import quantile, table
from sluice.commands.bench_stack import MODEL, Stack, StackShape, sync_client

Messages = list[dict[str, str]]
WORKERS, SLOTS = 4, 16
#: Each worker's prefix cache, in blocks of 64 tokens: W3's 32 prefixes of 32 blocks need
#: 80% of the four workers' caches together, and a third of them fit one worker.
CACHE_BLOCKS = 320
#: Closed-loop users, below the fleet's slots: at exactly the slot count every freed slot
#: goes to whoever is next, and no router has a choice to make.
USERS = WORKERS * SLOTS * 3 // 4


@dataclass
class Arm:
    workload: str
    routing: str
    gateways: int = 1

    @property
    def name(self) -> str:
        return f"{self.workload} {self.routing} x{self.gateways}gw"


@dataclass
class Tally:
    ttfts: list[float] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    errors: int = 0


class Client:
    """Streams chat completions over the gateways (round robin), tallying each answer."""

    def __init__(self, http: httpx.AsyncClient, urls: list[str], max_tokens: int) -> None:
        self._http, self._urls, self.max_tokens = http, urls, max_tokens
        self._turn = 0
        self.tally = Tally()

    async def chat(self, messages: Messages, session: str | None = None) -> str:
        url = self._urls[self._turn % len(self._urls)]
        self._turn += 1
        body = {"model": MODEL, "messages": messages, "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        if session is not None:
            body["prompt_cache_key"] = session
        started, first, text = time.perf_counter(), 0.0, []
        try:
            async with self._http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    self.tally.errors += 1
                    return ""
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = orjson.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        first = first or time.perf_counter() - started
                        text.append(chunk["choices"][0]["delta"]["content"])
                    if usage := chunk.get("usage"):
                        self.tally.prompt += usage["prompt_tokens"]
                        self.tally.completion += usage["completion_tokens"]
                        self.tally.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        except httpx.HTTPError:
            self.tally.errors += 1
            return ""
        self.tally.ttfts.append(first)
        return "".join(text)


def _words(tag: str, count: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


async def _closed(client: Client, prompts: list[Messages], concurrency: int) -> None:
    queue = list(reversed(prompts))

    async def user() -> None:
        while queue:
            await client.chat(queue.pop())

    await asyncio.gather(*(user() for _ in range(concurrency)))


async def _open(client: Client, prompts: list[Messages], rate: float) -> None:
    start = time.perf_counter()
    tasks = []
    for i, messages in enumerate(prompts):
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(client.chat(messages)))
    await asyncio.gather(*tasks)


def _ask(system: str, question: str) -> Messages:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def workload(name: str, args: argparse.Namespace) -> Callable[[Client], Awaitable[None]]:
    rng = random.Random(7)
    if name == "w1":
        groups, per = args.w1_groups, args.w1_prompts
        prompts = [_ask(_words(f"g{g}w", 2048), _words(f"g{g}q{p}w", 256)) for g in range(groups) for p in range(per)]
        rng.shuffle(prompts)
        return lambda c: _closed(c, prompts, USERS)
    if name == "w3":
        rounds = []
        for r in range(args.w3_rounds):
            order = list(range(args.w3_groups))
            rng.shuffle(order)
            rounds += [_ask(_words(f"d{g}w", 2048), _words(f"d{g}r{r}w", 128)) for g in order]
        return lambda c: _open(c, rounds, args.w3_rate)
    if name == "w5":
        prompts = [_ask(_words(f"u{i}s", 16), _words(f"u{i}w", 512)) for i in range(args.w5_requests)]
        return lambda c: _closed(c, prompts, USERS)
    if name == "chat":
        async def user(client: Client, u: int) -> None:
            history: Messages = [{"role": "system", "content": _words(f"c{u}s", 512)}]
            for r in range(args.chat_rounds):
                history.append({"role": "user", "content": _words(f"c{u}r{r}w", 64)})
                history.append({"role": "assistant", "content": await client.chat(history, f"c{u}")})

        return lambda c: asyncio.gather(*(user(c, u) for u in range(args.chat_users)))  # type: ignore[return-value]
    raise SystemExit(f"sluice bench: unknown workload {name!r}")


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'model="{MODEL}"' in line)


async def _gateway_counters(http: httpx.AsyncClient, urls: list[str]) -> dict[str, float]:
    out = {"prompt": 0.0, "error": 0.0}
    for url in urls:
        text = (await http.get(url + "/metrics")).text
        out["prompt"] += _metric(text, "sluice_gateway_prompt_tokens_total")
        out["error"] += _metric(text, "sluice_gateway_prefix_error_tokens_total")
    return out


def _redis_figures(client: Any, requests: int) -> tuple[float, float]:
    """(ACQUIRE p99 in Redis, ms; Redis commands per request) since the stats were reset."""
    calls = sum(int(v["calls"]) for k, v in client.info("commandstats").items() if k.startswith("cmdstat_"))
    sha = hashlib.sha1(scripts.ACQUIRE.encode()).hexdigest()
    acquire_us = [e["duration"] for e in client.slowlog_get(1_000_000)
                  if len(e["command"].split()) > 1 and e["command"].split()[1].decode() == sha]
    return quantile(acquire_us, 0.99) / 1000, calls / max(requests, 1)


def _busiest_share(client: Any) -> float:
    """The share of all prompt blocks that went to the busiest worker (0.25 of 4 is even),
    from the engines' own counts in their heartbeats."""
    queried = [float(orjson.loads(v).get("prefix_queries", 0)) for v in client.hvals(keys.stats(MODEL))]
    return max(queried) / sum(queried) if queried and sum(queried) else float("nan")


async def run_arm(arm: Arm, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    worker_args = [f"--sim-max-seqs={SLOTS}", f"--sim-token-ms={args.prefix_token_ms}", "--sim-ttft-ms=0",
                   f"--sim-prefill-ms-per-token={args.prefix_prefill_ms}", f"--sim-cache-blocks={CACHE_BLOCKS}"]
    routing, _, affinity = arm.routing.partition("+")
    env = {"SLUICE_GATEWAY_ROUTING": routing, "SLUICE_GATEWAY_SESSION_AFFINITY": affinity or "off",
           "SLUICE_GATEWAY_MAX_QUEUE": "10000",
           "SLUICE_GATEWAY_QUEUE_TIMEOUT_S": "300"}
    if args.route_hot_share is not None:
        env["SLUICE_GATEWAY_ROUTE_HOT_SHARE"] = str(args.route_hot_share)
    if args.route_load_blocks is not None:
        env["SLUICE_GATEWAY_ROUTE_LOAD_BLOCKS"] = str(args.route_load_blocks)
    if args.route_prefill_weight is not None:
        env["SLUICE_GATEWAY_ROUTE_PREFILL_WEIGHT"] = str(args.route_prefill_weight)
    shape = StackShape(gateways=arm.gateways, workers=WORKERS, gateway_env=env, worker_args=worker_args)
    with Stack(shape, logs, label=arm.name.replace(" ", "-")) as stack:
        redis = sync_client(stack.redis_url)
        redis.config_set("slowlog-log-slower-than", 0)
        redis.config_set("slowlog-max-len", 200_000)
        redis.slowlog_reset()
        redis.config_resetstat()
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512)) as http:
            client = Client(http, stack.gateway_urls, args.prefix_max_tokens)
            started = time.perf_counter()
            await workload(arm.workload, args)(client)
            wall = time.perf_counter() - started
            counters = await _gateway_counters(http, stack.gateway_urls)
        acquire_ms, calls = _redis_figures(redis, len(client.tally.ttfts) + client.tally.errors)
        await asyncio.sleep(1.5)  # every worker's next heartbeat carries its final counts
        busiest = _busiest_share(redis)
        redis.close()
    t = client.tally
    return {
        "arm": arm.name, "requests": len(t.ttfts), "errors": t.errors,
        "ttft_p50_ms": quantile(t.ttfts, 0.5) * 1000, "ttft_p90_ms": quantile(t.ttfts, 0.9) * 1000,
        "ttft_p99_ms": quantile(t.ttfts, 0.99) * 1000, "out_tok_s": t.completion / wall,
        "hit_rate": t.cached / max(t.prompt, 1), "hit_pct": 100 * t.cached / max(t.prompt, 1),
        "busiest_pct": 100 * busiest,
        # Only cache routing expects anything; the other arms are not checked.
        "accuracy": 1 - counters["error"] / counters["prompt"]
        if counters["prompt"] and arm.routing.startswith("cache") else float("nan"),
        "acquire_p99_ms": acquire_ms, "redis_calls_per_req": calls, "wall_s": wall,
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's figures over its runs: each the median (the arm's name from the first)."""
    if len(runs) == 1:
        return runs[0]
    return {k: runs[0][k] if isinstance(runs[0][k], str) else statistics.median(r[k] for r in runs)
            for k in runs[0]}


def _ratios(rows: dict[str, dict[str, Any]]) -> list[str]:
    def get(name: str, key: str) -> float:
        return float(rows[name][key]) if name in rows else float("nan")

    lines = [
        f"W3 P90 TTFT, round robin / cache: {get('w3 rr x1gw', 'ttft_p90_ms') / get('w3 cache x1gw', 'ttft_p90_ms'):.1f}x (goal >= 10x)",
        f"W3 hit rate, cache / round robin: {get('w3 cache x1gw', 'hit_rate') / get('w3 rr x1gw', 'hit_rate'):.1f}x (goal >= 3.8x)",
        f"W1 output tok/s, cache / round robin: {get('w1 cache x1gw', 'out_tok_s') / get('w1 rr x1gw', 'out_tok_s'):.2f}x (goal >= 1.9x)",
        f"W5 output tok/s, cache / least loaded: {get('w5 cache x1gw', 'out_tok_s') / get('w5 least x1gw', 'out_tok_s'):.3f} (goal within 5%)",
        f"W5 P90 TTFT, cache / least loaded: {get('w5 cache x1gw', 'ttft_p90_ms') / get('w5 least x1gw', 'ttft_p90_ms'):.3f}",
    ]
    for variant in ("least+bounded", "cache+bounded", "cache+cost"):
        if f"chat {variant} x1gw" in rows:
            plain = variant.split("+")[0]
            ttft = get(f"chat {variant} x1gw", "ttft_p90_ms") / get(f"chat {plain} x1gw", "ttft_p90_ms")
            points = 100 * (get(f"chat {variant} x1gw", "hit_rate") - get(f"chat {plain} x1gw", "hit_rate"))
            lines.append(f"CHAT session affinity, {variant} / {plain}: P90 TTFT {ttft:.2f}x, hit rate {points:+.1f} points")
    for w in ("w1", "w3", "chat"):
        if f"{w} cache x3gw" in rows:
            points = 100 * (get(f"{w} cache x3gw", "hit_rate") - get(f"{w} cache x1gw", "hit_rate"))
            lines.append(f"{w.upper()} hit rate, 3 gateways - 1 gateway: {points:+.1f} points (goal within 2)")
    return lines


def draw(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    names = [r["arm"] for r in rows]
    colors = ["tab:green" if "cache" in n else "tab:orange" if "rr" in n else "tab:blue" for n in names]
    for ax, key, title in zip(axes, ("ttft_p90_ms", "out_tok_s", "hit_rate"),
                              ("TTFT p90 (ms, log)", "output tokens/s", "engine cache hit rate"), strict=True):
        ax.barh(names, [r[key] for r in rows], color=colors)
        ax.set_title(title)
        ax.invert_yaxis()
        if key == "ttft_p90_ms":
            ax.set_xscale("log")
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.suptitle("sluice bench --scenario prefix: cache (green) vs round robin (orange) vs least loaded (blue)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    routings = [r.strip() for r in args.routings.split(",") if r.strip()]
    arms = [Arm(w, r) for w in workloads for r in routings]
    if args.replicas > 1:
        arms += [Arm(w, r, args.replicas) for r in routings if r.startswith("cache") for w in workloads if w != "w5"]
    logs = Path(tempfile.mkdtemp(prefix="sluice-prefix-"))
    print(f"sluice bench --scenario prefix: {WORKERS} sim workers x {SLOTS} slots, {CACHE_BLOCKS} cache blocks "
          f"each; prefill {args.prefix_prefill_ms} ms/token, decode step {args.prefix_token_ms} ms, "
          f"{args.prefix_max_tokens} output tokens; logs under {logs}", flush=True)
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeat):
        for arm in arms:
            runs.append(asyncio.run(run_arm(arm, args, logs)))
            print(table(runs[-1:]), flush=True)
    rows = [_median([r for r in runs if r["arm"] == arm.name]) for arm in arms]
    print("\n" + table(rows))
    print("\n".join(_ratios({r["arm"]: r for r in rows})))
    Path(args.prefix_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.prefix_json).write_text(json.dumps({"argv": sys.argv, "rows": rows, "runs": runs}, indent=1))
    draw(rows, Path(args.prefix_plot))
    print(f"summary: {args.prefix_json}; chart: {args.prefix_plot}")
    return 1 if any(r["errors"] for r in rows) else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefix scenario")
    g.add_argument("--workloads", default="w1,w3,w5,chat", help="workloads to run, in order")
    g.add_argument("--routings", default="least,rr,cache", help="routing arms, each on every workload")
    g.add_argument("--repeat", type=int, default=1,
                   help="run every arm this many times, interleaved; figures are the medians")
    g.add_argument("--replicas", type=int, default=3, help="gateways of the extra cache arms (1: none)")
    g.add_argument("--route-hot-share", type=float, help="cache arms: SLUICE_GATEWAY_ROUTE_HOT_SHARE")
    g.add_argument("--route-load-blocks", type=float, help="cache arms: SLUICE_GATEWAY_ROUTE_LOAD_BLOCKS")
    g.add_argument("--route-prefill-weight", type=float, help="cache arms: SLUICE_GATEWAY_ROUTE_PREFILL_WEIGHT")
    g.add_argument("--prefix-prefill-ms", type=float, default=0.2, help="sim prefill cost per uncached token")
    g.add_argument("--prefix-token-ms", type=float, default=10.0, help="sim decode step")
    g.add_argument("--prefix-max-tokens", type=int, default=32, help="output tokens per request")
    g.add_argument("--w1-groups", type=int, default=16)
    g.add_argument("--w1-prompts", type=int, default=16)
    g.add_argument("--w3-groups", type=int, default=32, help="W3 prefixes of 2,048 words (128 blocks each)")
    g.add_argument("--w3-rounds", type=int, default=16)
    g.add_argument("--w3-rate", type=float, default=14.0, help="W3 arrivals per second")
    g.add_argument("--w5-requests", type=int, default=256)
    g.add_argument("--chat-users", type=int, default=32)
    g.add_argument("--chat-rounds", type=int, default=6)
    g.add_argument("--prefix-plot", default="loadtest/prefix.png", help="chart path")
    g.add_argument("--prefix-json", default="loadtest/prefix.json", help="JSON summary path")
