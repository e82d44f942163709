"""Where a TTFT tail comes from, read from a `sluice up` log's access lines (JSON, one per
request): TTFT and queue wait by gateway process (``pid``), and the stalls: moments when no
one-token request got its first token and none arrived (a pause between two loads reads as
one too).

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


def _stalls(rows: list[dict], window_s: float) -> None:
    """Runs of three or more windows in which no request got its first token and none arrived,
    between windows that had some: in a closed loop a stall anywhere (a gateway process, the
    worker, the engine, Redis, the client) stops both. Requests of one token only: a long
    stream's first token comes once, so quiet windows are no stall there."""
    firsts, arrivals = set(), set()
    for row in rows:
        first = row["t"] - (row["total_ms"] - row["ttft_ms"]) / 1000
        firsts.add(int(first / window_s))
        arrivals.add(int((first - row["ttft_ms"] / 1000) / window_s))
    busy = sorted(firsts | arrivals)
    t0 = busy[0]
    stalls = [(a, b) for a, b in zip(busy, busy[1:]) if b - a - 1 >= 3]
    if not stalls:
        print(f"\nno stall of {3 * window_s * 1000:.0f} ms or more")
        return
    print(f"\n{len(stalls)} stalls (no first token and no arrival for {3 * window_s * 1000:.0f} ms or more):")
    for a, b in stalls:
        print(f"  at {(a + 1 - t0) * window_s:8.2f} s for {(b - a - 1) * window_s * 1000:5.0f} ms")
    starts = [a for a, _ in stalls]
    gaps = [(b - a) * window_s for a, b in zip(starts, starts[1:])]
    if gaps:
        print(f"  one every {sorted(gaps)[len(gaps) // 2]:.2f} s (median)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--slow-ms", type=float, default=300.0, help="a request this slow to its first token is slow")
    parser.add_argument("--tokens", type=int, default=1, help="only requests of this many completion tokens")
    parser.add_argument("--window-ms", type=float, default=50.0, help="the stall finder's window")
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
    _stalls(rows, args.window_ms / 1000)


if __name__ == "__main__":
    main()
