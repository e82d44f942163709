"""Migration at GPU speed: greedy streams, one of the workers SIGKILLed mid-stream, every
stream checked against a reference generated without a fault (see routing_gpu.py)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.gpu import procstat
from loadtest.gpu.client import Recorder
from loadtest.gpu.fleet import Fleet, FleetShape, log
from loadtest.gpu.routing_gpu import LIMITS, emit, scrape_all
from loadtest.gpu.workloads import text
from sluice.commands.bench_report import quantile

ARM = "cache-approx"  # the default routing


async def streams(url: str, args: argparse.Namespace, prompts: list[str], fleet: Fleet | None,
                  kill_share: float = 1 / 3) -> tuple[list[dict[str, Any]], float | None, str | None]:
    """Every prompt at once; with ``fleet``, the busiest worker is SIGKILLed once the streams
    have received ``kill_share`` of their tokens. Returns the records, the kill's time and the victim.

    Every ``args.users_per_client`` streams share an HTTP client of their own (0: one for all),
    as in the routing bench (client.closed_loop): one httpx client for hundreds of streams
    spends its time in httpcore's pool bookkeeping, quadratic in connections (README, 2026-12-03)."""
    per = getattr(args, "users_per_client", 8)
    groups = -(-len(prompts) // per) if per > 0 else 0
    clients = [httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2 * per,
                                                                  max_keepalive_connections=2 * per))
               for _ in range(groups)]
    async with httpx.AsyncClient(timeout=600, limits=LIMITS) as http:
        recorder = Recorder(http, url, args.served)
        tasks = [asyncio.create_task(recorder.send(
            {"prompt": p, "max_tokens": args.stream_tokens, "ignore_eos": True}, path="/v1/completions",
            keep_times=True, http=clients[i // per] if clients else None, index=i)) for i, p in enumerate(prompts)]
        killed_at, victim = None, None
        if fleet is not None:
            goal = kill_share * len(prompts) * args.stream_tokens
            while recorder.received < goal and not all(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            load = fleet.in_flight()
            victim = max(load, key=lambda w: load[w]) if load else "w0"
            fleet.kill_worker(int(victim.lstrip("w")))
            killed_at = time.perf_counter() - recorder.t0
            log(f"SIGKILL {victim} (in flight {load}) at {killed_at:.2f} s")
        try:
            await asyncio.gather(*tasks)
        finally:
            for client in clients:
                await client.aclose()
    return sorted(recorder.records, key=lambda r: r["index"]), killed_at, victim


def gap_across(times: list[float], at: float) -> float | None:
    for before, after in zip(times, times[1:], strict=False):
        if before <= at < after:
            return after - before
    return None


def migration_phase(args: argparse.Namespace, shape: FleetShape, out: Path, logs: Path) -> list[dict[str, Any]]:
    env = dict(kv.split("=", 1) for kv in args.migration_env.split(",") if "=" in kv)
    shape = dataclasses.replace(shape, worker_env=env, max_num_seqs=args.migration_max_num_seqs)
    mlogs = logs / "migration"
    mlogs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(5)
    prompts = [f"Story {i}: " + text(rng, 48) for i in range(args.streams)]
    with Fleet(shape, mlogs) as fleet:
        t0 = time.monotonic()
        fleet.start_gateways([ARM], args.tokenizer)
        start_s = args.start_timeout_s
        if args.deadline:  # the three runs and the stop take ~40 s at GPU speed
            start_s = min(start_s, args.deadline - time.time() - 45)
        fleet.start_workers(start_s)
        log(f"migration: {shape.workers} workers ({env}) registered after {time.monotonic() - t0:.1f} s")
        url = fleet.gateways[ARM][1]
        reference, _, _ = asyncio.run(streams(url, args, prompts, None))
        repeat, _, _ = asyncio.run(streams(url, args, prompts, None))

        async def counters() -> dict[str, float]:
            async with httpx.AsyncClient(timeout=30) as http:
                return await scrape_all(http, url, args.gateway_procs)

        before = asyncio.run(counters())
        cpu0 = procstat.tree_cpu_s(fleet.gateway_pid(ARM))
        started = time.perf_counter()
        faulted, killed_at, victim = asyncio.run(streams(url, args, prompts, fleet))
        wall = time.perf_counter() - started
        cpu = procstat.tree_cpu_s(fleet.gateway_pid(ARM)) - cpu0
        after = asyncio.run(counters())
    migrated = int(after["migrations"] - before["migrations"])
    ok = [r for r in faulted if r["error"] is None]
    gaps = sorted((g for r in ok if killed_at is not None and (g := gap_across(r["times"], killed_at)) is not None),
                  reverse=True)
    pauses = gaps[:migrated] if migrated else []
    chunks = sum(r["chunks"] for r in ok)
    row = {
        "phase": "migration", "worker_env": env, "streams": len(prompts), "stream_tokens": args.stream_tokens,
        "killed": victim, "killed_at_s": round(killed_at or 0, 3), "migrated": migrated,
        "lost": len(faulted) - len(ok), "errors": len(faulted) - len(ok),
        "error_kinds": sorted({str(r["error"])[:80] for r in faulted if r["error"]})[:5],
        "short": sum(1 for r in ok if r["completion"] != args.stream_tokens),
        "reference_repeat_diff": sum(1 for a, b in zip(reference, repeat, strict=True) if a["text"] != b["text"]),
        "diff_vs_reference": sum(1 for a, b in zip(reference, faulted, strict=True)
                                 if b["error"] is None and a["text"] != b["text"]),
        "pause_p50_ms": round(1000 * quantile(pauses, 0.5), 1) if pauses else None,
        "pause_p99_ms": round(1000 * quantile(pauses, 0.99), 1) if pauses else None,
        "pause_max_ms": round(1000 * max(pauses), 1) if pauses else None,
        "gap_p50_ms_unmigrated": round(1000 * quantile(gaps[migrated:], 0.5), 1) if gaps[migrated:] else None,
        "out_tok_s": round(sum(r["completion"] for r in ok) / wall, 1), "wall_s": round(wall, 2),
        "gateway_cpu_us_per_chunk": round(1e6 * cpu / max(chunks, 1), 1),
        "gateway_cpu_ms_per_req": round(1000 * cpu / max(len(faulted), 1), 3),
        "users_per_client": getattr(args, "users_per_client", 8),
        "ttft_p50_ms": round(1000 * quantile([r["ttft"] for r in ok], 0.5), 1) if ok else None,
        "ttft_p99_ms": round(1000 * quantile([r["ttft"] for r in ok], 0.99), 1) if ok else None,
    }
    emit(out, row)
    return [row]
