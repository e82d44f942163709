"""Routing and migration at GPU speed: 4 vLLM workers sharing one GPU, one gateway per arm.

Phase ``routing``: the workers start once (dummy weights, a fixed number of KV blocks each,
KV events published for the precise index); one gateway per arm (rr, least, cache-approx,
cache-precise; least-slots, least-wW[sS]: least's other settings, fleet.py;
``--gateway-procs`` processes each); then, per workload (overflow, easy, w5, chat:
loadtest/gpu/workloads.py), every arm in turn (each workload starting with another arm) on
prompts of its own (no arm finds another's blocks), for ``--arm-s`` seconds, or the arms
left's share of the time to ``--deadline``. Per arm, one JSON line: hit rate (sum of
``cached_tokens`` / sum of prompt tokens), TTFT p50/p90/p99 and output tok/s over the
requests started after ``--warmup-s`` (``*_all``: every request), the router's predicted hit
and its error (the gateway's ``prefix_expected`` / ``prefix_error`` counters), errors, and
CPU: the arm's gateway (all its processes) per request and per chunk, beside the vLLM
workers' (worker + engine core) per request.

Each arm also says where its TTFT went (``diag``: loadtest/gpu/diagnose.py): the client's
requests joined with the gateway's access lines (queue wait, TTFT, worker) and vLLM's own
per-request stats (its waiting queue, its prefill; loadtest/gpu/probe_worker.py), the
engines' scheduler (running, waiting, KV use, preemptions, steps, pauses), CPU per process
group, runnable threads, steal and GPU busy (loadtest/gpu/sampler.py), and the load
generator's own event-loop lateness. Arm ``direct`` has no gateway (the client sends to the
workers in turn); ``ARM@N`` runs ARM with N users (``--first-only``: for the first workload).

Phase ``migration``: fresh workers (``--migration-env``, e.g. ``VLLM_BATCH_INVARIANT=1``),
``--streams`` greedy completions at once, run twice without a fault (the reference, and its
repeat to show the reference is deterministic), then once more with one worker SIGKILLed
(its process group: worker and engine core) when the streams are a third through. Every
stream must finish with the reference's text exactly (no gap, no repeat, the continuation
conditioned on exactly the prompt plus the tokens sent); the pause is each migrated
stream's gap across the kill.

    python -m loadtest.gpu.routing_gpu --phase routing --engine vllm --model /tmp/m_1b --out $OUT   (device;
        loadtest/gpu/session.sh runs it with the migration and the P/D phase)
    python -m loadtest.gpu.routing_gpu --phase routing,migration --engine sim --out /tmp/o --quick \
        --tokenizer ~/.cache/sluice/models/SmolLM2-135M-Instruct                                    (rehearsal)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.gpu import diagnose, procstat
from loadtest.gpu.chart import draw
from loadtest.gpu.client import DirectRecorder, Recorder, closed_loop
from loadtest.gpu.fleet import ARMS, Fleet, FleetShape, log, stop_on_sigterm
from loadtest.gpu.sampler import Sampler
from loadtest.gpu.workloads import Sizes, describe, plan, text
from sluice.commands.bench_report import quantile, table

LIMITS = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
#: The arm without a gateway: the client sends to the workers in turn (loadtest/gpu/client.py).
DIRECT = "direct"


def metric(body: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", body, re.M))


def ms(values: list[float], q: float) -> float | None:
    return round(quantile(values, q) * 1000, 1) if values else None


def summarize(workload: str, arm: str, records: list[dict[str, Any]], wall: float, cpu: dict[str, float],
              counters: dict[str, float], warmup_s: float) -> dict[str, Any]:
    """The arm's figures. Hit rate, TTFT and throughput are over the steady part: requests
    that started ``warmup_s`` or more into the arm (the first wave of a closed loop meets
    empty caches and a burst of cold prefills at once; with a short arm it decides P90);
    ``*_all`` over every request."""
    ok = [r for r in records if r["error"] is None]
    steady = [r for r in ok if r["t_start"] >= warmup_s]
    span = max((r["t_end"] for r in steady), default=wall) - warmup_s
    chunks = sum(r["chunks"] for r in ok)

    def hit(rs: list[dict[str, Any]]) -> float:
        return round(100 * sum(r["cached"] for r in rs) / max(sum(r["prompt"] for r in rs), 1), 2)

    ttfts = [r["ttft"] for r in steady]
    every = [r["ttft"] for r in ok]
    out = {
        "phase": "routing", "workload": workload, "arm": arm, "requests": len(records), "ok": len(ok),
        "errors": len(records) - len(ok),
        "error_kinds": sorted({str(r["error"])[:80] for r in records if r["error"]})[:5],
        "steady_requests": len(steady), "warmup_s": warmup_s,
        "hit_pct": hit(steady), "hit_pct_all": hit(ok),
        "prompt_tok_avg": round(sum(r["prompt"] for r in ok) / max(len(ok), 1), 1),
        "ttft_p50_ms": ms(ttfts, 0.5), "ttft_p90_ms": ms(ttfts, 0.9), "ttft_p99_ms": ms(ttfts, 0.99),
        "ttft_p50_ms_all": ms(every, 0.5), "ttft_p90_ms_all": ms(every, 0.9),
        "out_tok_s": round(sum(r["completion"] for r in steady) / max(span, 1e-9), 1),
        "out_tok_s_all": round(sum(r["completion"] for r in ok) / wall, 1),
        "req_s": round(len(steady) / max(span, 1e-9), 2), "wall_s": round(wall, 2), "chunks": chunks,
        "gateway_cpu_s": round(cpu["gateway"], 2), "workers_cpu_s": round(cpu["workers"], 2),
        "gateway_cpu_ms_per_req": round(1000 * cpu["gateway"] / max(len(records), 1), 3),
        "gateway_cpu_us_per_chunk": round(1e6 * cpu["gateway"] / max(chunks, 1), 1),
        "workers_cpu_ms_per_req": round(1000 * cpu["workers"] / max(len(records), 1), 3),
    }
    if arm.startswith("cache") and counters.get("prompt"):
        # The router's prediction against the engines' report, over this arm's requests.
        out["predicted_hit_pct"] = round(100 * counters["expected"] / counters["prompt"], 2)
        out["reported_hit_pct"] = round(100 * counters["cached"] / counters["prompt"], 2)
        out["index_error_pct"] = round(100 * counters["error"] / counters["prompt"], 2)
    return out


async def run_arm(fleet: Fleet, workload: str, arm: str, sizes: Sizes, args: argparse.Namespace,
                  seed: int, seconds: float, sampler: Sampler | None = None) -> dict[str, Any]:
    gw, _, users_s = arm.partition("@")  # rr@32: the rr gateway, 32 users
    users = int(users_s) if users_s else args.users
    direct = gw == DIRECT
    url = fleet.worker_urls[0] if direct else fleet.gateways[gw][1]
    tag = f"{workload}-{arm}-{seed}"
    logs = ([] if direct else [fleet.logs / f"gateway-{gw}.log"]) + \
        [fleet.logs / f"engine-w{i}.jsonl" for i in range(len(fleet.workers))]
    async with httpx.AsyncClient(timeout=600, limits=LIMITS) as http:
        warm = DirectRecorder(http, fleet.worker_urls, args.served) if direct else Recorder(http, url, args.served)
        rng = random.Random(seed)
        await asyncio.gather(*(warm.send({"messages": [{"role": "user", "content": f"warm {tag} {i} " + text(rng, 32)}],
                                          "max_tokens": 4}) for i in range(8)))
        # Counters per process: a --procs gateway answers /metrics from whichever process
        # took the connection, so the arm's counters are read by scraping until every
        # process was seen (their pids differ in the process_* series).
        before = {} if direct else await scrape_all(http, url, args.gateway_procs)
        gateway_cpu = (lambda: 0.0) if direct else (lambda: procstat.tree_cpu_s(fleet.gateway_pid(gw)))
        cpu0 = {"gateway": gateway_cpu(), "workers": procstat.trees_cpu_s(fleet.worker_pids())}
        offs = diagnose.offsets(logs)
        recorder = DirectRecorder(http, fleet.worker_urls, args.served) if direct else Recorder(http, url, args.served)
        recorder.rid_prefix = re.sub(r"[^A-Za-z0-9]", "", f"{workload[:2]}{arm}{seed}") + "x"
        sessions = plan(workload, tag, sizes, seed)
        started = time.perf_counter()
        wall0 = recorder.wall0 = time.time()
        recorder.t0 = started
        await closed_loop(recorder, sessions, users, args.max_tokens, seconds, args.requests, args.users_per_client)
        wall = time.perf_counter() - started
        wall1 = time.time()
        cpu = {"gateway": gateway_cpu() - cpu0["gateway"],
               "workers": procstat.trees_cpu_s(fleet.worker_pids()) - cpu0["workers"]}
        after = {} if direct else await scrape_all(http, url, args.gateway_procs)
    counters = {k: after[k] - before[k] for k in after}
    warmup_s = min(args.warmup_s, seconds / 3)
    row = summarize(workload, arm, recorder.records, wall, cpu, counters, warmup_s)
    row["diag"] = diagnosis(fleet, recorder, logs, offs, warmup_s, wall0 + warmup_s, wall1, sampler,
                            fleet.logs / f"requests-{args.label + '-' if args.label else ''}{workload}-{arm}.jsonl")
    return row | describe(workload, sizes) | {"arm_s": round(seconds, 1), "users": users,
                                               "users_per_client": args.users_per_client}


def diagnosis(fleet: Fleet, recorder: Recorder, logs: list[Path], offs: dict[Path, int], warmup_s: float,
              t0: float, t1: float, sampler: Sampler | None, keep: Path) -> dict[str, Any]:
    """Where the arm's TTFT went (loadtest/gpu/diagnose.py), what the engines' schedulers and
    the machine did meanwhile (steady part), and the load generator's own lateness. ``keep``
    gets the joined rows, a line per request."""
    access: list[dict[str, Any]] = []
    engine: dict[str, list[dict[str, Any]]] = {}
    ticks: dict[str, list[dict[str, Any]]] = {}
    for path in logs:
        lines, _ = diagnose.read_from(path, offs[path])
        if path.name.startswith("gateway-"):
            access = diagnose.access_lines(lines)
        else:
            worker = path.stem.removeprefix("engine-")
            engine[worker], ticks[worker] = diagnose.engine_lines(lines)
    if not access and isinstance(recorder, DirectRecorder):  # no gateway: the client's own record stands in
        by_url = dict(zip(fleet.worker_urls, (f"w{i}" for i in range(len(fleet.worker_urls))), strict=False))
        access = [{"request_id": r["rid"], "ttft_ms": round(r["ttft"] * 1000, 1), "queue_wait_ms": 0.0,
                   "workers": by_url.get(r["worker_url"], "?"), "prompt_tokens": r["prompt"], "cached_tokens": r["cached"],
                   "completion_tokens": r["completion"], "t_end": recorder_wall(recorder, r)}
                  for r in recorder.records if r["error"] is None]
    rows = diagnose.join(recorder.records, access, engine, recorder.wall0)
    with open(keep, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    lags = sorted(recorder.lags)
    out: dict[str, Any] = {"access_lines": len(access), "engine_reqs": sum(map(len, engine.values())),
                           "split": diagnose.split(rows, warmup_s),
                           "engines": diagnose.engine_window(ticks, t0, t1),
                           "client_lag_p99_ms": round(1000 * lags[int(0.99 * (len(lags) - 1))], 1) if lags else None,
                           "client_lag_max_ms": round(1000 * lags[-1], 1) if lags else None}
    served: dict[str, int] = {}
    for a in access:
        served[a["workers"]] = served.get(a["workers"], 0) + 1
    out["requests_by_worker"] = dict(sorted(served.items()))
    if sampler is not None:
        out["machine"] = sampler.window(t0, t1)
    return out


def recorder_wall(recorder: Recorder, rec: dict[str, Any]) -> float:
    """A record's end on the wall clock (engine lines carry time.time())."""
    return recorder.wall0 + rec["t_end"]


