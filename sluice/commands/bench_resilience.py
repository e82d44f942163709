"""``sluice bench --scenario resilience``: what clients see when parts of Sluice die.

Phases (``--phases``), each on a private stack of sim workers (bench_stack.py):

- ``gap``: the same streams with and without ``Idempotency-Key`` through one gateway,
  interleaved: the inter-chunk gap p50/p99/max and TTFT p50 each path gets. A resumable
  stream is journaled event by event before its client sees it; this is what that costs.
- ``chaos``: many streams over 4 sim workers while a killer SIGKILLs a random worker
  every ``--chaos-kill-every-s`` and starts a fresh one. Every stream is compared token by
  token with the simulator's deterministic reference: tokens lost (missing at the end),
  skipped (missing in the middle), duplicated; the share completed; the p99 extra latency
  of migrated streams over the median of the others.
- ``gateway-kill``: resumable streams through one gateway, SIGKILLed mid-stream; every
  client re-attaches through another gateway with its ``Last-Event-ID``. Counted: streams
  complete and identical to their reference, and how long the take-over took.

A benchmark, not a test: it prints figures and asserts nothing; the exit status is 1
when a goal is missed (0/0/0 tokens, >= 99% completed, every re-attached stream identical).
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import itertools
import random
import re
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from engine_worker.engines.sim import SimSequence, render_chat
from sluice.commands.bench_stack import MODEL, Stack, StackShape


def reference_words(messages: list[dict[str, object]], seed: int, tokens: int) -> list[str]:
    """The simulator's deterministic answer, one word per token."""
    seq = SimSequence(render_chat(messages), seed)
    return [SimSequence.text(seq.token(i)).strip() for i in range(tokens)]


@dataclass
class TokenErrors:
    lost: int = 0
    skipped: int = 0
    duplicated: int = 0

    def add(self, reference: list[str], got: list[str]) -> None:
        """Compare one stream's words with its reference."""
        matcher = difflib.SequenceMatcher(a=reference, b=got, autojunk=False)
        for op, a0, a1, b0, b1 in matcher.get_opcodes():
            if op in ("delete", "replace"):
                if a1 == len(reference):
                    self.lost += a1 - a0
                else:
                    self.skipped += a1 - a0
            if op in ("insert", "replace"):
                self.duplicated += b1 - b0

    @property
    def total(self) -> int:
        return self.lost + self.skipped + self.duplicated


@dataclass
class Stream:
    """What one client saw of one stream."""

    index: int
    status: int = 0
    words: list[str] = field(default_factory=list)
    errors: int = 0
    finish: str | None = None
    started: float = 0.0
    ended: float = 0.0
    stamps: list[float] = field(default_factory=list)
    events: list[tuple[int | None, bytes]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.errors and self.finish == "length"


def _body(i: int, tokens: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"resilience request {i}"}],
            "max_tokens": tokens, "seed": i, "ignore_eos": True, "stream": True}


async def _read(resp: httpx.Response, out: Stream, stop_after: int | None = None) -> None:
    """SSE events of ``resp`` into ``out``; stop after ``stop_after`` events (a client cut off)."""
    ident: int | None = None
    async for line in resp.aiter_lines():
        if line.startswith("id: "):
            ident = int(line[4:].partition(".")[0])
            continue
        if not line.startswith("data: "):
            continue
        out.stamps.append(time.perf_counter())
        out.events.append((ident, line.encode()))
        ident = None
        if line == "data: [DONE]":
            continue
        data = orjson.loads(line[6:])
        if "error" in data:
            out.errors += 1
        elif data.get("choices"):
            choice = data["choices"][0]
            out.words += (choice["delta"].get("content") or "").split()
            out.finish = choice["finish_reason"] or out.finish
        if stop_after is not None and len(out.events) >= stop_after:
            return


async def stream_once(client: httpx.AsyncClient, i: int, tokens: int, headers: dict[str, str] | None = None,
                      stop_after: int | None = None) -> Stream:
    out = Stream(i, started=time.perf_counter())
    try:
        async with client.stream("POST", "/v1/chat/completions", json=_body(i, tokens),
                                 headers={"x-request-id": f"res-{i}", **(headers or {})}) as resp:
            out.status = resp.status_code
            if resp.status_code == 200:
                await _read(resp, out, stop_after)
    except httpx.HTTPError:
        out.errors += 1
    out.ended = time.perf_counter()
    return out


