"""One PNG over several GPU sessions' results (session.sh's $OUT, one folder each): per
workload and routing arm, output tok/s and TTFT P90 with a bar per folder; and per migration
run, each stream's longest gap between two chunks, migrated streams against the others, with
the streams that differ from their reference.

    python -m loadtest.gpu.runs_chart loadtest/gpu/h200-2026-12-03-migration-easy-w5

reads every subfolder holding a ``results.jsonl`` (and, for the migration, the
``logs/migration/streams.jsonl`` inside its ``logs.tar.xz``) and writes ``runs.png`` beside them.
The pause is taken from ``streams.jsonl`` (the longest gap of each stream), not from the
row's ``pause_*`` fields: before 2026-12-03 these measured the gap across the kill's instant,
which the kill itself made meaningless (loadtest/gpu/migration.py).
"""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path
from typing import Any

from loadtest.gpu.chart import COLORS


def streams_of(folder: Path) -> list[dict[str, Any]]:
    logs = folder / "logs.tar.xz"
    if not logs.exists():
        return []
    with tarfile.open(logs) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("migration/streams.jsonl")), None)
        data = tar.extractfile(member) if member is not None else None
        return [json.loads(line) for line in data.read().decode().splitlines()] if data else []


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def draw(root: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folders = sorted(p.parent for p in root.glob("*/results.jsonl"))
    rows = {f.name: [json.loads(line) for line in (f / "results.jsonl").read_text().splitlines()] for f in folders}
    routed = {name: [r for r in rs if r.get("phase") == "routing"] for name, rs in rows.items()}
    routed = {name: rs for name, rs in routed.items() if rs}
    migrations = [(f.name, r, streams_of(f)) for f in folders for r in rows[f.name] if r.get("phase") == "migration"]
    fig, axes = plt.subplots(1, 3, figsize=(21, 5.6))
    for ax, key, title in ((axes[0], "out_tok_s", "output tok/s (64 users)"), (axes[1], "ttft_p90_ms", "TTFT p90 ms")):
        groups = list(dict.fromkeys((r["workload"], r["arm"]) for rs in routed.values() for r in rs))
        width = 0.8 / max(len(routed), 1)
        for k, (name, rs) in enumerate(routed.items()):
            values = [next((r[key] for r in rs if (r["workload"], r["arm"]) == g), 0) for g in groups]
            bars = ax.bar([x + k * width for x in range(len(groups))], values, width, label=name,
                          color=[COLORS.get(g[1], "#777777") for g in groups], alpha=1.0 if k == 0 else 0.55,
                          hatch=None if k == 0 else "//", edgecolor="white")
            ax.bar_label(bars, [f"{v:,.0f}" if v else "" for v in values], fontsize=7, rotation=90, padding=2)
        ax.set_xticks([x + width * (len(routed) - 1) / 2 for x in range(len(groups))],
                      [f"{w}\n{a}" for w, a in groups], fontsize=8)
        ax.set_title(title + ": solid " + " / hatched ".join(routed))
        ax.margins(y=0.15)
    ax = axes[2]
    labels = []
    for k, (name, row, streams) in enumerate(migrations):
        moved = [s["max_gap_ms"] for s in streams if s["migrated"]]
        others = [s["max_gap_ms"] for s in streams if not s["migrated"]]
        for j, (values, colour) in enumerate(((moved, "#c0392b"), (others, "#7f8c8d"))):
            if values:
                ax.boxplot([values], positions=[3 * k + j], widths=0.7, showfliers=True,
                           patch_artist=True, boxprops={"facecolor": colour, "alpha": 0.6})
        weights = "real weights" if row.get("dummy_weights") is False else "dummy weights"
        labels.append((3 * k + 0.5, f"{name}\n{weights}\nmigrated {row['migrated']}, lost {row['lost']}\n"
                                    f"differ: {row['diff_vs_reference']} (migrated {row.get('migrated_diff_vs_reference')})"))
    ax.set_xticks([x for x, _ in labels], [t for _, t in labels], fontsize=8)
    ax.set_ylabel("longest gap between two chunks, ms")
    ax.set_title("migration, 256 x 192 greedy tokens, SIGKILL 1 of 4:\nmigrated streams (red) against the others (grey)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path)
    args = p.parse_args()
    draw(args.root, args.root / "runs.png")


if __name__ == "__main__":
    main()