#: Gateway counters the bench reads: name in results -> Prometheus series.
COUNTERS = {"expected": "sluice_gateway_prefix_expected_tokens_total",
            "error": "sluice_gateway_prefix_error_tokens_total",
            "prompt": "sluice_gateway_prompt_tokens_total", "cached": "sluice_gateway_cached_tokens_total",
            "migrations": "sluice_gateway_migrations_total"}


async def scrape_all(http: httpx.AsyncClient, url: str, procs: int) -> dict[str, float]:
    """The gateway's counters summed over its processes: each new connection lands on one of
    them, told apart by the ``sluice_gateway_process`` pid label."""
    seen: dict[str, dict[str, float]] = {}
    for _ in range(40 * procs):
        async with httpx.AsyncClient(timeout=10) as fresh:  # a new connection: maybe a new process
            body = (await fresh.get(url + "/metrics")).text
        pid = re.search(r'^sluice_gateway_process{pid="([0-9]+)"}', body, re.M)
        seen[pid.group(1) if pid else str(len(seen))] = {k: metric(body, name) for k, name in COUNTERS.items()}
        if len(seen) >= procs:
            break
    return {k: sum(v[k] for v in seen.values()) for k in COUNTERS}


def emit(out: Path, row: dict[str, Any]) -> None:
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    log(brief(row) if row.get("phase") == "routing" else json.dumps(row))


