"""The flood benchmark's chart: one PNG, one panel per figure of the phases that ran.

- queue length over time (flood, cluster), and Redis connections per gateway;
- the kill: slots in use vs streams really running, and the kill's moment;
- fairness: tokens per second per tenant, for each run.

>>> draw(summary["phases"], Path("loadtest/flood.png"))
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _flood_panels(ax_queue: Any, ax_conns: Any, phases: dict[str, Any]) -> None:
    for name in ("flood", "cluster"):
        if name not in phases:
            continue
        s = phases[name]["series"]
        ax_queue.plot(s["t_s"], s["queued"], label=f"{name} ({phases[name]['redis']} redis)")
        for g in range(len(s["connections"][0]) if s["connections"] else 0):
            # -1: the gateway was gone (killed) at that sample.
            ax_conns.plot(s["t_s"], [c[g] if c[g] >= 0 else math.nan for c in s["connections"]],
                          label=f"{name} gateway {g}",
                          linestyle="-" if name == "flood" else "--")
    ax_queue.set(title="requests waiting in the queue", xlabel="s since the first request", ylabel="queued")
    ax_conns.set(title="Redis connections per gateway process", xlabel="s", ylabel="connections")
    for ax in (ax_queue, ax_conns):
        ax.legend(fontsize=7)


def _kill_panel(ax: Any, kill: dict[str, Any]) -> None:
    s = kill["series"]
    ax.plot(s["t_s"], s["inflight"], label="slots in use (inflight)")
    ax.plot(s["t_s"], s["running"], label="streams running on workers")
    ax.plot(s["t_s"], s["queued"], label="queued", alpha=0.5)
    ax.axvline(kill["killed_s"], color="red", linestyle=":", label="gateway 0 SIGKILLed")
    ax.axvline(kill["killed_s"] + kill["lease_ttl_s"], color="grey", linestyle=":", label="+ lease TTL")
    ax.set(title="gateway kill: slots come back", xlabel="s", ylabel="count")
    ax.legend(fontsize=7)


def _fair_panel(ax: Any, name: str, run: dict[str, Any]) -> None:
    for tenant, tokens in run["series"].items():
        row = next(r for r in run["tenants"] if r["tenant"] == tenant)
        ax.plot(range(len(tokens)), tokens,
                label=f"tenant {tenant}: {row['req_per_s']:.0f} req/s x {row['max_tokens']} tokens, "
                      f"{100 * row['token_share']:.0f}% of tokens")
    ax.axvspan(*run["window_s"], color="grey", alpha=0.1, label="contended window")
    ax.set(title=f"fair share by work ({name})", xlabel="s", ylabel="tokens/s served")
    ax.legend(fontsize=7)


def draw(phases: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fair = phases.get("fair", {})
    panels = (2 if {"flood", "cluster"} & set(phases) else 0) + ("kill" in phases) + len(fair)
    if panels == 0:
        return
    rows = (panels + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(14, 4.5 * rows), squeeze=False)
    free = list(axes.flat)
    if {"flood", "cluster"} & set(phases):
        _flood_panels(free.pop(0), free.pop(0), phases)
    if "kill" in phases:
        _kill_panel(free.pop(0), phases["kill"])
    for name, run in fair.items():
        _fair_panel(free.pop(0), name, run)
    for ax in free:
        ax.set_visible(False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
