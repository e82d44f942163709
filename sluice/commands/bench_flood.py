"""``sluice bench --scenario flood``: admission at scale, phase by phase, each on a fresh stack.

- ``flood``: 10,000 streaming requests (``--requests``) launched within seconds
  (``--launch-s``), round-robin over three gateways sharing one Redis, onto two sim
  workers, in three priority classes. Watched: Redis connections and RSS per gateway,
  queue length; afterwards, every slot and lease must come back.
- ``kill``: steady arrivals (``--kill-load``) over three gateways with a short lease
  TTL; one gateway is SIGKILLed midway. Its broken streams count as cut by the kill;
  measured: how long until slots in use equal streams really running again, and the
  survivors' queue wait before and after.
- ``cluster``: the flood against a three-master Redis Cluster.
- ``fair``: two API keys of one tier, one asking 10x the other's rate (bench_fair.py).

Printed: a table per phase. Written: a JSON summary (``--json``) and a chart (``--plot``).
A benchmark, not a test: it asserts nothing. Logs of every child stay in a temp folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from sluice.commands.bench_load import Shot
from sluice.commands.bench_probe import Sample, cpu, watched
from sluice.commands.bench_report import (
    by_label,
    pairs,
    quantile,
    statuses,
    table,
    throughput,
)
from sluice.commands.bench_stack import Stack, StackShape, gateway_env

#: (class, priority, share of arrivals out of 10): priority <= -1 is urgent.
CLASSES = [("urgent", -5, 1), ("default", 0, 7), ("low", 5, 2)]
LABELS = [name for name, _, _ in CLASSES]
GATEWAYS = 3
WORKERS = 2
SLOTS = 32
MAX_TOKENS = 8

Phase = Callable[[argparse.Namespace, Path], Coroutine[Any, Any, dict[str, Any]]]


def capacity_rps(args: argparse.Namespace, max_tokens: int = MAX_TOKENS) -> float:
    """Requests per second the workers' slots can serve (prefill 5 ms + decode)."""
    return WORKERS * SLOTS / ((5 + max_tokens * float(args.flood_token_ms)) / 1000)


def flood_shots(count: int, rate: float, route: Callable[[int, float], int], max_tokens: int = MAX_TOKENS,
                ) -> list[Shot]:
    """``count`` shots at ``rate`` per second, classes interleaved; ``route(i, at_s)`` picks the gateway."""
    pattern = [(name, priority) for name, priority, share in CLASSES for _ in range(share)]
    shots = []
    for i in range(count):
        name, priority = pattern[(i * 7) % len(pattern)]
        at_s = i / rate
        shots.append(Shot(at_s=at_s, gateway=route(i, at_s), label=name, priority=priority, max_tokens=max_tokens))
    return shots


def series(samples: list[Sample]) -> dict[str, list[Any]]:
    """Samples as columns, for the JSON summary and the chart."""
    return {
        "t_s": [round(s.t_s, 2) for s in samples], "queued": [s.queued for s in samples],
        "inflight": [s.inflight for s in samples], "running": [s.running for s in samples],
        "connections": [list(s.connections) for s in samples],
    }


def _shape(args: argparse.Namespace, redis: str, **env: str) -> StackShape:
    worker_args = [f"--sim-max-seqs={SLOTS}", f"--sim-token-ms={args.flood_token_ms}", "--sim-ttft-ms=5"]
    return StackShape(gateways=GATEWAYS, workers=WORKERS, redis=redis,
                      gateway_env=gateway_env(args.flood_queue_timeout_s, **env), worker_args=worker_args)


async def _flood(args: argparse.Namespace, logs: Path, name: str, redis: str, count: int) -> dict[str, Any]:
    shots = flood_shots(count, count / args.launch_s, lambda i, _: i % GATEWAYS)
    print(f"\n== {name}: {count} streaming requests in {args.launch_s:.0f} s over {GATEWAYS} gateways "
          f"({redis} redis), {WORKERS} sim workers x {SLOTS} slots, {MAX_TOKENS} tokens x {args.flood_token_ms} ms "
          f"(~{capacity_rps(args):.0f} req/s)", flush=True)
    with Stack(_shape(args, redis), logs, name) as stack:
        outcomes, sampler, after = await watched(stack, shots, args.load_processes)
    result = {
        "requests": count, "redis": redis, "statuses": statuses(outcomes), "classes": by_label(outcomes, LABELS),
        **throughput(outcomes), "redis_connections_max": sampler.max_connections,
        "gateway_rss_mib_max": [round(x, 1) for x in sampler.max_rss_mib], **after,
        **cpu(sampler, after["load_cpu_s"]), "series": series(sampler.samples),
    }
    print("responses: " + pairs(result["statuses"]))
    print(table(result["classes"]))
    print(pairs({k: result[k] for k in ("wall_s", "last_sent_s", "peak_open", "ok_per_s", "inflight_after",
                                        "leases_after", "settle_s")}))
    print(f"redis connections per gateway (max): {sampler.max_connections}; "
          f"gateway RSS MiB (max): {result['gateway_rss_mib_max']}")
    print(f"CPU s: gateways {result['cpu_s_gateways']}, workers {result['cpu_s_workers']}, load generator "
          f"{result['cpu_s_load']}; {os.cpu_count()} cores, load average {result['loadavg']}", flush=True)
    return result


