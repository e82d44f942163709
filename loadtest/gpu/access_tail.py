"""Where a TTFT tail comes from, read from a `sluice up` log's access lines (JSON, one per
request): TTFT and queue wait by gateway process (``pid``), and whether the slow requests
came together (a stall: many slow ones ending within the same instant) or one by one.

    python3 loadtest/gpu/access_tail.py sluice_up.log.xz [--slow-ms 300] [--tokens 1]

TTFT here is the gateway's: from the request's arrival in the app to its first token, so a
tail it shows lies between the gateway and the engine (admission, the hop to the worker, the
worker, the engine), and one it does not show lies in front of the gateway (connections,
the client).
"""

from __future__ import annotations

import argparse
import lzma
import sys
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import orjson


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))] if ordered else float("nan")


def _rows(path: Path, tokens: int | None) -> list[dict]:
    opener = lzma.open if path.suffix == ".xz" else open
    rows = []
    with opener(path, "rb") as lines:
        for line in lines:
            if b'"sluice.access"' not in line:
                continue
            entry = orjson.loads(line)
            if entry.get("ttft_ms") is None or (tokens is not None and entry.get("completion_tokens") != tokens):
                continue
            entry["t"] = datetime.fromisoformat(entry["ts"].replace("Z", "+00:00")).timestamp()
            rows.append(entry)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--slow-ms", type=float, default=300.0, help="a request this slow to its first token is slow")
    parser.add_argument("--tokens", type=int, default=None, help="only requests of this many completion tokens")
    args = parser.parse_args()
    rows = _rows(args.log, args.tokens)
    if not rows:
        sys.exit("no access lines with a TTFT in that log")
    print(f"{len(rows)} requests")
    by_pid: dict[object, list[dict]] = defaultdict(list)
    for row in rows:
        by_pid[row.get("pid", "-")].append(row)
    print("pid       requests  TTFT p50 / p99 / max ms   queue wait p50 / p99 / max ms   slow")
    for pid, group in sorted(by_pid.items(), key=lambda kv: str(kv[0])):
        ttft = [r["ttft_ms"] for r in group]
        wait = [r["queue_wait_ms"] for r in group]
        slow = sum(t >= args.slow_ms for t in ttft)
        print(f"{pid!s:9} {len(group):8}  {_pct(ttft, .5):7.1f} / {_pct(ttft, .99):7.1f} / {max(ttft):7.1f}"
              f"   {_pct(wait, .5):7.1f} / {_pct(wait, .99):7.1f} / {max(wait):7.1f}   {slow}")
    slow_rows = sorted((r for r in rows if r["ttft_ms"] >= args.slow_ms), key=lambda r: r["t"])
    if not slow_rows:
        return
    t0 = rows[0]["t"] if rows[0]["t"] < slow_rows[0]["t"] else slow_rows[0]["t"]
    # A slow request's first token came at t - (total - ttft); group slow ones whose first
    # tokens came within 50 ms of each other: a burst is one stall that held them all.
    bursts: list[list[dict]] = []
    for row in slow_rows:
        first = row["t"] - (row["total_ms"] - row["ttft_ms"]) / 1000
        row["first"] = first
        if bursts and first - bursts[-1][-1]["first"] <= 0.05:
            bursts[-1].append(row)
        else:
            bursts.append([row])
    print(f"\n{len(slow_rows)} requests at {args.slow_ms:.0f} ms or more to the first token, in {len(bursts)} "
          "groups (first tokens within 50 ms of each other):")
    for burst in sorted(bursts, key=len, reverse=True)[:15]:
        ttft = [r["ttft_ms"] for r in burst]
        pids = sorted({str(r.get("pid", "-")) for r in burst})
        print(f"  at {burst[0]['first'] - t0:8.2f} s: {len(burst):4} requests, TTFT {min(ttft):.0f}-{max(ttft):.0f} ms,"
              f" queue wait max {max(r['queue_wait_ms'] for r in burst):.1f} ms, gateway pids {','.join(pids)}")


if __name__ == "__main__":
    main()
