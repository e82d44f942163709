"""The run's outputs: the fault × path table, the forbidden list, a JSON summary and a PNG timeline."""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sluice.nemesis.checker import AFTERMATH_S, Verdict
from sluice.nemesis.faults import FAILOVERS, SERVING_WAIT_S, FaultRun
from sluice.nemesis.history import Attempt, History
from sluice.nemesis.schedule import GATEWAY_DOWN, KINDS
from sluice.nemesis.workload import PATHS, RequestSpec

OUTCOMES = ("exact", "explicit", "forbidden")
PATH_TITLES = {"plain": "plain", "resumable": "resumable", "nonstream": "non-streaming"}


def table(verdicts: list[Verdict]) -> dict[str, dict[str, dict[str, int]]]:
    """fault kind -> path -> outcome -> requests (a request counts under every fault it overlapped;
    "left" counts as exact: what its client read was exact)."""
    cells: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: {p: dict.fromkeys(OUTCOMES, 0) for p in PATHS})
    for v in verdicts:
        outcome = "exact" if v.outcome == "left" else v.outcome
        for kind in v.faults or ["none"]:
            cells[kind][v.path][outcome] += 1
    order = [k for k in [*KINDS, "none"] if k in cells]
    return {k: cells[k] for k in order}


def markdown(cells: dict[str, dict[str, dict[str, int]]]) -> str:
    head = "| fault kind | " + " | ".join(f"{PATH_TITLES[p]} exact / explicit / forbidden" for p in PATHS) + " |"
    lines = [head, "| --- |" + " --- |" * len(PATHS)]
    for kind, paths in cells.items():
        row = [" / ".join(str(paths[p][o]) for o in OUTCOMES) for p in PATHS]
        lines.append(f"| {kind} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def totals(verdicts: list[Verdict]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {p: dict(Counter(v.outcome for v in verdicts if v.path == p)) for p in PATHS}
    return out


def failover_serving(runs: list[FaultRun], ports: list[int]) -> dict[str, Any]:
    """Per Sentinel/Cluster failover, seconds from its start until every gateway port served
    again (faults.py measures it); their median and maximum. None: a port never did in time
    (in ``clean_s``: ``SERVING_WAIT_S``). Failovers that could not be applied are counted
    apart (``not_applied``).

    A port one of whose gateways was killed, stopped or cut from Redis before it served
    again would not have served with any Redis: such ports are left out of ``clean_s``,
    the failover's own figure (``median_s``, ``max_s``), and kept in ``all_s`` (``raw_*``).
    ``ports[i]`` is gateway i's port (the link proxy is gateway 0's)."""
    each = []
    not_applied = 0
    for r in runs:
        if r.fault.kind not in FAILOVERS:
            continue
        if r.error is not None:
            # The failover did not happen as asked (no replica fit to take over before it,
            # ``SENTINEL FAILOVER`` refused, or no replica took over in time): "served again
            # after it" measures nothing.
            not_applied += 1
            continue
        confounded = sorted({port for port, served in r.serving_s.items()
                             if any(_gateway_down(g, ports, port, r.started_s, served) for g in runs)})
        clean = [v for port, v in r.serving_s.items() if port not in confounded]
        each.append({"kind": r.fault.kind, "at_s": round(r.started_s, 1), "ports": r.serving_s,
                     "all_s": None if None in r.serving_s.values() else max(r.serving_s.values(), default=None),
                     # a clean port that never served counts as the whole wait
                     "clean_s": max((SERVING_WAIT_S if v is None else v for v in clean), default=None),
                     "confounded_ports": confounded, "steps": r.note, "probes": r.probes})

    def stats(field: str) -> tuple[float | None, float | None, int]:
        done = sorted(e[field] for e in each if e[field] is not None)
        return (statistics.median(done) if done else None), (done[-1] if done else None), len(done)

    median, worst, clean = stats("clean_s")
    raw_median, raw_worst, served = stats("all_s")
    return {"failovers": len(each), "not_applied": not_applied, "served_again": served, "median_s": median, "max_s": worst,
            "measured_clean": clean, "raw_median_s": raw_median, "raw_max_s": raw_worst, "each": each}


def _gateway_down(g: FaultRun, ports: list[int], port: int, since_s: float, served_s: float | None) -> bool:
    """Whether fault ``g`` took a gateway on ``port`` down between ``since_s`` and the time
    the port served again (``served_s`` after ``since_s``; None: the whole wait)."""
    if g.fault.kind not in GATEWAY_DOWN:
        return False
    gateway = 0 if g.fault.target == "link" else int(g.fault.target.split("-")[1])
    until = since_s + (SERVING_WAIT_S if served_s is None else served_s)
    return ports[gateway] == port and g.started_s <= until and g.ended_s >= since_s


def _attempt(a: Attempt) -> dict[str, Any]:
    return {
        "how": a.how, "port": a.port, "t_s": [round(a.started_s, 2), round(a.ended_s, 2)], "status": a.status,
        "last_event_id": a.last_event_id, "events": len(a.event_ids) or len(a.chunks),
        "ids": [a.event_ids[0], a.event_ids[-1]] if a.event_ids else None,
        "chunk_ids": sorted({c.chunk_id for c in a.chunks if c.chunk_id}),
        "errors": [f"{e.status}{' in-band' if e.in_band else ''} {e.code}: {e.message}" for e in a.errors],
        "done": a.done, "broke": a.broke, "stalled": a.stalled, "left": a.left,
    }


def forbidden(specs: list[RequestSpec], histories: list[History], verdicts: list[Verdict],
              runs: list[FaultRun]) -> list[dict[str, Any]]:
    """Each forbidden outcome with what is needed to replay it: the request, the faults under
    way during its life, and what the client saw attempt by attempt."""
    return described(specs, histories, verdicts, runs, lambda v: v.outcome == "forbidden")


def described(specs: list[RequestSpec], histories: list[History], verdicts: list[Verdict], runs: list[FaultRun],
              which: Callable[[Verdict], bool]) -> list[dict[str, Any]]:
    """The requests ``which`` picks, each with its faults and its attempts (see :func:`forbidden`)."""
    out = []
    for spec, hist, v in zip(specs, histories, verdicts, strict=True):
        if not which(v):
            continue
        during = [r for r in runs
                  if r.started_s <= hist.ended_s and (r.ended_s or hist.ended_s) + AFTERMATH_S >= hist.started_s]
        out.append({
            "request": spec.request_id, "path": spec.path, "kinds": v.kinds, "reason": v.reason,
            "detail": v.detail[:8],
            "spec": {"n": spec.n, "max_tokens": spec.max_tokens, "tenant": spec.tenant, "priority": spec.priority,
                     "port": spec.port_index, "slow_s": spec.slow_s, "leave_after": spec.leave_after,
                     "at_s": round(spec.at_s, 2)},
            "life_s": [round(hist.started_s, 2), round(hist.ended_s, 2)],
            "faults": [{"kind": r.fault.kind, "target": r.fault.target, "t_s": [round(r.started_s, 2),
                                                                                 round(r.ended_s, 2)]}
                       for r in during],
            "attempts": [_attempt(a) for a in hist.attempts],
        })
    return out


def write_json(path: Path, summary: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=str))