async def flood_phase(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    return await _flood(args, logs, "flood", args.redis, args.requests)


async def cluster_phase(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    return await _flood(args, logs, "cluster", "cluster", args.cluster_requests)


def orphans(samples: list[Sample], killed_s: float, period_s: float) -> dict[str, float]:
    """The killed gateway's slots: how many, and how long until the last came back.

    A live gateway's lease lasts as long as its stream; a dead one's lives until it
    is reaped (up to the lease TTL after its last renewal, or the gateway liveness
    TTL for a grant it never claimed). So leases alive at or after the kill that
    lived more than twice the longest lifetime seen before the kill (2 s at least)
    were orphaned. Recovery: from the kill until the last of them was gone, that is
    until slots in use again equal streams running.
    """
    first: dict[bytes, float] = {}
    last: dict[bytes, float] = {}
    for s in samples:
        for lease in s.lease_ids:
            first.setdefault(lease, s.t_s)
            last[lease] = s.t_s
    before = [last[x] - first[x] for x in first if last[x] < killed_s]
    threshold = max(2.0, 2 * max(before, default=0.0))
    orphaned = [x for x in first if last[x] >= killed_s and last[x] - first[x] > threshold]
    gone_s = max((last[x] for x in orphaned), default=killed_s - period_s) + period_s - killed_s
    return {"orphaned_leases": len(orphaned), "lease_lifetime_max_before_s": max(before, default=0.0),
            "orphans_reclaimed_after_s": gone_s}


async def kill_phase(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    ttl, count = args.kill_lease_ttl_s, args.kill_requests
    # Longer streams than the flood's, so the killed gateway holds many slots and the
    # slots (not the CPU) bind: arrivals at --kill-load of what they can serve.
    max_tokens = 2 * MAX_TOKENS
    rate = args.kill_load * capacity_rps(args, max_tokens)
    kill_at = count / rate / 2
    # After the kill the load balancer sends only to the survivors (gateways 1 and 2).
    shots = flood_shots(count, rate, lambda i, at: i % GATEWAYS if at < kill_at - 0.05 else 1 + i % 2,
                        max_tokens)
    print(f"\n== kill: {count} requests at {rate:.0f}/s ({args.kill_load:.0%} of the slots' capacity, "
          f"{max_tokens} tokens each) over {GATEWAYS} gateways, lease TTL {ttl:.0f} s; gateway 0 SIGKILLed "
          f"at {kill_at:.1f} s", flush=True)
    killed: list[float] = []
    with Stack(_shape(args, args.redis, SLUICE_GATEWAY_LEASE_TTL_S=str(ttl)), logs, "kill") as stack:

        async def kill(start: float) -> None:
            await asyncio.sleep(max(0.0, start + kill_at - time.monotonic()))
            stack.kill_gateway(0)
            killed.append(time.monotonic() - start)

        outcomes, sampler, after = await watched(stack, shots, args.load_processes, period_s=0.1,
                                                 running=True, during=kill)
    killed_s = killed[0]
    cut = [o for o in outcomes if o.gateway == 0 and not o.ok]
    survivors = [o for o in outcomes if o.gateway != 0]
    waits = {when: [o.queue_ms for o in survivors if o.ok and o.queue_ms is not None and o.head_s is not None
                    and (o.head_s < killed_s) == (when == "before")] for when in ("before", "after")}
    p99 = {when: quantile(w, 0.99) for when, w in waits.items()}
    result = {
        "requests": count, "rate": rate, "lease_ttl_s": ttl, "killed_s": killed_s,
        "cut_by_kill": len(cut), "cut_statuses": statuses(cut),
        "killed_gateway_ok": sum(1 for o in outcomes if o.gateway == 0 and o.ok),
        "survivors": statuses(survivors), "survivor_classes": by_label(survivors, LABELS),
        "queue_p99_before_ms": p99["before"], "queue_p99_after_ms": p99["after"],
        "queue_p99_bound_ms": p99["before"] + ttl * 1000, **orphans(sampler.samples, killed_s, 0.1), **after,
        "series": series(sampler.samples),
    }
    print(f"cut by the kill: {len(cut)} of gateway 0's requests ({pairs(result['cut_statuses'])}); "
          f"gateway 0 completed before it: {result['killed_gateway_ok']}")
    print("survivors' responses: " + pairs(result["survivors"]))
    print(table(result["survivor_classes"]))
    print(pairs({k: result[k] for k in ("orphaned_leases", "lease_lifetime_max_before_s",
                                        "orphans_reclaimed_after_s", "queue_p99_before_ms",
                                        "queue_p99_after_ms", "queue_p99_bound_ms", "inflight_after",
                                        "leases_after")}), flush=True)
    return result


def _phases() -> dict[str, Phase]:
    from sluice.commands.bench_fair import fair_phase

    return {"flood": flood_phase, "kill": kill_phase, "cluster": cluster_phase, "fair": fair_phase}


def _finite(value: Any) -> Any:
    """NaN (a quantile of nothing) as null: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def main(args: argparse.Namespace) -> int:
    from sluice.commands.bench_chart import draw

    known = _phases()
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if unknown := [p for p in phases if p not in known]:
        raise SystemExit(f"sluice bench: unknown phase(s) {unknown}; choose from {list(known)}")
    args.requests = args.requests or 10_000
    logs = Path(tempfile.mkdtemp(prefix="sluice-flood-"))
    print(f"sluice bench --scenario flood: phases {phases}; child logs under {logs}", flush=True)
    summary: dict[str, Any] = {"argv": sys.argv, "phases": {}, "logs": str(logs)}
    try:
        for phase in phases:
            summary["phases"][phase] = asyncio.run(known[phase](args, logs))
    finally:
        json_path, plot_path = Path(args.json), Path(args.plot)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(_finite(summary), indent=1))
        if summary["phases"]:
            draw(summary["phases"], plot_path)
        print(f"\nsummary: {json_path}; chart: {plot_path}; logs: {logs}", flush=True)
    return 0
