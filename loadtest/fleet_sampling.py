"""What routing among a sample costs a large fleet's TTFT (gateway/admission/scripts.py,
"Large fleets"): the same closed loop of users on the same engines, in virtual time, each
choice of worker made by the real admission scripts on a real Redis, once with the sample
(``route_sample``, 8 by default) and once reading the whole fleet (``route_sample=0``), at
growing load up to every slot of the fleet taken.

    .venv/bin/python loadtest/fleet_sampling.py                      # 128 workers, least
    .venv/bin/python loadtest/fleet_sampling.py --workers 256 --routing cache --out /tmp/fs

The engines are tests/gateway/closed_loop.py's (vLLM-style steps, chunked prefill, a
serial front end, the H200 bench's noise), one device each. Writes ``fleet_sampling.json``
and ``fleet_sampling.png`` (``--out``): TTFT p50 and p90 against users, both arms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from gateway.admission.queue import Admission  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from tests.gateway.closed_loop import H200, run  # noqa: E402


async def one(url: str, workers: int, capacity: int, users: int, requests: int, routing: str,
              sample: int, seed: int) -> dict[str, float]:
    from redis.asyncio import Redis

    from engine_worker.registration import Registration

    redis = Redis.from_url(url)
    model = f"fs-{workers}-{users}-{sample}-{seed}-{time.monotonic_ns()}"
    for i in range(workers):
        await Registration(redis, model=model, worker_id=f"w{i:04d}", url="http://127.0.0.1:9", engine="sim",
                           capacity=capacity, heartbeat_ms=600_000, stats=lambda: {"running": 0}).beat()
    gateway = Admission(redis, GatewaySettings(redis_url=url, routing=routing, route_sample=sample))
    await gateway.start()
    shape = replace(H200, workers=workers, capacity=capacity, users=users, requests=requests,
                    shared_device=False, seed=seed)
    started = time.perf_counter()
    outcome = await run([gateway], model, shape)
    await gateway.close()
    await redis.aclose()
    return {"ttft_p50_ms": outcome.ttft_p50_s * 1000, "ttft_p90_ms": outcome.ttft_p90_s * 1000,
            "waves": outcome.waves, "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=128)
    parser.add_argument("--capacity", type=int, default=16, help="slots per worker")
    parser.add_argument("--users", default="0.25,0.5,0.75,0.9,1.0",
                        help="users as shares of the fleet's slots, comma-separated")
    parser.add_argument("--rounds", type=int, default=6, help="requests per user")
    parser.add_argument("--routing", default="least", choices=("least", "cache"))
    parser.add_argument("--sample", type=int, default=8, help="the sampled arm's route_sample")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "fleet_sampling"), help="output path without extension")
    args = parser.parse_args()

    from sluice.embedded_redis import EmbeddedRedis

    slots = args.workers * args.capacity
    rows = []
    with EmbeddedRedis() as server:
        for share in [float(s) for s in args.users.split(",")]:
            users = max(1, round(share * slots))
            for sample in (args.sample, 0):
                for seed in range(args.seeds):
                    r = asyncio.run(one(server.url, args.workers, args.capacity, users, users * args.rounds,
                                        args.routing, sample, seed))
                    rows.append({"users": users, "share": share, "sample": sample, "seed": seed, **r})
                    print(f"users {users:5d} ({share:.0%} of slots)  sample {sample or 'all':>3}  seed {seed}:  "
                          f"TTFT p50 {r['ttft_p50_ms']:7.1f}  p90 {r['ttft_p90_ms']:7.1f} ms  "
                          f"waves {r['waves']:.0%}  ({r['wall_s']:.0f} s)", flush=True)
    table = ["| users (share of slots) | TTFT p50, sample of %d | whole fleet | TTFT p90, sample | whole fleet |"
             % args.sample, "| --- | --- | --- | --- | --- |"]
    summary = []
    for share in [float(s) for s in args.users.split(",")]:
        def mean(sample: int, key: str, share: float = share) -> float:
            got = [r[key] for r in rows if r["share"] == share and r["sample"] == sample]
            return sum(got) / len(got)
        users = next(r["users"] for r in rows if r["share"] == share)
        cells = [mean(args.sample, "ttft_p50_ms"), mean(0, "ttft_p50_ms"), mean(args.sample, "ttft_p90_ms"),
                 mean(0, "ttft_p90_ms")]
        summary.append({"users": users, "share": share, "sampled_p50": cells[0], "all_p50": cells[1],
                        "sampled_p90": cells[2], "all_p90": cells[3]})
        table.append(f"| {users} ({share:.0%}) | " + " | ".join(f"{c:.1f} ms" for c in cells) + " |")
    print(f"\n{args.workers} workers x {args.capacity} slots, {args.routing} routing, means of {args.seeds} seeds:\n")
    print("\n".join(table))
    Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "rows": rows, "summary": summary}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    xs = [s["users"] for s in summary]
    for key, label, style in (("sampled_p90", f"p90, sample of {args.sample}", "o-"), ("all_p90", "p90, whole fleet", "s--"),
                              ("sampled_p50", f"p50, sample of {args.sample}", "o-"), ("all_p50", "p50, whole fleet", "s--")):
        ax.plot(xs, [s[key] for s in summary], style, label=label)
    ax.set_xlabel(f"users in a closed loop ({args.workers} workers x {args.capacity} slots = {slots})")
    ax.set_ylabel("TTFT (virtual ms)")
    ax.set_title(f"{args.routing} routing among a sample against the whole fleet")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=100)
    print(f"wrote {args.out}.json, {args.out}.png")


if __name__ == "__main__":
    main()
