"""What must hold once the load and the faults are over.

- no slot in flight, no lease, no queued request (after the leases' TTL and a reap);
- no Redis key without a TTL other than the registry (``sl:models``, ``sl:epoch``, the
  registered model's ``sl:{model}:*`` admission keys) and the API keys (``sl:apikeys``,
  ``sl:apikeys:revoked``, ``sl:apikeys:enforced``, ``sl:apikey:*``);
- Redis memory within ``redis_bound_mib`` of what it used before the load;
- every gateway process's RSS under ``rss_bound_mib``;
- usage: each attempt is billed what it served, each generation once (the rule in
  gateway/record.py): the completion tokens of a request's access-log lines (by request id,
  over every gateway and attempt; lines naming one ``usage_id`` charged once, as a meter
  charges them) add up to the tokens its client received over all its
  attempts: every chunk a stream read (once: re-attaches never repeat one), the bodies a
  non-streaming request got (an attempt answered with an error served nothing). Checked
  for every exact request, whose attempts all read to their end; a request billed less
  than it was served while a gateway was killed, or within ``BILLING_LAG_S`` after its end
  (an attempt whose gateway died before it could log: a stream is billed once its journal
  is settled, after its client got ``[DONE]``), is counted unbilled, and allowed only then.
  Per tenant: billed vs served.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from gateway.streams.journal import RECLAIM_GRACE_S
from sluice import keys
from sluice.commands.bench_probe import rss_mib
from sluice.commands.bench_stack import MODEL
from sluice.nemesis.checker import Verdict, overlapping
from sluice.nemesis.faults import FaultRun
from sluice.nemesis.history import History
from sluice.nemesis.system import System
from sluice.nemesis.workload import Reference, RequestSpec

_ACCESS = re.compile(r"access request_id=(\S+) .*?key_id=(\S+) .*?completion_tokens=(\d+)(?:.*? usage_id=(\w+))?")
#: Registry state (the models, their admission keys, ``sl:epoch``: the registry's generation,
#: which must never expire lest an idle Redis read as one that lost its data) and API keys.
_ALLOWED_NO_TTL = re.compile(r"^(sl:models|sl:epoch|sl:apikeys(:revoked|:enforced|:filed)?|sl:apikey:.*|sl:\{"
                             + re.escape(MODEL) + r"\}:.*)$")


@dataclass(slots=True)
class Invariant:
    name: str
    ok: bool
    detail: str
    value: Any = None

    def public(self) -> dict[str, Any]:
        return asdict(self)


def redis_used_mib(system: System) -> float:
    client = system.redis_client()
    try:
        info = client.info("memory")
        if isinstance(info, dict) and "used_memory" not in info:  # a cluster: per node
            return sum(float(node["used_memory"]) for node in info.values()) / 2**20
        return float(info["used_memory"]) / 2**20
    finally:
        client.close()


def _slots(system: System) -> tuple[int, int, int]:
    client = system.redis_client()
    try:
        inflight = sum(int(v) for v in client.hvals(keys.inflight(MODEL)))
        leases = int(client.zcard(keys.leases(MODEL)))
        queued = sum(int(client.zcard(q)) for q in keys.queues(MODEL))
        return inflight, leases, queued
    finally:
        client.close()


def _keys_without_ttl(system: System) -> tuple[int, list[str]]:
    client = system.redis_client()
    try:
        scanned, bad = 0, []
        for raw in client.scan_iter(count=1000):
            scanned += 1
            name = raw.decode(errors="replace")
            if not _ALLOWED_NO_TTL.match(name) and client.ttl(raw) == -1:
                bad.append(name)
        return scanned, bad
    finally:
        client.close()


async def settle(system: System, timeout_s: float = 30.0) -> Invariant:
    started = time.monotonic()
    while True:
        inflight, leases, queued = await asyncio.to_thread(_slots, system)
        waited = time.monotonic() - started
        if (inflight, leases, queued) == (0, 0, 0) or waited > timeout_s:
            break
        await asyncio.sleep(0.5)
    return Invariant("slots, leases and queues empty", (inflight, leases, queued) == (0, 0, 0),
                     f"inflight={inflight} leases={leases} queued={queued} after {waited:.1f}s",
                     {"inflight": inflight, "leases": leases, "queued": queued, "waited_s": round(waited, 1)})


async def check_all(system: System, specs: list[RequestSpec], refs: list[Reference], histories: list[History],
                    verdicts: list[Verdict], runs: list[FaultRun], redis_before_mib: float,
                    redis_bound_mib: float, rss_bound_mib: float) -> list[Invariant]:
    out = [await settle(system)]
    scanned, bad = await asyncio.to_thread(_keys_without_ttl, system)
    out.append(Invariant("no key without TTL outside the registry and API keys", not bad,
                         f"{len(bad)} of {scanned} keys: {bad[:10]}", {"scanned": scanned, "without_ttl": bad[:100]}))
    used = await asyncio.to_thread(redis_used_mib, system)
    out.append(Invariant(f"Redis memory within {redis_bound_mib:g} MiB of its start", used - redis_before_mib
                         <= redis_bound_mib, f"{redis_before_mib:.1f} MiB before, {used:.1f} MiB after",
                         {"before_mib": round(redis_before_mib, 1), "after_mib": round(used, 1)}))
    rss = {g.name: rss_mib(g.pid) for g in system.gateways}
    out.append(Invariant(f"gateway RSS under {rss_bound_mib:g} MiB",
                         all((r or 0) <= rss_bound_mib for r in rss.values()),
                         ", ".join(f"{k}={v:.0f} MiB" for k, v in rss.items() if v is not None),
                         {k: None if v is None else round(v, 1) for k, v in rss.items()}))
    out.append(usage(system, specs, histories, verdicts, runs))
    return out


#: How long after a client read its stream's end the gateway may still be billing it (the
#: journal settled, the access line written): a kill within it loses the line (nemesis,
#: Sentinel: nem-778, its one POST's gateway killed moments after its [DONE]).
BILLING_LAG_S = 1.0


def billing_ends_s(runs: list[FaultRun], ended_s: float) -> float:
    """When a gateway may still be billing a request whose client read its end at ``ended_s``:
    :data:`BILLING_LAG_S` of the gateway's running time. A gateway stopped (SIGSTOP) bills
    nothing while stopped, and a producer that finds on waking that Redis let its claim lapse
    waits ``RECLAIM_GRACE_S`` for a gateway that may have taken the stream over before it
    finishes: a stop under way in the window extends it by both. Regression (the nemesis,
    single Redis, 5faa9e2): nem-3995, whose client read its journal's end through another
    gateway while its producer's was stopped for 5.9 s, that gateway killed 1.2 s after it
    woke, its line not yet written, was called billed wrong."""
    end = ended_s + BILLING_LAG_S
    for run in sorted(runs, key=lambda r: r.started_s):
        stopped_until = run.ended_s if run.ended_s is not None else end
        if run.fault.kind == "gateway_stop" and run.started_s <= end and stopped_until >= ended_s:
            end = max(end, stopped_until + BILLING_LAG_S + RECLAIM_GRACE_S)
    return end


def served_tokens(hist: History) -> int:
    """Completion tokens the client received over all its attempts (a simulator token is one word)."""
    return sum(len(chunk.text.split()) for attempt in hist.attempts for chunk in attempt.chunks)


def usage(system: System, specs: list[RequestSpec], histories: list[History], verdicts: list[Verdict],
          runs: list[FaultRun]) -> Invariant:
    billed: dict[str, int] = defaultdict(int)
    lines: dict[str, int] = defaultdict(int)
    named: dict[tuple[str, str], int] = {}  # (request, usage_id) -> the most tokens of its lines
    for gateway in system.gateways:
        for match in _ACCESS.finditer(gateway.log_path.read_text(errors="replace")):
            request, tokens, name = match.group(1), int(match.group(3)), match.group(4)
            lines[request] += 1
            if name is None:
                billed[request] += tokens
            else:  # a meter charges each generation once (gateway/record.py)
                named[request, name] = max(named.get((request, name), 0), tokens)
    for (request, _), tokens in named.items():
        billed[request] += tokens
    wrong, unbilled = [], 0
    tenants: dict[int, dict[str, int]] = defaultdict(lambda: {"served": 0, "billed": 0})
    for spec, hist, verdict in zip(specs, histories, verdicts, strict=True):
        if verdict.outcome != "exact":
            continue
        served, got = served_tokens(hist), billed.get(spec.request_id, 0)
        tenants[spec.tenant]["served"] += served
        tenants[spec.tenant]["billed"] += got
        if got == served:
            continue
        if got < served and "gateway_kill" in overlapping(runs, hist.started_s, billing_ends_s(runs, hist.ended_s)):
            # An attempt whose gateway was killed logged nothing; the others did.
            unbilled += 1
            continue
        wrong.append(f"{spec.request_id}: served {served}, billed {got} in {lines.get(spec.request_id, 0)} line(s)")
    return Invariant("every exact request billed what each attempt served, each generation once", not wrong,
                     f"{len(wrong)} wrong, {unbilled} unbilled (their gateway was killed): {wrong[:10]}",
                     {"wrong": wrong[:200], "unbilled_killed": unbilled, "tenants": dict(tenants)})
