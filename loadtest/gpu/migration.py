"""Migration at GPU speed: greedy streams, one of the workers SIGKILLed mid-stream, every
stream checked against a reference generated without a fault (see routing_gpu.py).

The migrated streams are the ones the gateway says it moved: each stream sends its own
``x-request-id``, and the gateway's access line for it counts its migrations. A stream's
pause is its longest gap between two chunks after the kill (the gap across the kill's instant
measured nothing on the H200, 2026-12-03: the client's loop, held by the kill itself, read
chunks the dead worker had sent before it died after that instant, and the real pause came
later: 9 ms "across the kill" against 69 ms longest gap); the row also says how varied the greedy texts are (with
dummy weights a model may repeat one token, and a check against a reference then proves
little), and ``streams.jsonl`` keeps every faulted stream beside its reference."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.gpu import diagnose, procstat
from loadtest.gpu.client import Recorder
from loadtest.gpu.fleet import Fleet, FleetShape, log
from loadtest.gpu.routing_gpu import LIMITS, emit, scrape_all
from loadtest.gpu.workloads import text
from sluice.commands.bench_report import quantile

ARM = "cache-approx"  # the default routing


async def streams(url: str, args: argparse.Namespace, prompts: list[str], fleet: Fleet | None,
                  kill_share: float = 1 / 3, rid_prefix: str | None = None,
                  ) -> tuple[list[dict[str, Any]], float | None, str | None]:
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
        recorder.rid_prefix = rid_prefix  # each record keeps its id (rid): the access lines join it
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


def gap_after(times: list[float], at: float) -> float | None:
    """The longest gap between two chunks of a stream that ends after ``at`` (the kill): a
    migrated stream's pause, an unmigrated one's worst wait while the fleet shrank."""
    gaps = [after - before for before, after in zip(times, times[1:], strict=False) if after > at]
    return max(gaps) if gaps else None


def moved_by_gateway(log_path: Path, offset: int, rid_prefix: str, want: int,
                     wait_s: float = 10) -> dict[str, int]:
    """Request id -> migrations, from the gateway's access lines written since ``offset`` for
    requests whose id starts with ``rid_prefix`` (a line is written as its request ends: wait
    up to ``wait_s`` until ``want`` of them are there)."""
    deadline = time.monotonic() + wait_s
    while True:
        lines, _ = diagnose.read_from(log_path, offset)
        found = {a["request_id"]: int(a.get("migrations") or 0) for a in diagnose.access_lines(lines)
                 if str(a.get("request_id", "")).startswith(rid_prefix)}
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def variety(records: list[dict[str, Any]]) -> dict[str, Any]:
    """How much the checked texts can tell: distinct texts, and per stream the distinct chunks
    (about tokens) and the longest run of one chunk repeated."""
    texts = [r["text"] for r in records if r["error"] is None]
    distinct_chunks, runs = [], []
    for r in records:
        pieces = r.get("pieces") or []
        distinct_chunks.append(len(set(pieces)))
        run = best = 0
        for a, b in zip([None, *pieces], pieces, strict=False):
            run = run + 1 if a == b else 1
            best = max(best, run)
        runs.append(best)
    n = max(len(records), 1)
    return {"distinct_texts": len(set(texts)), "distinct_chunks_per_stream_mean": round(sum(distinct_chunks) / n, 1),
            "distinct_chunks_per_stream_min": min(distinct_chunks, default=0),
            "longest_repeat_run_mean": round(sum(runs) / n, 1)}


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
        reference, _, _ = asyncio.run(streams(url, args, prompts, None, rid_prefix="mref"))
        repeat, _, _ = asyncio.run(streams(url, args, prompts, None, rid_prefix="mrep"))

        async def counters() -> dict[str, float]:
            async with httpx.AsyncClient(timeout=30) as http:
                return await scrape_all(http, url, args.gateway_procs)

        before = asyncio.run(counters())
        cpu0 = procstat.tree_cpu_s(fleet.gateway_pid(ARM))
        gw_log = mlogs / f"gateway-{ARM}.log"
        offset = diagnose.offsets([gw_log])[gw_log]
        started = time.perf_counter()
        faulted, killed_at, victim = asyncio.run(streams(url, args, prompts, fleet, rid_prefix="mflt"))
        wall = time.perf_counter() - started
        cpu = procstat.tree_cpu_s(fleet.gateway_pid(ARM)) - cpu0
        after = asyncio.run(counters())
        moves = moved_by_gateway(gw_log, offset, "mflt", len(prompts))
    migrated = int(after["migrations"] - before["migrations"])
    ok = [r for r in faulted if r["error"] is None]
    moved = {i for i, r in enumerate(faulted) if moves.get(r.get("rid", ""), 0) > 0}
    across = [gap_after(r["times"], killed_at) if killed_at is not None else None for r in faulted]
    gaps = sorted((g for i, g in enumerate(across) if g is not None and faulted[i]["error"] is None), reverse=True)
    if moves:  # the gateway's own word: each migrated stream's longest gap after the kill
        pauses = sorted(g for i in moved if (g := across[i]) is not None and faulted[i]["error"] is None)
        unmoved = [g for i, g in enumerate(across) if g is not None and i not in moved and faulted[i]["error"] is None]
    else:  # no access lines: the largest such gaps, one per migration counted
        pauses, unmoved = gaps[:migrated], gaps[migrated:]
    chunks = sum(r["chunks"] for r in ok)
    with open(mlogs / "streams.jsonl", "w") as f:
        for i, (ref, rep, got) in enumerate(zip(reference, repeat, faulted, strict=True)):
            f.write(json.dumps({
                "index": i, "migrated": i in moved, "error": got["error"], "completion": got.get("completion"),
                "chunks": got["chunks"], "ttft_ms": round(1000 * got["ttft"], 1) if got["ttft"] else None,
                "gap_after_kill_ms": round(1000 * across[i], 1) if across[i] is not None else None,
                "max_gap_ms": round(1000 * max((b - a for a, b in zip(got["times"], got["times"][1:], strict=False)),
                                               default=0), 1),
                "same_as_reference": got["text"] == ref["text"], "repeat_same": rep["text"] == ref["text"],
                "sha1": hashlib.sha1(got["text"].encode()).hexdigest()[:12], "text": got["text"],
                "reference": None if got["text"] == ref["text"] else ref["text"]}) + "\n")
    row = {
        "phase": "migration", "model": args.model, "dummy_weights": os.environ.get("SLUICE_BENCH_DUMMY", "1") == "1",
        **({"label": args.label} if args.label else {}), "worker_env": env, "streams": len(prompts), "stream_tokens": args.stream_tokens,
        "killed": victim, "killed_at_s": round(killed_at or 0, 3), "migrated": migrated,
        "lost": len(faulted) - len(ok), "errors": len(faulted) - len(ok),
        "error_kinds": sorted({str(r["error"])[:80] for r in faulted if r["error"]})[:5],
        "short": sum(1 for r in ok if r["completion"] != args.stream_tokens),
        "reference_repeat_diff": sum(1 for a, b in zip(reference, repeat, strict=True) if a["text"] != b["text"]),
        "reference_errors": sum(1 for r in reference + repeat if r["error"] is not None),
        "diff_vs_reference": sum(1 for a, b in zip(reference, faulted, strict=True)
                                 if b["error"] is None and a["text"] != b["text"]),
        "migrated_streams": len(moved) if moves else None, "access_lines": len(moves),
        "migrated_diff_vs_reference": sum(1 for i in moved if faulted[i]["text"] != reference[i]["text"]),
        "pause_source": "access lines" if moves else "largest gaps",
        "pause_measure": "longest gap after the kill",
        "pause_p50_ms": round(1000 * quantile(pauses, 0.5), 1) if pauses else None,
        "pause_p99_ms": round(1000 * quantile(pauses, 0.99), 1) if pauses else None,
        "pause_max_ms": round(1000 * max(pauses), 1) if pauses else None,
        "gap_p50_ms_unmigrated": round(1000 * quantile(unmoved, 0.5), 1) if unmoved else None,
        "gap_p99_ms_unmigrated": round(1000 * quantile(unmoved, 0.99), 1) if unmoved else None,
        **variety(reference),
        "out_tok_s": round(sum(r["completion"] for r in ok) / wall, 1), "wall_s": round(wall, 2),
        "gateway_cpu_us_per_chunk": round(1e6 * cpu / max(chunks, 1), 1),
        "gateway_cpu_ms_per_req": round(1000 * cpu / max(len(faulted), 1), 3),
        "users_per_client": getattr(args, "users_per_client", 8),
        "ttft_p50_ms": round(1000 * quantile([r["ttft"] for r in ok], 0.5), 1) if ok else None,
        "ttft_p99_ms": round(1000 * quantile([r["ttft"] for r in ok], 0.99), 1) if ok else None,
    }
    emit(out, row)
    return [row]