def brief(row: dict[str, Any]) -> str:
    """One line (under 400 characters: session.sh shows that much) of an arm's figures and split."""
    d = row.get("diag", {})
    sp, m = d.get("split", {}), d.get("machine", {})
    eng = d.get("engines", {}).values()
    slow = "/".join(str(sp.get(f"slow_{c}_ms")) for c in diagnose.COMPONENTS)
    return (f"{row['workload']} {row['arm']} n={row['steady_requests']} err={row['errors']} hit={row['hit_pct']} "
            f"ttft={row['ttft_p50_ms']}/{row['ttft_p90_ms']}/{row['ttft_p99_ms']} tok/s={row['out_tok_s']} | "
            f"slow(in/gwq/eq/pf/g2e/out)={slow} j={sp.get('joined_engine')}/{sp.get('joined')} | "
            f"wait_max={max((e['waiting_max'] for e in eng), default=None)} "
            f"kv_max={max((e['kv_max'] for e in eng), default=None)} pre={sum(e['preempted'] for e in eng)} "
            f"gap={max((e['gap_max_ms'] for e in eng), default=None)} | "
            f"busy={m.get('busy_mean')} st={m.get('steal_mean')} run90={m.get('runnable_p90')} gpu={m.get('gpu_mean')} "
            f"cli={m.get('client_mean')} lag99={d.get('client_lag_p99_ms')} by={d.get('requests_by_worker')}")