def _q(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- gap -------------------------------------------------------------------------------------

async def _gap(url: str, streams: int, concurrency: int, tokens: int) -> dict[str, dict[str, float]]:
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> tuple[str, Stream]:
            path = "resumable" if i % 2 else "plain"
            headers = {"Idempotency-Key": uuid.uuid4().hex} if i % 2 else {}
            async with sem:
                return path, await stream_once(client, i, tokens, headers)

        results = await asyncio.gather(*(one(i) for i in range(streams)))
    figures: dict[str, dict[str, float]] = {}
    for path in ("plain", "resumable"):
        runs = [s for p, s in results if p == path]
        gaps = [b - a for s in runs for a, b in zip(s.stamps[1:], s.stamps[2:-1], strict=False)]
        ttfts = [s.stamps[0] - s.started for s in runs if s.stamps]
        figures[path] = {"streams": len(runs), "errors": sum(not s.ok for s in runs),
                         "gap_p50_ms": _q(gaps, 0.5) * 1000, "gap_p99_ms": _q(gaps, 0.99) * 1000,
                         "gap_max_ms": max(gaps, default=float("nan")) * 1000,
                         "ttft_p50_ms": _q(ttfts, 0.5) * 1000}
    return figures


def gap_phase(args: argparse.Namespace, logs: Path) -> bool:
    shape = StackShape(gateways=1, workers=1,
                       worker_args=[f"--sim-token-ms={args.gap_token_ms}", "--sim-ttft-ms=0", "--sim-max-seqs=256"])
    with Stack(shape, logs, "gap") as stack:
        figures = asyncio.run(_gap(stack.gateway_urls[0], args.gap_streams, args.gap_concurrency, args.gap_tokens))
    print(f"\n== gap: {args.gap_streams} streams x {args.gap_tokens} tokens at {args.gap_token_ms} ms/token, "
          f"{args.gap_concurrency} at once, with and without Idempotency-Key interleaved")
    for path, f in figures.items():
        print(f"  {path:<10} streams={f['streams']:.0f} errors={f['errors']:.0f} gap p50={f['gap_p50_ms']:.1f} ms "
              f"p99={f['gap_p99_ms']:.1f} ms max={f['gap_max_ms']:.1f} ms ttft p50={f['ttft_p50_ms']:.1f} ms")
    plain, resumable = figures["plain"], figures["resumable"]
    print(f"  resumable/plain: gap p99 {resumable['gap_p99_ms'] / plain['gap_p99_ms']:.2f}x, "
          f"added ttft p50 {resumable['ttft_p50_ms'] - plain['ttft_p50_ms']:+.1f} ms")
    return not plain["errors"] and not resumable["errors"]


# --- chaos -----------------------------------------------------------------------------------

def _access(log: str) -> dict[str, tuple[float, int]]:
    """Per request id, from the gateway's access log: (total seconds, migrations)."""
    pattern = r"access request_id=(\S+) .*? total_ms=([\d.]+) .*? migrations=(\d+)"
    return {m.group(1): (float(m.group(2)) / 1000, int(m.group(3))) for m in re.finditer(pattern, log)}


def chaos_phase(args: argparse.Namespace, logs: Path) -> bool:
    worker_args = [f"--sim-token-ms={args.chaos_token_ms}", "--sim-ttft-ms=5", "--sim-max-seqs=32"]
    shape = StackShape(gateways=1, workers=args.chaos_workers, worker_args=worker_args, log_level="INFO",
                       gateway_env={"SLUICE_GATEWAY_MAX_MIGRATIONS": "4", "SLUICE_GATEWAY_STALL_TIMEOUT_S": "3",
                                    "SLUICE_GATEWAY_MAX_QUEUE": "20000", "SLUICE_GATEWAY_QUEUE_TIMEOUT_S": "60"})
    rng = random.Random(7)
    kills = 0
    with Stack(shape, logs, "chaos") as stack:
        stop = threading.Event()

        def killer() -> None:
            nonlocal kills
            while not stop.wait(rng.uniform(0.5, 1.5) * args.chaos_kill_every_s):
                stack.kill_worker(rng.randrange(len(stack.workers)))
                kills += 1
                stack.add_worker()

        async def load() -> list[Stream]:
            async with httpx.AsyncClient(base_url=stack.gateway_urls[0], timeout=180,
                                         limits=httpx.Limits(max_connections=args.chaos_concurrency + 4)) as client:
                sem = asyncio.Semaphore(args.chaos_concurrency)

                async def one(i: int) -> Stream:
                    async with sem:
                        return await stream_once(client, i, 40 + (i * 37) % 80)

                return await asyncio.gather(*(one(i) for i in range(args.chaos_streams)))

        thread = threading.Thread(target=killer, daemon=True)
        started = time.monotonic()
        thread.start()
        try:
            results = asyncio.run(load())
        finally:
            stop.set()
            thread.join(60)
        wall = time.monotonic() - started
        access = _access(stack.gateways[0].log_path.read_text(errors="replace"))
    errors = TokenErrors()
    completed = [s for s in results if s.ok]
    for s in completed:
        errors.add(reference_words(_body(s.index, 0)["messages"], s.index, 40 + (s.index * 37) % 80), s.words)  # type: ignore[arg-type]
    # Durations as the gateway saw them (its access log): the load generator shares the
    # machine's 2 cores, so its own clock would add its CPU queueing to every figure.
    plain = [total for total, moves in access.values() if not moves]
    moved = [total for total, moves in access.values() if moves]
    extra_p99 = _q(moved, 0.99) - _q(plain, 0.99) if moved and plain else float("nan")
    share = len(completed) / len(results)
    print(f"\n== chaos: {len(results)} streams over {args.chaos_workers} sim workers, {kills} worker SIGKILLs "
          f"in {wall:.0f} s")
    print(f"  completed {len(completed)}/{len(results)} ({share:.2%})  lost={errors.lost} "
          f"skipped={errors.skipped} duplicated={errors.duplicated} tokens")
    print(f"  migrated streams={len(moved)} migrations={sum(m for _, m in access.values())}  duration p50/p99 "
          f"(gateway's access log): migrated {_q(moved, 0.5) * 1000:.0f}/{_q(moved, 0.99) * 1000:.0f} ms, others "
          f"{_q(plain, 0.5) * 1000:.0f}/{_q(plain, 0.99) * 1000:.0f} ms: p99 extra latency {extra_p99 * 1000:+.0f} ms")
    return errors.total == 0 and share >= 0.99 and kills >= args.chaos_min_kills


# --- gateway-kill ----------------------------------------------------------------------------

def gateway_kill_phase(args: argparse.Namespace, logs: Path) -> bool:
    tokens = args.kill_tokens
    shape = StackShape(gateways=3, workers=2, worker_args=[f"--sim-token-ms={args.kill_token_ms}", "--sim-ttft-ms=0",
                                                            "--sim-max-seqs=512"], log_level="INFO")
    with Stack(shape, logs, "gateway-kill") as stack:
        urls = stack.gateway_urls

        async def run() -> tuple[list[Stream], list[float], int]:  # streams, pauses, cut
            keys = [uuid.uuid4().hex for _ in range(args.kill_streams)]
            limits = httpx.Limits(max_connections=args.kill_streams + 8)
            started = [asyncio.Event() for _ in keys]
            async with httpx.AsyncClient(base_url=urls[0], timeout=120, limits=limits) as doomed, \
                    httpx.AsyncClient(timeout=120, limits=limits) as others:

                async def first(i: int) -> Stream:
                    out = Stream(i, started=time.perf_counter())
                    try:
                        async with doomed.stream("POST", "/v1/chat/completions", json=_body(i, tokens),
                                                 headers={"Idempotency-Key": keys[i]}) as resp:
                            out.status = resp.status_code
                            started[i].set()
                            await _read(resp, out)
                    except httpx.HTTPError:
                        pass  # its gateway died under it
                    started[i].set()
                    return out

                firsts_task = asyncio.gather(*(first(i) for i in range(len(keys))))
                for event in started:
                    await event.wait()
                await asyncio.sleep(args.kill_after_s)  # every stream is under way: kill their gateway
                stack.kill_gateway(0)
                killed_at = time.perf_counter()
                firsts = await firsts_task
                cut = sum(1 for f in firsts if not f.events or f.events[-1][1] != b"data: [DONE]")

                async def reattach(i: int, first: Stream) -> tuple[Stream, float]:
                    rest = Stream(i, started=time.perf_counter())
                    if first.events and first.events[-1][1] == b"data: [DONE]":
                        rest.status, rest.finish = 200, first.finish
                        return rest, -1.0
                    last = max((n for n, _ in first.events if n is not None), default=0)
                    url = urls[1 + i % 2] + f"/v1/streams/{keys[i]}"
                    async with others.stream("GET", url, headers={"Last-Event-ID": str(last)}) as resp:
                        rest.status = resp.status_code
                        await _read(resp, rest)
                    stamps = [killed_at, *rest.stamps]
                    return rest, max(b - a for a, b in itertools.pairwise(stamps)) if rest.stamps else -1.0

                rests = await asyncio.gather(*(reattach(i, f) for i, f in enumerate(firsts)))
            whole = [
                Stream(first.index, status=rest.status, words=first.words + rest.words,
                       errors=first.errors + rest.errors, finish=rest.finish, events=first.events + rest.events)
                for first, (rest, _) in zip(firsts, rests, strict=True)
            ]
            return whole, [pause for first, (_, pause) in zip(firsts, rests, strict=True) if pause >= 0], cut

        results, pauses, cut = asyncio.run(run())
    errors = TokenErrors()
    identical = 0
    for s in results:
        reference = reference_words(_body(s.index, 0)["messages"], s.index, tokens)  # type: ignore[arg-type]
        errors.add(reference, s.words)
        ids = [n for n, _ in s.events if n is not None]
        identical += s.ok and s.words == reference and ids == list(range(1, len(ids) + 1))
    print(f"\n== gateway-kill: {len(results)} resumable streams of {tokens} tokens at {args.kill_token_ms} ms/token; "
          f"their gateway SIGKILLed {args.kill_after_s} s after the last one started ({cut} cut mid-stream); "
          "each client re-attached through another gateway")
    print(f"  complete and identical to the reference: {identical}/{len(results)}  lost={errors.lost} "
          f"skipped={errors.skipped} duplicated={errors.duplicated} tokens")
    print(f"  longest pause a re-attached client saw after the kill: p50={_q(pauses, 0.5):.2f} s "
          f"p99={_q(pauses, 0.99):.2f} s (the dead producer's :live lapses after 3 s)")
    failures = [s for s in results if not s.ok]
    if failures:
        sample = [(s.status, [d for _, d in s.events if b'"error"' in d][:1]) for s in failures[:3]]
        print(f"  {len(failures)} incomplete, e.g. (status, error): {sample}")
    return identical == len(results) and cut > 0


PHASES = {"gap": gap_phase, "chaos": chaos_phase, "gateway-kill": gateway_kill_phase}


def main(args: argparse.Namespace) -> int:
    phases = [p.strip() for p in args.resilience_phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise SystemExit(f"sluice bench: unknown resilience phase(s) {unknown}; known: {sorted(PHASES)}")
    logs = Path(tempfile.mkdtemp(prefix="sluice-resilience-"))
    print(f"sluice bench --scenario resilience: phases {phases}; logs under {logs}", flush=True)
    met = [PHASES[p](args, logs) for p in phases]
    return 0 if all(met) else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("resilience scenario")
    g.add_argument("--resilience-phases", default="gap,chaos,gateway-kill", help="phases to run, in order")
    g.add_argument("--gap-streams", type=int, default=200, help="gap: streams (half with Idempotency-Key)")
    g.add_argument("--gap-concurrency", type=int, default=32, help="gap: streams at once")
    g.add_argument("--gap-tokens", type=int, default=200, help="gap: tokens per stream")
    g.add_argument("--gap-token-ms", type=float, default=5.0, help="gap: sim decode step")
    g.add_argument("--chaos-streams", type=int, default=2000, help="chaos: streams")
    g.add_argument("--chaos-concurrency", type=int, default=64, help="chaos: streams at once")
    g.add_argument("--chaos-workers", type=int, default=4, help="chaos: sim workers")
    g.add_argument("--chaos-token-ms", type=float, default=8.0, help="chaos: sim decode step")
    g.add_argument("--chaos-kill-every-s", type=float, default=0.8, help="chaos: mean seconds between SIGKILLs")
    g.add_argument("--chaos-min-kills", type=int, default=25, help="chaos: goal's minimum number of kills")
    g.add_argument("--kill-streams", type=int, default=200, help="gateway-kill: resumable streams")
    g.add_argument("--kill-tokens", type=int, default=400, help="gateway-kill: tokens per stream")
    g.add_argument("--kill-after-s", type=float, default=1.0,
                   help="gateway-kill: seconds after the last stream started")
    g.add_argument("--kill-token-ms", type=float, default=20.0, help="gateway-kill: sim decode step")
