"""Table and chart of peers.sh runs (the GPU kit's `peers` step): vLLM's own server read
directly, and through a Sluice gateway (``--procs N``) that streams from it directly
(``--relay direct``) or through an ``--engine openai`` worker.

    python loadtest/peers/gpu/report.py loadtest/peers/gpu/h200-peers.jsonl \
        --png loadtest/peers/gpu/h200-peers.png --json loadtest/peers/gpu/h200-peers-table.json

Each input line is one load: lg.py's JSON line, the CPU each process tree spent during it
(peers_cpu.py) and ``run`` (which device command it came from). Ratios and added TTFT are
taken within a run, against the mean of that run's ``direct`` loads of the same shape (each
run measures direct before, between and after the Sluice paths), then averaged over runs.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from statistics import mean

KINDS = {"direct": "direct (vLLM api_server)", "relay": "Sluice, direct relay", "worker": "Sluice, worker relay"}


def parse(tag: str) -> tuple[str, int | None, str]:
    """'relay4_4x64' -> ('relay', 4, '4x64'); 'direct_1x64' -> ('direct', None, '1x64')."""
    head, shape = tag.rsplit("_", 1)
    m = re.fullmatch(r"([a-z]+)(\d*)", head)
    if not m or m.group(1) not in KINDS:
        raise ValueError(f"unknown tag {tag!r}")
    return m.group(1), int(m.group(2)) if m.group(2) else None, shape


def per_load(lines: list[dict]) -> list[dict]:
    """One row per load, with its ratio to the same run's direct loads of the same shape."""
    direct = defaultdict(list)
    for d in lines:
        kind, _, shape = parse(d["tag"])
        if kind == "direct":
            direct[d.get("run", 1), shape].append(d)
    rows = []
    for d in lines:
        kind, procs, shape = parse(d["tag"])
        ref = direct[d.get("run", 1), shape]
        tok = mean(r["tok_per_s"] for r in ref)
        ttft = mean(r["ttft_p50_ms"] for r in ref)
        cpu = d.get("cpu", {})
        rows.append({"run": d.get("run", 1), "kind": kind, "procs": procs, "load": shape,
                     "tok_per_s": d["tok_per_s"], "x_direct": d["tok_per_s"] / tok,
                     "ttft_p50_ms": d["ttft_p50_ms"], "ttft_p99_ms": d["ttft_p99_ms"],
                     "added_ttft_p50_ms": d["ttft_p50_ms"] - ttft, "itl_p50_ms": d["itl_p50_ms"],
                     "nreq": d["nreq"], "ok": d["ok"], "errors": d["errors"], "err_kinds": d["err_kinds"],
                     "gateway": cpu.get("gateway"), "worker": cpu.get("worker") if kind == "worker" else None,
                     "server": cpu.get("server")})
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per path and load: the mean over runs, and each run's ratio."""
    groups = defaultdict(list)
    for r in rows:
        groups[r["kind"], r["procs"], r["load"]].append(r)
    out = []
    for (kind, procs, load), rs in groups.items():
        def cpu(part: str, key: str, rs: list[dict] = rs) -> float | None:
            return mean(r[part][key] for r in rs) if all(r[part] for r in rs) else None

        out.append({
            "path": KINDS[kind] + (f", gateway --procs {procs}" if procs else ""), "kind": kind, "procs": procs,
            "load": load, "loads": len(rs), "runs": sorted({r["run"] for r in rs}),
            "tok_per_s": mean(r["tok_per_s"] for r in rs),
            "tok_per_s_min": min(r["tok_per_s"] for r in rs), "tok_per_s_max": max(r["tok_per_s"] for r in rs),
            "x_direct": mean(r["x_direct"] for r in rs), "x_direct_each": [round(r["x_direct"], 2) for r in rs],
            "ttft_p50_ms": mean(r["ttft_p50_ms"] for r in rs), "ttft_p99_ms": mean(r["ttft_p99_ms"] for r in rs),
            "added_ttft_p50_ms": mean(r["added_ttft_p50_ms"] for r in rs),
            "added_ttft_p50_each": [round(r["added_ttft_p50_ms"], 1) for r in rs],
            "errors": sum(r["errors"] for r in rs), "requests": sum(r["nreq"] for r in rs),
            "gateway_cores": cpu("gateway", "cores"), "gateway_busiest_proc_cores": cpu("gateway", "max_proc_cores"),
            "gateway_us_per_token": cpu("gateway", "us_per_chunk"),
            "worker_cores": cpu("worker", "cores"), "worker_us_per_token": cpu("worker", "us_per_chunk"),
            "server_cores": cpu("server", "cores"), "server_busiest_proc_cores": cpu("server", "max_proc_cores"),
        })
    order = list(KINDS)
    return sorted(out, key=lambda s: (int(s["load"].split("x")[0]), order.index(s["kind"]), s["procs"] or 0))


