"""Figures from a benchmark's outcomes: status counts, per-group latencies, tables.

>>> rows = by_label(outcomes, ["urgent", "default", "low"])
>>> print(table(rows))
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from sluice.commands.bench_load import Outcome


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; NaN when there are none."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def statuses(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """Responses by status, plus the failures a status code does not show.

    ``429+RA`` are 429s carrying Retry-After; ``stream_error`` are 200s that ended
    in an in-band error event; ``truncated`` are 200s without ``[DONE]``;
    ``broken_mid_stream`` are 200s whose connection failed; ``no_response`` got no
    HTTP status at all.
    """
    counts: Counter[str] = Counter()
    for o in outcomes:
        if o.status == 0:
            counts["no_response"] += 1
        elif o.status == 429:
            counts["429+RA" if o.retry_after else "429 no RA"] += 1
        else:
            counts[str(o.status)] += 1
        if o.status == 200 and o.error:
            counts["stream_error" if o.error == "stream" else "truncated" if o.error == "truncated"
                   else "broken_mid_stream"] += 1
    counts["5xx"] = sum(1 for o in outcomes if o.status >= 500)
    return dict(sorted(counts.items()))


def latency_row(name: str, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Count, completions, sheds and queue wait / TTFT quantiles (ms) of one group."""
    done = [o for o in outcomes if o.ok]
    waits = [o.queue_ms for o in done if o.queue_ms is not None]
    ttfts = [o.ttft_s * 1000 for o in done if o.ttft_s is not None]
    return {
        "group": name, "sent": len(outcomes), "ok": len(done),
        "429": sum(1 for o in outcomes if o.status == 429),
        "queue_p50_ms": quantile(waits, 0.5), "queue_p99_ms": quantile(waits, 0.99),
        "ttft_p50_ms": quantile(ttfts, 0.5), "ttft_p99_ms": quantile(ttfts, 0.99),
    }


def by_label(outcomes: Sequence[Outcome], labels: Sequence[str]) -> list[dict[str, Any]]:
    rows = [latency_row(label, [o for o in outcomes if o.label == label]) for label in labels]
    return [*rows, latency_row("all", outcomes)]


def throughput(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Wall time from the first request sent to the last stream ended, completions/s, when
    the last request left, and the most requests open at once (sent, not yet ended)."""
    if not outcomes:
        return {"wall_s": 0.0, "ok_per_s": 0.0, "last_sent_s": 0.0, "peak_open": 0}
    first = min(o.sent_s for o in outcomes)
    wall = max(o.end_s or o.sent_s for o in outcomes) - first
    ok = sum(1 for o in outcomes if o.ok)
    events = sorted([(o.sent_s, 1) for o in outcomes] + [(o.end_s or o.sent_s, -1) for o in outcomes])
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return {"wall_s": wall, "ok_per_s": ok / wall if wall else 0.0,
            "last_sent_s": max(o.sent_s for o in outcomes) - first, "peak_open": peak}


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.1f}" if abs(value) < 1e5 else f"{value:.3g}"
    return str(value)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows of one shape as aligned text columns, headed by their keys."""
    if not rows:
        return "(no rows)"
    heads = list(rows[0])
    cells = [[_cell(r.get(h, "")) for h in heads] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]

    def line(values: list[str]) -> str:
        # The first column (a name) left-aligned, figures right-aligned.
        return "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True)))

    return "\n".join([line(heads), *(line(c) for c in cells)])


def pairs(figures: dict[str, Any]) -> str:
    """``key=value`` pairs on one line."""
    return "  ".join(f"{k}={_cell(v)}" for k, v in figures.items())