def draw(path: Path, histories: list[History], verdicts: list[Verdict], runs: list[FaultRun],
         specs: list[RequestSpec]) -> None:
    """Faults (bars per kind), requests finished per second by outcome, tokens read per second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max([h.ended_s for h in histories] + [r.ended_s for r in runs] + [1.0])
    bins = int(end) + 1
    fig, (ax_f, ax_t, ax_e) = plt.subplots(3, 1, figsize=(13, 8.5), sharex=True,
                                           gridspec_kw={"height_ratios": [2.2, 1.3, 1.3]})
    kinds = [k for k in KINDS if any(r.fault.kind == k for r in runs)]
    colors = plt.get_cmap("tab20")
    for row, kind in enumerate(kinds):
        spans = [(r.started_s, max(0.4, r.ended_s - r.started_s)) for r in runs if r.fault.kind == kind]
        ax_f.broken_barh(spans, (row - 0.4, 0.8), color=colors(row % 20))
    ax_f.set_yticks(range(len(kinds)), kinds, fontsize=8)
    ax_f.set_title(f"nemesis: {len(runs)} faults, {len(histories)} requests")
    outcome_series: dict[str, list[int]] = {o: [0] * bins for o in ("exact", "explicit", "forbidden", "left")}
    tokens = [0.0] * bins
    for hist, v in zip(histories, verdicts, strict=True):
        outcome_series[v.outcome][min(bins - 1, int(hist.ended_s))] += 1
        for attempt in hist.attempts:  # spread over the attempt's life (chunks carry no time)
            count = sum(len(chunk.text.split()) for chunk in attempt.chunks)
            first, last = int(attempt.first_byte_s or attempt.started_s), min(bins - 1, int(attempt.ended_s))
            for t in range(first, last + 1):
                tokens[t] += count / (last - first + 1)
    x = list(range(bins))
    ax_t.plot(x, tokens, color="tab:blue", lw=0.8)
    ax_t.set_ylabel("tokens read /s")
    ax_e.plot(x, outcome_series["exact"], color="tab:green", lw=0.8, label="exact /s")
    ax_e.plot(x, outcome_series["explicit"], color="tab:orange", lw=0.8, label="explicit error /s")
    bad = [(t, c) for t, c in enumerate(outcome_series["forbidden"]) if c]
    if bad:
        ax_e.scatter([t for t, _ in bad], [c for _, c in bad], color="red", marker="x", label="forbidden", zorder=3)
    ax_e.set_ylabel("requests ended /s")
    ax_e.set_xlabel("seconds")
    ax_e.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