def table(rows: list[dict]) -> str:
    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    head = ("| path | streams | loads | tok/s (mean) | × direct (mean; each load) | TTFT p50 ms | TTFT p99 ms "
            "| added TTFT p50 ms (mean; each load) | errors | gateway cores (busiest process) | gateway µs/token "
            "| worker cores |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for s in rows:
        streams = s["load"].replace("x", "×")
        each = " / ".join(f"{x:.2f}" for x in s["x_direct_each"])
        added = " / ".join(f"{x:+.0f}" for x in s["added_ttft_p50_each"])
        gw = (f'{s["gateway_cores"]:.2f} ({s["gateway_busiest_proc_cores"]:.2f})'
              if s["gateway_cores"] is not None else "-")
        lines.append(
            f'| {s["path"]} | {streams} | {s["loads"]} | {s["tok_per_s"]:,.0f} | {s["x_direct"]:.2f}; {each} '
            f'| {s["ttft_p50_ms"]:,.0f} | {s["ttft_p99_ms"]:,.0f} | {s["added_ttft_p50_ms"]:+.0f}; {added} '
            f'| {s["errors"]} of {s["requests"]:,} | {gw} | {f(s["gateway_us_per_token"], ".0f")} '
            f'| {f(s["worker_cores"], ".2f")} |')
    return "\n".join(lines)


def chart(rows: list[dict], png: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({s["load"] for s in rows}, key=lambda ld: int(ld.split("x")[0]))
    paths = list(dict.fromkeys(s["path"] for s in sorted(rows, key=lambda s: (list(KINDS).index(s["kind"]), s["procs"] or 0))))
    colors = plt.get_cmap("tab10").colors
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(18, 5.5), gridspec_kw={"width_ratios": [4, 4, 3]})
    width = 0.8 / len(paths)
    for i, p in enumerate(paths):
        xs, tok, lo, hi, p50, p99, busy, cores = [], [], [], [], [], [], [], []
        for j, ld in enumerate(loads):
            got = [s for s in rows if s["path"] == p and s["load"] == ld]
            if not got:
                continue
            (s,) = got
            xs.append(j + (i - (len(paths) - 1) / 2) * width)
            tok.append(s["tok_per_s"])
            lo.append(s["tok_per_s"] - s["tok_per_s_min"])
            hi.append(s["tok_per_s_max"] - s["tok_per_s"])
            p50.append(s["ttft_p50_ms"])
            p99.append(s["ttft_p99_ms"])
            busy.append(s["gateway_busiest_proc_cores"] or 0)
            cores.append(s["gateway_cores"] or 0)
        a1.bar(xs, tok, width, yerr=[lo, hi], capsize=2, label=p, color=colors[i % 10])
        a2.bar(xs, p50, width, label=p, color=colors[i % 10])
        a2.scatter(xs, p99, marker="_", s=150, color="black", zorder=3)
        if any(cores):
            a3.bar(xs, busy, width, color=colors[i % 10])
            a3.scatter(xs, cores, marker="_", s=150, color="black", zorder=3)
    a1.set_ylabel("tokens/s, all streams (bar: mean over runs; line: min-max)")
    a2.set_ylabel("TTFT ms (bar: p50; black tick: p99), mean over runs")
    a3.set_ylabel("gateway CPU cores (bar: busiest process; tick: all), mean over runs")
    a3.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    for a in (a1, a2, a3):
        a.set_xticks(range(len(loads)), [f"{ld.replace('x', ' × ')} streams" for ld in loads])
        a.grid(axis="y", alpha=0.3)
    a1.legend(fontsize=7.5, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", type=Path)
    ap.add_argument("--png", type=Path)
    ap.add_argument("--json", type=Path, help="write the summary rows as JSON too")
    ap.add_argument("--title", default="vLLM api_server on one H200 (m8b, dummy weights, max_tokens 256), "
                                       "direct and through a Sluice gateway (--procs 1, 4, 8)")
    args = ap.parse_args()
    lines = [json.loads(x) for x in args.jsonl.read_text().splitlines() if x.strip()]
    rows = summary(per_load(lines))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.png:
        chart(rows, args.png, args.title)


if __name__ == "__main__":
    main()
