"""The PNG of ``short.sh``'s loads through ``short_load.py`` (``CLIENT=lean``): one arm per
``results-*.jsonl`` file of a folder (its name after ``results-``), requests a second and TTFT
p50 / p99 at each number of streams, side by side.

    python3 loadtest/gpu/short_chart.py loadtest/gpu/h100-2026-12-07-tokenizer   # -> chart.png there
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def arms(folder: Path) -> dict[str, dict[int, dict[str, float]]]:
    """Each arm's loads by streams (the warm-up lines, which have none, left out)."""
    found: dict[str, dict[int, dict[str, float]]] = {}
    for path in sorted(folder.glob("results-*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        found[path.stem.removeprefix("results-")] = {r["streams"]: r for r in rows if r.get("streams")}
    return found


def draw(folder: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_arm = arms(folder)
    levels = sorted({s for loads in by_arm.values() for s in loads})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(by_arm), 1)
    for i, (arm, loads) in enumerate(by_arm.items()):
        xs = [x + i * width for x in range(len(levels))]
        rates = [loads.get(s, {}).get("req_per_s", 0) for s in levels]
        bars = axes[0].bar(xs, rates, width, label=arm)
        axes[0].bar_label(bars, fmt="%.0f", fontsize=8)
        p50 = [loads.get(s, {}).get("ttft_p50_ms", 0) for s in levels]
        p99 = [loads.get(s, {}).get("ttft_p99_ms", 0) for s in levels]
        axes[1].bar(xs, p99, width, color=bars[0].get_facecolor(), alpha=0.35)
        axes[1].bar(xs, p50, width, color=bars[0].get_facecolor(), label=arm)
    for ax, label in zip(axes, ("requests / s", "TTFT ms: p50 (solid), p99 (pale)"), strict=True):
        ax.set_xticks([x + width * (len(by_arm) - 1) / 2 for x in range(len(levels))],
                      [f"{s} streams" for s in levels])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out = folder / "chart.png"
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--title", default="one-token chat requests, short_load.py's client")
    args = parser.parse_args()
    print(draw(args.folder, args.title))


if __name__ == "__main__":
    main()
