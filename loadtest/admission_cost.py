"""What admitting one request costs Redis, by the number of workers serving its model.

Every request's slot is taken (ACQUIRE) and given back (RELEASE) by a Lua script that runs
in Redis, and one Redis serves every gateway replica: its CPU per request bounds the whole
fleet's admission rate, however many gateways there are. This measures Redis's own CPU
(from /proc, the embedded server) per acquire + release pair, 16 requests at a time through
one :class:`gateway.admission.queue.Admission`, for fleets of registered workers of
growing size, under each routing (``cache`` with 16 prompt blocks per request from 64
prefixes), nothing waiting in the queue (the common case: a waiting request changes
the scripts' path).

    .venv/bin/python loadtest/admission_cost.py                       # this checkout
    .venv/bin/python loadtest/admission_cost.py --baseline /tmp/before  # and another, same run

Besides Redis's CPU it gives two figures per request that swing less with the machine's
speed: the scripts' time as Redis counts it (``INFO commandstats``, without the sockets and
the parsing) and the commands the scripts ran, which do not swing at all.

``--scripts-of DIR``: a checkout whose Lua scripts alone differ from this one's, measured
request by request in turn with this one on one Redis, each script call timed by Redis
(its JSON and chart give the scripts' time per request).

``--saturated``: the fleet full instead (one slot per worker, all but one held, 16 clients
in closed loops taking turns at that one): each request queues in ACQUIRE and is granted by
a RELEASE's pump, the paths that still read the whole fleet (gateway/admission/scripts.py,
"Large fleets").

``--baseline DIR``: a checkout of another commit (``git worktree add /tmp/before <commit>``),
measured in the same run in turn with this one, level by level. ``--repeat N``: N rounds of
that; the table gives medians (this 2-core machine's speed can swing by half within minutes).
Writes ``admission_cost.json`` and ``admission_cost.png`` (``--out`` for other names).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def redis_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def fleet(redis: Any, routing: str, workers: int, capacity: int = 64) -> Callable[[int], Any]:
    """``workers`` registered workers of a new model; returns its request ``i``'s ask (cache
    routing: 16 prompt blocks from one of 64 prefixes)."""
    from engine_worker.registration import Registration
    from gateway.admission.queue import Ask

    model = "m" + uuid.uuid4().hex[:8]
    for i in range(workers):
        await Registration(redis, model=model, worker_id=f"w{i:04d}", url="http://127.0.0.1:9", engine="sim",
                           capacity=capacity, heartbeat_ms=60_000, stats=lambda: {"running": 0}).beat()
    prefixes = [[uuid.uuid4().hex[:16] for _ in range(16)] for _ in range(64)]

    def ask(i: int) -> Ask:
        blocks = tuple(prefixes[i % 64]) if routing == "cache" else ()
        return Ask(model=model, request_id=uuid.uuid4().hex, blocks=blocks)

    return ask


async def admit(gateways: list[Any], ask: Callable[[int], Any], requests: int) -> None:
    """``requests`` acquire + release pairs, 16 at a time; request ``i`` goes through
    ``gateways[(i // 16) % len(gateways)]`` (in turn, when there are several)."""
    async def client(first: int) -> None:
        for i in range(first, requests, 16):
            gateway = gateways[(i // 16) % len(gateways)]
            (lease,) = await gateway.acquire(ask(i))
            await gateway.release(lease)

    await asyncio.gather(*(client(i) for i in range(16)))


async def admit_saturated(gateway: Any, ask: Callable[[int], Any], requests: int, free_one: Any) -> None:
    """``requests`` acquire + release pairs on a full fleet: 16 clients in closed loops
    queue for the one slot ``free_one`` (a coroutine) frees, so every acquire queues and
    every release hands the slot to a waiting client (the queue's paths)."""
    done = 0

    async def client(i: int) -> None:
        nonlocal done
        while done < requests:
            (lease,) = await gateway.acquire(ask(i))
            await gateway.release(lease)
            done += 1

    clients = [asyncio.create_task(client(i)) for i in range(16)]
    await asyncio.sleep(0.2)  # all of them queued
    await free_one
    await asyncio.gather(*clients)


async def measure(url: str, routing: str, workers: int, requests: int, saturated: bool = False) -> dict[str, float]:
    """One level, from the code on ``sys.path`` (this checkout's or the baseline's).
    ``saturated``: one slot per worker, every one taken, requests waiting (:func:`admit_saturated`)."""
    from redis.asyncio import Redis

    from gateway.admission.queue import Admission
    from gateway.config import GatewaySettings

    redis = Redis.from_url(url)
    pid = int((await redis.info("server"))["process_id"])
    ask = await fleet(redis, routing, workers, capacity=1 if saturated else 64)
    gateway = Admission(redis, GatewaySettings(redis_url=url, routing=routing, queue_timeout_s=60, max_queue=100_000))
    await gateway.start()
    # A fleet in use: some slots held by streams that run on (saturated: every slot).
    held = [lease for i in range(workers if saturated else min(32, workers * 8)) for lease in await gateway.acquire(ask(i))]

    await redis.config_resetstat()
    cpu0, t0 = redis_cpu_s(pid), time.perf_counter()
    if saturated:
        await admit_saturated(gateway, ask, requests, gateway.release(held.pop()))
    else:
        await admit([gateway], ask, requests)
    wall, cpu = time.perf_counter() - t0, redis_cpu_s(pid) - cpu0
    stats = await redis.info("commandstats")
    for lease in held:
        await gateway.release(lease)
    await gateway.close()
    await redis.aclose()
    scripts = [v for k, v in stats.items() if k.startswith("cmdstat_eval")]
    inner = sum(v["calls"] for k, v in stats.items() if not k.startswith(("cmdstat_eval", "cmdstat_info")))
    return {"redis_us_per_request": cpu / requests * 1e6, "requests_per_s": requests / wall,
            # Redis's own timing of the scripts (no sockets, no parsing): steadier than the CPU
            # ticks on a machine whose speed swings; and the commands they ran, which do not swing.
            "script_us_per_request": sum(v["usec"] for v in scripts) / requests,
            "calls_per_request": inner / requests}


async def interleaved(url: str, routing: str, workers: int, requests: int, other: Path) -> dict[str, dict[str, float]]:
    """This checkout's admission against one whose Lua scripts come from ``other``'s
    ``gateway/admission/scripts.py`` (nothing else of it), request by request in turn on one
    Redis, each script call timed by Redis itself (``SLOWLOG``, every call). A drift of the
    machine's speed falls on both alike, where checkouts measured one after the other took
    it in turns (this 2-core machine: ±20 % between rounds of the same code)."""
    import hashlib
    import importlib.util

    from redis.asyncio import Redis

    from gateway.admission import queue
    from gateway.admission import scripts as ours
    from gateway.config import GatewaySettings

    spec = importlib.util.spec_from_file_location("other_scripts", other / "gateway/admission/scripts.py")
    assert spec is not None and spec.loader is not None
    theirs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(theirs)
    redis = Redis.from_url(url)
    ask = await fleet(redis, routing, workers)
    gateways, names = [], {}
    for code, module in (("this checkout", ours), (f"scripts of {other.name}", theirs)):
        queue.scripts = module  # read when an Admission is made
        gateways.append(queue.Admission(redis, GatewaySettings(redis_url=url, routing=routing)))
        await gateways[-1].start()
        for script in ("ACQUIRE", "RELEASE"):
            names[hashlib.sha1(getattr(module, script).encode()).hexdigest().encode()] = code
    queue.scripts = ours
    held = [lease for i in range(min(32, workers * 8)) for lease in await gateways[0].acquire(ask(i))]
    await redis.config_set("slowlog-log-slower-than", 0)
    await redis.config_set("slowlog-max-len", 4 * requests)
    await redis.slowlog_reset()
    await admit(gateways, ask, requests)
    timed: dict[str, list[int]] = {code: [] for code in names.values()}
    for entry in await redis.slowlog_get(4 * requests):
        command = entry["command"].split()
        if command[0] == b"EVALSHA" and command[1] in names:
            timed[names[command[1]]].append(int(entry["duration"]))
    await redis.config_set("slowlog-log-slower-than", 10_000)
    for lease in held:
        await gateways[0].release(lease)
    for gateway in gateways:
        await gateway.close()
    await redis.aclose()
    # ACQUIRE and RELEASE alternate, so twice the mean call is one request's.
    return {code: {"script_us_per_request": 2 * statistics.mean(times)} for code, times in timed.items()}


def child(args: argparse.Namespace) -> None:
    """Run one level with the code under ``--root`` and print its figures as JSON."""
    sys.path.insert(0, args.root)
    print(json.dumps(asyncio.run(measure(args.url, args.routing, args.workers, args.requests, args.saturated))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,4,16,64,256", help="fleet sizes, comma-separated")
    parser.add_argument("--routings", default="least,cache", help="routings to measure, comma-separated (least, rr, cache)")
    parser.add_argument("--requests", type=int, default=4000, help="acquire + release pairs per level")
    parser.add_argument("--baseline", help="another checkout of Sluice, measured in the same run")
    parser.add_argument("--scripts-of", type=Path,
                        help="a checkout whose Lua scripts alone differ: measured against this one's request by "
                             "request, on one Redis, each call timed by Redis (steadier than --baseline)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds, each checkout in turn within a round; the table gives medians")
    parser.add_argument("--out", default=str(HERE / "admission_cost"), help="output path without extension")
    parser.add_argument("--saturated", action="store_true",
                        help="every slot taken and requests waiting (one slot per worker, 16 clients more than "
                             "slots): the queue's paths, not a request granted at once (not with --scripts-of)")
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--routing", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.root:
        args.workers = int(args.workers)
        child(args)
        return

    sys.path.insert(0, str(HERE.parent))
    from sluice.embedded_redis import EmbeddedRedis

    if args.scripts_of:
        rows = []
        with EmbeddedRedis() as server:
            for routing in args.routings.split(","):
                for workers in [int(w) for w in args.workers.split(",")]:
                    rounds = [asyncio.run(interleaved(server.url, routing, workers, args.requests, args.scripts_of))
                              for _ in range(args.repeat)]
                    rows += [{"code": code, "routing": routing, "workers": workers, **r[code]}
                             for r in rounds for code in r]
                    figures = []
                    for code in rounds[0]:
                        each = sorted(r[code]["script_us_per_request"] for r in rounds)
                        figures.append(f"{code}: {statistics.median(each):.1f} µs ({' / '.join(f'{v:.0f}' for v in each)})")
                    print(f"| {routing} | {workers} | " + " | ".join(figures) + " |", flush=True)
        report(rows, list(dict.fromkeys(str(r["code"]) for r in rows)), args.out,
               {"script_us_per_request": "script µs"}, "script µs per admitted request (SLOWLOG)")
        return
    codes = {"this checkout": str(HERE.parent)}
    if args.baseline:
        codes[f"baseline ({Path(args.baseline).name})"] = str(Path(args.baseline).resolve())
    rows = []
    with EmbeddedRedis() as server:
        for routing in args.routings.split(","):
            for workers in [int(w) for w in args.workers.split(",")]:
                for _ in range(args.repeat):
                    for code, root in codes.items():
                        out = subprocess.run(
                            [sys.executable, __file__, "--root", root, "--url", server.url, "--routing", routing,
                             "--workers", str(workers), "--requests", str(args.requests),
                             *(["--saturated"] if args.saturated else [])],
                            check=True, capture_output=True, text=True).stdout
                        row = {"code": code, "routing": routing, "workers": workers, **json.loads(out.splitlines()[-1])}
                        rows.append(row)
                        print(f"{code:28} {routing:6} {workers:4} workers: Redis {row['redis_us_per_request']:7.1f} µs "
                              f"per request (scripts {row['script_us_per_request']:6.1f} µs, "
                              f"{row['calls_per_request']:5.1f} calls), {row['requests_per_s']:7,.0f} req/s", flush=True)
    report(rows, list(codes), args.out)


def median_of(rows: list[dict[str, object]], code: str, routing: str, workers: int, figure: str) -> float:
    return statistics.median(float(r[figure]) for r in rows  # type: ignore[arg-type]
                             if r["code"] == code and r["routing"] == routing and r["workers"] == workers)


def report(rows: list[dict[str, object]], codes: list[str], out: str, figures: dict[str, str] | None = None,
           ylabel: str = "Redis CPU µs per admitted request") -> None:
    """The medians' table, ``out``.json (every round) and ``out``.png (the first figure by fleet size)."""
    figures = figures or {"redis_us_per_request": "Redis CPU µs", "script_us_per_request": "script µs",
                          "calls_per_request": "calls"}
    charted = next(iter(figures))
    print("\nPer admitted request (medians of the rounds):\n")
    print("| routing | workers | " + " | ".join(f"{name}, {c}" for name in figures.values() for c in codes) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in figures for _ in codes) + " |")
    levels = sorted({(str(r["routing"]), int(r["workers"])) for r in rows}, key=lambda k: (k[0], k[1]))  # type: ignore[arg-type]
    for routing, workers in levels:
        cells = [median_of(rows, c, routing, workers, f) for f in figures for c in codes]
        print(f"| {routing} | {workers} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")
    Path(out + ".json").write_text(json.dumps(rows, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for code in codes:
        for routing in sorted({str(r["routing"]) for r in rows}):
            points = sorted((w, median_of(rows, code, routing, w, charted))
                            for w in {int(r["workers"]) for r in rows if r["routing"] == routing})  # type: ignore[arg-type]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{code}, {routing}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers serving the model")
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.set_title("Admission's cost to Redis (ACQUIRE + RELEASE)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)
    print(f"wrote {out}.json, {out}.png")


if __name__ == "__main__":
    main()
