"""README tables and charts from a GPU session's results (session.sh's $OUT).

    python -m loadtest.gpu.report loadtest/gpu/h200-2026-12-02-routing [--disagg DIR]

Prints markdown: per workload and routing arm the steady figures (requests started after
the warm-up), the issue's ratios (cache against rr and least), the migration and, with a
``disagg.json``, the P/D correctness and load rows; draws ``routing_gpu.png`` (and
``disagg.png``) again from the same lines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from loadtest.gpu.chart import draw


def fmt(value: Any, digits: int = 0) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, float | int):
        return f"{value:,.{digits}f}"
    return str(value)


def row_of(rows: list[dict[str, Any]], workload: str, arm: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["workload"] == workload and r["arm"] == arm), None)


def routing_table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| workload | routing | requests (steady) | errors | hit % | predicted hit % | TTFT p50 / p90 ms "
           "| TTFT p90 ms, all | output tok/s | gateway CPU ms/req, µs/chunk | vLLM workers CPU ms/req |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['workload']} | {r['arm']} | {fmt(r['requests'])} ({fmt(r.get('steady_requests'))}) "
                   f"| {fmt(r['errors'])} | {fmt(r['hit_pct'], 1)} | {fmt(r.get('predicted_hit_pct'), 1)} "
                   f"| {fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p90_ms'])} | {fmt(r.get('ttft_p90_ms_all'))} "
                   f"| {fmt(r['out_tok_s'])} | {fmt(r['gateway_cpu_ms_per_req'], 1)}, "
                   f"{fmt(r['gateway_cpu_us_per_chunk'])} | {fmt(r['workers_cpu_ms_per_req'], 1)} |")
    return out


def split_table(rows: list[dict[str, Any]]) -> list[str]:
    """Where TTFT P90 goes, per arm (loadtest/gpu/diagnose.py): P90 as the client and as the
    gateway measure it (from its record's start: without the way in), the slow decile's
    (client TTFT ≥ P90) mean of each part, then what the engines and the machine did meanwhile."""
    out = ["| workload | routing | TTFT p90 ms (client / gateway) | slow decile: to gateway / gateway queue / vLLM queue / vLLM prefill "
           "/ gateway→engine / to client (mean ms) | vLLM waiting max | KV use max % | preemptions "
           "| busy cores (of) | runnable p90 | GPU busy % | load generator cores, lag p99 ms |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        d = r.get("diag") or {}
        sp, m, eng = d.get("split") or {}, d.get("machine") or {}, list((d.get("engines") or {}).values())
        parts = " / ".join(fmt(sp.get(f"slow_{c}_ms")) for c in ("to_gateway", "gw_queue", "eng_queue", "eng_prefill",
                                                                   "gw_to_engine", "from_gateway"))
        out.append(f"| {r['workload']} | {r['arm']} | {fmt(r['ttft_p90_ms'])} / {fmt(sp.get('gw_ttft_p90_ms'))} | {parts} "
                   f"| {fmt(max((e['waiting_max'] for e in eng), default=None))} "
                   f"| {fmt(100 * max(e['kv_max'] for e in eng) if eng else None)} "
                   f"| {fmt(sum(e['preempted'] for e in eng) if eng else None)} "
                   f"| {fmt(m.get('busy_mean'), 1)} ({fmt(m.get('cores'))}) | {fmt(m.get('runnable_p90'))} "
                   f"| {fmt(m.get('gpu_mean'))} | {fmt(m.get('client_mean'), 2)}, {fmt(d.get('client_lag_p99_ms'))} |")
    return out


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "–"


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's goals, as measured (ratios within this one run)."""
    out = []
    for cache in dict.fromkeys(r["arm"] for r in rows if r["arm"].startswith("cache")):  # knobbed arms too
        for over in dict.fromkeys(r["workload"] for r in rows if r["workload"].startswith("overflow")):
            c, rr = row_of(rows, over, cache), row_of(rows, over, "rr")
            if not (c and rr):
                continue
            out.append(f"- {over}, {cache} vs rr: hit {ratio(c['hit_pct'], rr['hit_pct'])} (goal ≥ 2×), "
                       f"P90 TTFT {ratio(rr['ttft_p90_ms'], c['ttft_p90_ms'])} better (goal ≥ 3×); predicted hit "
                       f"{fmt(c.get('predicted_hit_pct'), 1)} % against {fmt(c['hit_pct'], 1)} % reported "
                       f"(arm's counters: {fmt(c.get('reported_hit_pct'), 1)} %, index error "
                       f"{fmt(c.get('index_error_pct'), 1)} % of prompt tokens)")
        e, err = row_of(rows, "easy", cache), row_of(rows, "easy", "rr")
        if e and err:
            out.append(f"- easy, {cache}: hit {fmt(e['hit_pct'], 1)} % (goal ≥ 90), output "
                       f"{ratio(e['out_tok_s'], err['out_tok_s'])} rr's (goal ≥ 2×)")
        ch, least = row_of(rows, "chat", cache), row_of(rows, "chat", "least")
        if ch and least:
            out.append(f"- chat, {cache} vs least: output {ratio(ch['out_tok_s'], least['out_tok_s'])} (goal ≥ 1×)")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        least, rr = row_of(rows, workload, "least"), row_of(rows, workload, "rr")
        if least and rr:
            out.append(f"- {workload}, least vs rr: TTFT p90 {ratio(least['ttft_p90_ms'], rr['ttft_p90_ms'])} "
                       f"(goal ≤ 1.2×), p50 {ratio(least['ttft_p50_ms'], rr['ttft_p50_ms'])}, output "
                       f"{ratio(least['out_tok_s'], rr['out_tok_s'])}")
    return out


def migration_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| env | streams × tokens | killed at | migrated | lost | short | different from reference "
           "| reference vs repeat | pause p50 / p99 / max ms | others' gap p50 ms | output tok/s | gateway µs/chunk |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in rows:
        out.append(f"| {m['worker_env']} | {m['streams']} × {m['stream_tokens']} | {m['killed']} at "
                   f"{fmt(m['killed_at_s'], 2)} s | {m['migrated']} | {m['lost']} | {m['short']} "
                   f"| {m['diff_vs_reference']} | {m['reference_repeat_diff']} | {fmt(m['pause_p50_ms'], 1)} / "
                   f"{fmt(m['pause_p99_ms'], 1)} / {fmt(m['pause_max_ms'], 1)} | {fmt(m['gap_p50_ms_unmigrated'], 1)} "
                   f"| {fmt(m['out_tok_s'])} | {fmt(m['gateway_cpu_us_per_chunk'])} |")
    return out


def disagg_lines(result: dict[str, Any]) -> list[str]:
    check = result.get("correctness", {})
    out = [f"connector: {result.get('connector')}; failed tries: {result.get('failed_tries')}; "
           f"startup {result.get('startup_s')} s; error: {result.get('error', 'none')}",
           f"correctness: {check.get('identical')} of {check.get('requests')} identical (greedy, "
           f"{check.get('max_tokens')} tokens, prompts {check.get('prompt_tokens')} tokens); decode hop cached "
           f"{check.get('pd_cached_tokens')} of {check.get('pd_prompt_tokens')} prompt tokens; failed transfers in "
           f"the decode log: {check.get('decode_log_transfer_failures')}; errors {check.get('errors')}",
           "", "| serving | streams | requests | errors | prompt tokens (mean) | TTFT p50 / p90 ms | ITL p50 / p99 ms "
           "| output tok/s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result.get("load", []):
        out.append(f"| {r['model']} | {r['streams']} | {r['requests']} | {r['errors']} | {fmt(r['prompt_tok_avg'])} "
                   f"| {fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p90_ms'])} | {fmt(r['itl_p50_ms'], 1)} / "
                   f"{fmt(r['itl_p99_ms'], 1)} | {fmt(r['out_tok_s'])} |")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", help="holds results.jsonl")
    p.add_argument("--disagg", default="", help="folder holding disagg.json (default: the same folder)")
    args = p.parse_args()
    folder = Path(args.folder)
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()] \
        if (folder / "results.jsonl").exists() else []
    routing = [r for r in rows if r.get("phase") == "routing"]
    migration = [r for r in rows if r.get("phase") == "migration"]
    lines: list[str] = []
    # one section per fleet: rows of a second fleet (other engine settings) carry its --label
    for label in dict.fromkeys(r.get("label", "") for r in routing):
        part = [r for r in routing if r.get("label", "") == label]
        title = f" ({label})" if label else ""
        lines += [f"### Routing{title}", "", *routing_table(part), "", *goals(part), ""]
        if any(r.get("diag") for r in part):
            lines += [f"### Where TTFT P90 goes{title}", "", *split_table([r for r in part if r.get("diag")]), ""]
    if migration:
        lines += ["### Migration", "", *migration_lines(migration), ""]
    if rows:
        labels = list(dict.fromkeys(r.get("label", "") for r in routing)) or [""]
        for label in labels:  # the first fleet's chart (with the migration), then one per other fleet
            part = [r for r in rows if r.get("label", "") == label or (label == labels[0] and r.get("phase") != "routing")]
            draw(part, folder / (f"routing_gpu-{label}.png" if label != labels[0] else "routing_gpu.png"))
    disagg = Path(args.disagg or folder) / "disagg.json"
    if disagg.exists():
        from loadtest.gpu.disagg_gpu import chart

        result = json.loads(disagg.read_text())
        lines += ["### P/D", "", *disagg_lines(result), ""]
        if result.get("load"):
            chart(result["load"], disagg.parent / "disagg.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
