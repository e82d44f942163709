"""The ``fair`` phase of ``sluice bench --scenario flood``: fair share by work between tenants.

Two API keys of one tier (limits raised so they never bind), one gateway, one small
sim worker. Tenant A asks 10x tenant B's request rate, open loop, so the queue stays
contended. Two runs: equal request sizes, then B's requests ``--fair-b-scale`` times
larger (max_tokens). Fair share by work means: while B asks for less than half of
the capacity, it gets all it asks with short waits and A absorbs the overload; once
B asks for more, the two split the work (tokens) evenly, not the requests.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import httpx

from sluice.apikeys import KeyStore
from sluice.commands.bench_load import Outcome, Shot
from sluice.commands.bench_probe import cpu, watched
from sluice.commands.bench_report import latency_row, quantile, table
from sluice.commands.bench_stack import Stack, StackShape, gateway_env
from sluice.redis_pool import create_pool

SLOTS = 8
TOKEN_MS = 20.0
MAX_TOKENS = 16
#: Tenants' limits: far above what the run asks, so only the queue decides.
UNBOUND = {"rpm": 1_000_000, "tpm": 1_000_000_000, "max_concurrent": 100_000}


def _await_keys_enforced(url: str, timeout_s: float = 10.0) -> None:
    """Gateways notice the first API key within seconds: wait until a keyless request gets 401."""
    deadline = time.monotonic() + timeout_s
    body = {"model": "sim", "prompt": "x", "max_tokens": 1}
    while httpx.post(url + "/v1/completions", json=body, timeout=5).status_code != 401:
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway never started to require API keys")
        time.sleep(0.2)


def tenant_shots(duration_s: float, rates: tuple[float, float], sizes: tuple[int, int],
                 api_keys: tuple[str, str]) -> list[Shot]:
    shots = []
    for name, rate, size, key in zip("AB", rates, sizes, api_keys, strict=True):
        shots += [Shot(at_s=i / rate, gateway=0, label=name, max_tokens=size, api_key=key)
                  for i in range(int(duration_s * rate))]
    return sorted(shots, key=lambda s: s.at_s)


def shares(outcomes: list[Outcome], window: tuple[float, float]) -> dict[str, dict[str, float]]:
    """Per tenant: share of tokens and of completed requests among streams ending in ``window``."""
    inside = [o for o in outcomes if o.ok and o.end_s is not None and window[0] <= o.end_s < window[1]]
    tokens = sum(o.tokens for o in inside) or 1
    out = {}
    for name in "AB":
        mine = [o for o in inside if o.label == name]
        out[name] = {"token_share": sum(o.tokens for o in mine) / tokens,
                     "request_share": len(mine) / max(len(inside), 1)}
    out["all"] = {"tokens_per_s": sum(o.tokens for o in inside) / (window[1] - window[0])}
    return out


def tokens_per_second(outcomes: list[Outcome], label: str, until_s: float) -> list[int]:
    """Tokens of ``label``'s streams, by the second they ended in (for the chart)."""
    bins = [0] * (int(until_s) + 1)
    for o in outcomes:
        if o.label == label and o.ok and o.end_s is not None and 0 <= o.end_s < len(bins):
            bins[int(o.end_s)] += o.tokens
    return bins


async def _fair_run(args: argparse.Namespace, logs: Path, name: str, b_scale: int) -> dict[str, Any]:
    rates = (args.fair_rate_a, args.fair_rate_a / 10)
    sizes = (MAX_TOKENS, MAX_TOKENS * b_scale)
    duration = args.fair_duration_s
    shape = StackShape(gateways=1, workers=1, redis=args.redis,
                       gateway_env=gateway_env(args.fair_queue_timeout_s),
                       worker_args=[f"--sim-max-seqs={SLOTS}", f"--sim-token-ms={TOKEN_MS}", "--sim-ttft-ms=5"])
    capacity = SLOTS * 1000 / TOKEN_MS
    offered = [r * s for r, s in zip(rates, sizes, strict=True)]
    print(f"\n== fair/{name}: A {rates[0]:.0f} req/s x {sizes[0]} tokens, B {rates[1]:.0f} req/s x {sizes[1]} "
          f"tokens for {duration:.0f} s; capacity ~{capacity:.0f} tokens/s, offered "
          f"{sum(offered) / capacity:.1f}x (B alone {offered[1] / capacity:.2f}x)", flush=True)
    with Stack(shape, logs, f"fair-{name}") as stack:
        redis = await create_pool(stack.redis_url)
        try:
            store = KeyStore(redis)
            api_keys = tuple([(await store.create(f"tenant-{t}", "standard", **UNBOUND))[0] for t in "AB"])
        finally:
            await redis.aclose()
        _await_keys_enforced(stack.gateway_urls[0])
        shots = tenant_shots(duration, rates, sizes, api_keys)  # type: ignore[arg-type]
        outcomes, sampler, after = await watched(stack, shots, args.load_processes)
    window = (min(2.0, duration / 4), duration)
    split = shares(outcomes, window)
    rows = []
    for t, rate, size in zip("AB", rates, sizes, strict=True):
        mine = [o for o in outcomes if o.label == t]
        row = latency_row(t, mine)
        rows.append({"tenant": t, "req_per_s": rate, "max_tokens": size, "offered": row["sent"],
                     "completed": row["ok"], "429": row["429"],
                     "token_share": split[t]["token_share"], "request_share": split[t]["request_share"],
                     "ttft_p50_ms": row["ttft_p50_ms"], "ttft_p99_ms": row["ttft_p99_ms"],
                     "queue_p50_ms": row["queue_p50_ms"], "queue_p99_ms": row["queue_p99_ms"],
                     "demand_share": offered["AB".index(t)] / capacity})
    print(table(rows))
    errors = [o for o in outcomes if o.status >= 500 or o.error]
    used = cpu(sampler, after["load_cpu_s"])
    print(f"contended window {window[0]:.0f}-{window[1]:.0f} s: {split['all']['tokens_per_s']:.0f} tokens/s "
          f"served; 5xx or broken streams: {len(errors)}; inflight/leases after: "
          f"{after['inflight_after']}/{after['leases_after']}; CPU s: gateway {used['cpu_s_gateways']}, "
          f"load generator {used['cpu_s_load']}", flush=True)
    until = max((o.end_s or 0.0) for o in outcomes)
    return {"tenants": rows, "window_s": window, "tokens_per_s_served": split["all"]["tokens_per_s"],
            "errors": len(errors), **after, **used,
            "b_queue_p99_ms": quantile([o.queue_ms for o in outcomes if o.label == "B" and o.queue_ms], 0.99),
            "series": {t: tokens_per_second(outcomes, t, until) for t in "AB"}}


async def fair_phase(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    return {"equal": await _fair_run(args, logs, "equal", 1),
            f"b_{args.fair_b_scale}x": await _fair_run(args, logs, f"b_{args.fair_b_scale}x", args.fair_b_scale)}
