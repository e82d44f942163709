"""The routing bench's PNG: per workload, each arm's hit rate, P90 TTFT and output tok/s;
the cache arms' predicted hit against the engines' report; the migration's pauses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"rr": "#999999", "least": "#d98c3f", "least-slots": "#f2c98f", "least-w0": "#e8ab68", "least-w2": "#e0a050", "least-w4": "#c8782a", "least-w12s3": "#d98c3f", "cache-approx": "#4c78a8", "cache-precise": "#2a9d5c"}


def draw(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routing = [r for r in rows if r.get("phase") == "routing"]
    migration = [r for r in rows if r.get("phase") == "migration"]
    workloads = list(dict.fromkeys(r["workload"] for r in routing))
    arms = list(dict.fromkeys(r["arm"] for r in routing))
    fig, axes = plt.subplots(1, 5, figsize=(24, 4.8))
    panels = [("hit_pct", "hit rate % (cached / prompt tokens)"), ("ttft_p90_ms", "TTFT p90 ms (log)"),
              ("out_tok_s", "output tok/s")]
    width = 0.8 / max(len(arms), 1)
    for ax, (key, title) in zip(axes, panels, strict=False):
        for i, arm in enumerate(arms):
            values = [next((r[key] for r in routing if r["workload"] == w and r["arm"] == arm), 0) for w in workloads]
            # ARM@N (N users): the arm's colour, hatched
            ax.bar([x + i * width for x in range(len(workloads))], values, width, label=arm,
                   color=COLORS.get(arm.partition("@")[0]), hatch="//" if "@" in arm else None,
                   edgecolor="white" if "@" in arm else None)
        ax.set_xticks([x + width * (len(arms) - 1) / 2 for x in range(len(workloads))], workloads)
        ax.set_title(title)
        if key == "ttft_p90_ms":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    ax = axes[3]
    cache = [r for r in routing if "predicted_hit_pct" in r]
    for r in cache:
        ax.scatter(r["hit_pct"], r["predicted_hit_pct"], color=COLORS.get(r["arm"].partition("@")[0]),
                   label=f"{r['arm']} {r['workload']}")
        ax.annotate(r["workload"], (r["hit_pct"], r["predicted_hit_pct"]), fontsize=7)
    ax.plot([0, 100], [0, 100], color="#cccccc", linewidth=1)
    ax.set_xlabel("engines' hit % (cached_tokens)")
    ax.set_ylabel("router's predicted hit %")
    ax.set_title("index accuracy")
    ax = axes[4]
    ax.axis("off")
    lines = ["migration (SIGKILL one of the workers)"] + ([] if migration else ["not run in this session"])
    for m in migration:
        lines += [f"model {m.get('model', '?')}{' (' + m['label'] + ')' if m.get('label') else ''}",
                  f"env {m['worker_env']}", f"streams {m['streams']} x {m['stream_tokens']} tokens",
                  f"killed {m['killed']} at {m['killed_at_s']} s; migrated {m['migrated']}",
                  f"lost {m['lost']}, short {m['short']}, errors {m['errors']}",
                  f"different from reference: {m['diff_vs_reference']}"
                  + (f" (migrated: {m['migrated_diff_vs_reference']})" if "migrated_diff_vs_reference" in m else ""),
                  f"(reference vs its repeat: {m['reference_repeat_diff']})",
                  f"pause p50 / p99 / max: {m['pause_p50_ms']} / {m['pause_p99_ms']} / {m['pause_max_ms']} ms",
                  f"  others' longest gap after it, p50: {m.get('gap_p50_ms_unmigrated')} ms",
                  f"gateway CPU {m['gateway_cpu_us_per_chunk']} us/chunk"]
        if "distinct_texts" in m:
            lines += [f"texts: {m['distinct_texts']} distinct of {m['streams']},",
                      f"  {m['distinct_chunks_per_stream_mean']} distinct chunks/stream"]
    ax.text(0, 1, "\n".join(lines), va="top", fontsize=10, family="monospace")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