def routing_phase(args: argparse.Namespace, shape: FleetShape, out: Path, logs: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    arms = args.arms.split(",")
    # "overflow-z0.6:rr+cache-approx": that workload with those arms only (the default: --arms)
    spec = [(w, a.split("+") if a else arms) for w, _, a in (s.partition(":") for s in args.workloads.split(","))]
    workloads = [w for w, _ in spec]
    current: dict[str, str | None] = {"arm": None}
    with Fleet(shape, logs) as fleet, Sampler(lambda: fleet.sampler_groups(current["arm"])) as sampler:
        t0 = time.monotonic()
        # start while the workers load (gateways wait for none)
        every = [a for _, own in spec for a in own] + args.first_only.split(",")
        fleet.start_gateways(list(dict.fromkeys(g for g in (a.partition("@")[0] for a in every) if g and g != DIRECT)),
                             args.tokenizer)
        fleet.start_workers(args.start_timeout_s)
        log(f"{shape.workers} workers registered after {time.monotonic() - t0:.1f} s")
        sizes = Sizes(cache_tokens=shape.cache_tokens, prefix_words=args.prefix_words, overflow_x=args.overflow_x,
                      zipf_s=args.zipf_s)
        runs = [(w, workload, a, arm) for w, (workload, own) in enumerate(spec)
                # each workload starts with another arm: no arm always runs first (or last) in the fleet's warm-up
                for a, arm in [(k, own[(k + w) % len(own)]) for k in range(len(own))]]
        extra = [a for a in args.first_only.split(",") if a]  # diagnostic arms, after the first workload's
        first = len(spec[0][1])
        runs[first:first] = [(0, workloads[0], first + k, arm) for k, arm in enumerate(extra)]
        for k, (w, workload, a, arm) in enumerate(runs):
            seconds = args.arm_s
            if args.deadline:  # the arms left share what is left; an arm costs ~arm_overhead_s beside its load
                share = (args.deadline - time.time()) / (len(runs) - k) - args.arm_overhead_s
                seconds = min(seconds, share)
                if seconds < min(args.min_arm_s, args.arm_s):
                    log(f"deadline: {workload} {arm} and later not started")
                    return rows
            current["arm"] = arm.partition("@")[0]
            row = asyncio.run(run_arm(fleet, workload, arm, sizes, args, seed=100 * w + a, seconds=seconds,
                                      sampler=sampler))
            row["kv_blocks_per_worker"], row["cache_tokens_per_worker"] = shape.kv_blocks, shape.cache_tokens
            row["max_num_seqs"], row["max_batched"] = shape.max_num_seqs, shape.max_batched
            if args.label:
                row["label"] = args.label
            rows.append(row)
            emit(out, row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phase", default="routing", help="routing, migration, or both (comma-separated)")
    p.add_argument("--engine", default="vllm", choices=["vllm", "sim"])
    p.add_argument("--model", default="/tmp/m_1b")
    p.add_argument("--tokenizer", default="", help="folder the precise gateway tokenizes with (default: --model)")
    p.add_argument("--served", default="m1b")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--arms", default="rr,least,cache-approx,cache-precise")
    p.add_argument("--workloads", default="overflow,easy,w5,chat",
                   help="comma-separated; NAME:ARM+ARM runs only those arms on it; overflow-z0.6: Zipf 0.6 "
                        "(loadtest/gpu/workloads.py)")
    p.add_argument("--first-only", default="", help="more arms for the first workload alone, e.g. direct,rr@32 "
                   "(direct: no gateway, the client sends to the workers in turn; ARM@N: N users)")
    p.add_argument("--arm-s", type=float, default=30, help="seconds of load per arm and workload (less near --deadline)")
    p.add_argument("--min-arm-s", type=float, default=8, help="an arm that would get less is not started")
    p.add_argument("--arm-overhead-s", type=float, default=6, help="an arm's cost beside its load (warm-up, scrapes)")
    p.add_argument("--warmup-s", type=float, default=5, help="requests started before this are left out of the steady figures")
    p.add_argument("--requests", type=int, default=100000, help="at most this many requests per arm")
    p.add_argument("--users", type=int, default=64, help="closed-loop users")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--users-per-client", type=int, default=8,
                   help="users sharing one HTTP client (0: one client for all, as before 2026-12-03)")
    p.add_argument("--prefix-words", type=int, default=1500, help="~1 token each with the SmolLM2 tokenizer")
    p.add_argument("--overflow-x", type=float, default=1.75, help="overflow prefixes / the four caches together")
    p.add_argument("--zipf-s", type=float, default=0.9, help="overflow: popularity of the k-th prefix ~ 1/k^s")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-batched", type=int, default=8192)
    p.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks (16 tokens) per worker")
    p.add_argument("--block-bytes", type=int, default=512 * 1024, help="one block: 1B Llama shape, bf16")
    p.add_argument("--gpu-util", type=float, default=0.2)
    p.add_argument("--eager", action="store_true", help="vLLM without graph compilation (faster start)")
    p.add_argument("--gateway-procs", type=int, default=4)
    p.add_argument("--streams", type=int, default=256, help="migration: greedy streams at once")
    p.add_argument("--stream-tokens", type=int, default=192, help="migration: max_tokens of each stream")
    p.add_argument("--migration-max-num-seqs", type=int, default=128,
                   help="migration: room on the survivors for every stream of the killed worker")
    p.add_argument("--migration-env", default="VLLM_BATCH_INVARIANT=1", help="workers' env for the migration phase")
    p.add_argument("--sim-prefill-ms", type=float, default=0.05, help="sim: prefill ms per uncached token")
    p.add_argument("--sim-token-ms", type=float, default=8.0, help="sim: ms per engine step")
    p.add_argument("--start-timeout-s", type=float, default=300)
    p.add_argument("--deadline", type=float, default=0, help="epoch s: start no arm that may not end before it")
    p.add_argument("--quick", action="store_true", help="CPU rehearsal sizes")
    p.add_argument("--label", default="", help="a name for this run's settings, kept in each row")
    p.add_argument("--out", default="/tmp/routing_gpu_out")
    args = p.parse_args()
    stop_on_sigterm()
    args.tokenizer = args.tokenizer or args.model
    if args.quick:
        args.arm_s, args.warmup_s, args.users, args.kv_blocks, args.prefix_words = 6, 1, 16, 64, 200
        args.streams, args.stream_tokens, args.max_tokens, args.gateway_procs = 16, 48, 8, 2
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log(f"settings: {json.dumps(vars(args))}")
    shape = FleetShape(engine=args.engine, model=args.model, served=args.served, workers=args.workers,
                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, max_batched=args.max_batched,
                       kv_blocks=args.kv_blocks, block_bytes=args.block_bytes, gpu_util=args.gpu_util,
                       enforce_eager=args.eager, gateway_procs=args.gateway_procs,
                       sim_prefill_ms=args.sim_prefill_ms, sim_token_ms=args.sim_token_ms,
                       block_tokens=16 if args.engine == "vllm" else 64)
    rows: list[dict[str, Any]] = []
    try:
        for phase in args.phase.split(","):
            if phase == "routing":
                rows += routing_phase(args, shape, out, logs)
            elif phase == "migration":
                from loadtest.gpu.migration import migration_phase

                rows += migration_phase(args, shape, out, logs)
            else:
                raise SystemExit(f"unknown phase {phase}")
    except Exception as exc:  # noqa: BLE001 - report, keep what was measured and the logs
        log(f"FAILED: {type(exc).__name__}: {exc}")
    finally:
        every = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()] \
            if (out / "results.jsonl").exists() else []
        if every:
            draw(every, out / "routing_gpu.png")
    routing = [r for r in rows if r["phase"] == "routing"]
    if routing:
        cols = ["workload", "arm", "requests", "errors", "hit_pct", "predicted_hit_pct", "ttft_p50_ms", "ttft_p90_ms",
                "ttft_p90_ms_all", "out_tok_s", "gateway_cpu_ms_per_req", "gateway_cpu_us_per_chunk",
                "workers_cpu_ms_per_req"]
        print(table([{c: r.get(c, "") for c in cols} for r in routing]), flush=True)
    return 0 if rows and not any(r.get("errors") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
