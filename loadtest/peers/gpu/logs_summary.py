"""A JSON summary of a peers.sh log folder (what to look at after a device run, small enough
to commit): per Sluice gateway log, the access lines' statuses and queue waits, and every
warning or error message with its count; per worker log the same messages; vLLM's server log's
WARNING/ERROR lines; the load generator's error log.

    python loadtest/peers/gpu/logs_summary.py DIR... > summary.json
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path


def pct(xs: list[float], p: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None


def sluice_log(path: Path) -> dict:
    status, messages, wait = Counter(), Counter(), []
    for line in path.read_text(errors="replace").splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            if line.strip():
                messages["(not JSON) " + line[:160]] += 1
            continue
        msg = str(d.get("msg", ""))
        if d.get("logger") == "sluice.access":
            status[re.search(r"status=(\S+)", msg).group(1)] += 1
            wait.append(float(re.search(r"queue_wait_ms=([\d.]+)", msg).group(1)))
        elif d.get("level") in ("warning", "error", "critical") or "exc" in d:
            messages[f'{d.get("level")} {d.get("logger")}: {msg[:160]}'] += 1
    out: dict = {"warnings_and_errors": dict(messages)}
    if status:
        out |= {"requests_by_status": dict(status), "queue_wait_ms_p50": pct(wait, 0.5),
                "queue_wait_ms_p99": pct(wait, 0.99), "queue_wait_ms_max": max(wait)}
    return out


def main() -> None:
    summary = {}
    for folder in map(Path, sys.argv[1:]):
        part = {}
        for path in sorted(folder.glob("gateway_*.log")) + sorted(folder.glob("worker_*.log")):
            part[path.name] = sluice_log(path)
        server = folder / "server.log"
        if server.exists():
            lines = [ln for ln in server.read_text(errors="replace").splitlines() if re.search(r"WARNING|ERROR|Traceback", ln)]
            part["server.log"] = {"warnings_and_errors": dict(Counter(re.sub(r"^.*?\] ", "", ln)[:200] for ln in lines))}
        errs = folder / "client_err.log"
        if errs.exists():
            part["client_err.log"] = {"bytes": errs.stat().st_size, "head": errs.read_text(errors="replace")[:500]}
        summary[folder.name] = part
    json.dump(summary, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
