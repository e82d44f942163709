"""Where an arm's TTFT goes: the client's records joined with the gateway's access lines and
vLLM's own per-request stats (loadtest/gpu/probe_worker.py).

Per request, in ms:

- ``gw_queue``: the gateway's admission queue (access line ``queue_wait_ms``: waiting for a
  worker slot);
- ``eng_queue``: vLLM's waiting queue (QUEUED to first SCHEDULED: no room in the batch, the
  KV cache or ``max_num_seqs``);
- ``eng_prefill``: SCHEDULED to the first token in the engine core (the prefill, and
  whatever else shares the GPU and the step meanwhile);
- ``gw_to_engine``: the gateway's TTFT less those three: routing, the HTTP hop, the worker's
  tokenization, the hand-over to the engine core and the first token's way back to the gateway;
- ``to_gateway``: from the client's send to the gateway's record start (the load generator's
  event loop, the connection, the gateway's HTTP parsing: its event loop's backlog);
- ``from_gateway``: the rest of the client's TTFT (the first chunk's way out to the client and
  the client's reading of it).

A client record joins its access line by request id (the client sends ``x-request-id``);
an access line joins its engine line by worker, prompt, cached and generated tokens and
the nearest end time (the worker gets the gateway's internal id, not the client's).
"""

from __future__ import annotations

import bisect
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

COMPONENTS = ("to_gateway", "gw_queue", "eng_queue", "eng_prefill", "gw_to_engine", "from_gateway")


def read_from(path: Path, offset: int) -> tuple[list[str], int]:
    """Lines appended to ``path`` since byte ``offset``, and the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
    return data[:end].decode("utf-8", "replace").splitlines(), offset + end


def offsets(paths: list[Path]) -> dict[Path, int]:
    return {p: (p.stat().st_size if p.exists() else 0) for p in paths}


def access_lines(lines: list[str]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        if '"sluice.access"' not in line:
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue
        d["t_end"] = datetime.strptime(d["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
        out.append(d)
    return out


def engine_lines(lines: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    reqs, ticks = [], []
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:
            continue
        (reqs if d.get("k") == "req" else ticks).append(d)
    return reqs, ticks


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 1)


def join(records: list[dict[str, Any]], access: list[dict[str, Any]],
         engine: dict[str, list[dict[str, Any]]], wall0: float) -> list[dict[str, Any]]:
    """One row per client record that has an access line: the components (ms) it has.
    ``wall0``: the client's t_start 0 on the wall clock (access and engine lines' clock)."""
    by_rid = {a["request_id"]: a for a in access}
    keyed: dict[tuple[Any, ...], list[tuple[float, dict[str, Any]]]] = {}
    for worker, reqs in engine.items():
        for e in reqs:
            keyed.setdefault((worker, e["prompt"], e["cached"], e["gen"]), []).append((e["t"], e))
    for v in keyed.values():
        v.sort(key=lambda x: x[0])
    used: set[int] = set()
    rows = []
    for r in records:
        a = by_rid.get(r.get("rid", ""))
        if a is None or r.get("ttft") is None or a.get("ttft_ms") is None:
            continue
        ttft = r["ttft"] * 1000
        row = {"t_start": r["t_start"], "ttft": round(ttft, 1), "gw_ttft": a["ttft_ms"],
               "gw_queue": a["queue_wait_ms"], "worker": a["workers"]}
        if "total_ms" in a:  # the gateway's record began at its end less total_ms
            to_gw = max(0.0, (a["t_end"] - a["total_ms"] / 1000 - wall0 - r["t_start"]) * 1000)
            row["to_gateway"] = round(min(to_gw, ttft - a["ttft_ms"]), 1)
            row["from_gateway"] = round(ttft - a["ttft_ms"] - row["to_gateway"], 1)
        cands = keyed.get((a["workers"], a["prompt_tokens"], a["cached_tokens"], a["completion_tokens"]), [])
        if cands:
            times = [c[0] for c in cands]
            i = bisect.bisect_left(times, a["t_end"])
            best = min((j for j in (i - 1, i, i + 1) if 0 <= j < len(cands) and id(cands[j][1]) not in used),
                       key=lambda j: abs(times[j] - a["t_end"]), default=None)
            if best is not None and abs(times[best] - a["t_end"]) < 1.0:
                e = cands[best][1]
                used.add(id(e))
                row["eng_queue"] = round(e["queued"] * 1000, 1)
                row["eng_prefill"] = round(e["prefill"] * 1000, 1)
                row["gw_to_engine"] = round(a["ttft_ms"] - a["queue_wait_ms"] - row["eng_queue"] - row["eng_prefill"], 1)
        rows.append(row)
    return rows


def split(rows: list[dict[str, Any]], steady_from: float) -> dict[str, Any]:
    """The steady requests' TTFT P90 and what it is made of: the slow decile's (TTFT at or
    above P90) mean of each component, and each component's own P90 over all requests."""
    rows = [r for r in rows if r["t_start"] >= steady_from]
    if not rows:
        return {}
    p90 = _q([r["ttft"] for r in rows], 0.9)
    slow = [r for r in rows if r["ttft"] >= (p90 or 0)]
    out: dict[str, Any] = {"joined": len(rows), "joined_engine": sum("eng_queue" in r for r in rows),
                           "ttft_p90_ms": p90, "gw_ttft_p90_ms": _q([r["gw_ttft"] for r in rows], 0.9),
                           "slow_n": len(slow), "slow_ttft_mean_ms": round(sum(r["ttft"] for r in slow) / len(slow), 1)}
    for c in COMPONENTS:
        have = [r[c] for r in slow if c in r]
        out[f"slow_{c}_ms"] = round(sum(have) / len(have), 1) if have else None
        out[f"{c}_p90_ms"] = _q([r[c] for r in rows if c in r], 0.9)
    workers: dict[str, int] = {}
    for r in slow:
        workers[r["worker"]] = workers.get(r["worker"], 0) + 1
    out["slow_by_worker"] = dict(sorted(workers.items()))
    return out


def engine_window(ticks: dict[str, list[dict[str, Any]]], t0: float, t1: float) -> dict[str, Any]:
    """vLLM's scheduler over an arm, per worker: running / waiting (mean, max), KV use (max),
    preemptions, prompt tokens computed per second, outputs handled per second (about one
    per engine step) and the longest pause between two."""
    out: dict[str, Any] = {}
    for worker, rows in sorted(ticks.items()):
        w = [t for t in rows if t0 <= t["t"] <= t1]
        if not w:
            continue
        span = max(t1 - t0, 1e-9)
        out[worker] = {
            "running_mean": round(sum(t["running"] for t in w) / len(w), 1), "running_max": max(t["running_max"] for t in w),
            "waiting_mean": round(sum(t["waiting"] for t in w) / len(w), 1), "waiting_max": max(t["waiting_max"] for t in w),
            "kv_max": max(t["kv_max"] for t in w), "kv_mean": round(sum(t["kv"] for t in w) / len(w), 3),
            "preempted": sum(t["preempted"] for t in w),
            "prompt_computed_tok_s": round(sum(t["prompt_computed"] for t in w) / span),
            "steps_s": round(sum(t["records"] for t in w) / span, 1),
            "gap_max_ms": round(1000 * max(t.get("gap_max", 0) for t in w), 1),
        }
    return out
