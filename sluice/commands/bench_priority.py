"""``sluice bench --scenario priority``: per-class TTFT and shedding under 2x overload.

Open-loop arrivals (fixed mix of priority classes) at half the stack's capacity
(the unloaded baseline), then at twice it, in one run against one private
stack. Printed per class: TTFT p50/p99 in both phases, the p99 ratio, and the
share of requests shed (429/503). The target: the top class keeps its p99
within 1.5x of its unloaded p99 while lower classes absorb the overload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import httpx

#: (class name, priority, share of arrivals)
CLASSES = [("high", -10, 0.2), ("default", 0, 0.5), ("low", 10, 0.3)]


@dataclass
class ClassStats:
    ttfts_s: list[float] = field(default_factory=list)
    sent: int = 0
    shed: int = 0
    failed: int = 0

    def q_ms(self, q: float) -> float:
        if not self.ttfts_s:
            return float("nan")
        ordered = sorted(self.ttfts_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def _one(client: httpx.AsyncClient, model: str, priority: int, max_tokens: int, stats: ClassStats) -> None:
    body = {"model": model, "prompt": "priority bench", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "priority": priority}
    started = time.perf_counter()
    stats.sent += 1
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code in (429, 503):
                stats.shed += 1
                return
            if resp.status_code != 200:
                stats.failed += 1
                return
            first = True
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    if "error" in json.loads(line[6:]):
                        stats.failed += 1
                        return
                    if first:
                        stats.ttfts_s.append(time.perf_counter() - started)
                        first = False
    except httpx.HTTPError:
        stats.failed += 1


async def _phase(url: str, model: str, rate: float, duration_s: float, max_tokens: int) -> dict[str, ClassStats]:
    stats = {name: ClassStats() for name, _, _ in CLASSES}
    # A deterministic interleaving of classes in the right proportions.
    pattern = [c for c in CLASSES for _ in range(round(c[2] * 10))]
    limits = httpx.Limits(max_connections=2000)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        tasks = []
        started = time.perf_counter()
        i = 0
        while (now := time.perf_counter() - started) < duration_s:
            due = i / rate
            if due > now:
                await asyncio.sleep(due - now)
            name, priority, _ = pattern[(i * 7) % len(pattern)]
            tasks.append(asyncio.create_task(_one(client, model, priority, max_tokens, stats[name])))
            i += 1
        await asyncio.gather(*tasks)
    return stats


def _report(capacity_rps: float, base: dict[str, ClassStats], over: dict[str, ClassStats]) -> str:
    lines = [
        f"capacity ~{capacity_rps:.0f} req/s; baseline at 0.5x, overload at 2x",
        f"{'class':8} {'base p50':>9} {'base p99':>9} {'over p50':>9} {'over p99':>9} "
        f"{'p99 ratio':>9} {'sent':>6} {'shed %':>7} {'failed':>6}",
    ]
    for name, _, _ in CLASSES:
        b, o = base[name], over[name]
        ratio = o.q_ms(0.99) / b.q_ms(0.99) if b.ttfts_s and o.ttfts_s else float("nan")
        lines.append(
            f"{name:8} {b.q_ms(0.5):>9.1f} {b.q_ms(0.99):>9.1f} {o.q_ms(0.5):>9.1f} {o.q_ms(0.99):>9.1f} "
            f"{ratio:>9.2f} {o.sent:>6} {100 * o.shed / max(o.sent, 1):>6.1f}% {o.failed:>6}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from sluice.commands.up import Supervisor, UpOptions

    os.environ.setdefault("SLUICE_GATEWAY_QUEUE_TIMEOUT_S", str(args.queue_timeout_s))
    seqs, token_ms = args.sim_max_seqs, args.sim_token_ms
    worker_args = [f"--sim-max-seqs={seqs}", f"--sim-token-ms={token_ms}", "--sim-ttft-ms=20",
                   *args.worker_arg]
    stack = Supervisor(UpOptions(engine="sim", workers=1, port=args.port, log_level="WARNING",
                                 worker_args=worker_args))
    try:
        failed = stack.start()
        if failed is not None:
            return failed
        # Each request holds a slot for prefill + max_tokens decode steps.
        service_s = 0.02 + args.max_tokens * token_ms / 1000
        capacity = seqs / service_s
        print(f"sluice bench --scenario priority: sim worker, {seqs} slots, {args.max_tokens} tokens "
              f"x {token_ms} ms, {args.duration_s:.0f} s per phase, queue timeout {args.queue_timeout_s} s",
              flush=True)
        base = asyncio.run(_phase(stack.url(), "sim", capacity * 0.5, args.duration_s, args.max_tokens))
        over = asyncio.run(_phase(stack.url(), "sim", capacity * 2.0, args.duration_s, args.max_tokens))
        print(_report(capacity, base, over), flush=True)
        return 0
    finally:
        stack.stop()
