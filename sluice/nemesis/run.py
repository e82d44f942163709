"""One nemesis run, end to end: system up, reference checked, load and faults, checker, invariants, report.

>>> result = asyncio.run(run_nemesis(NemesisConfig(seed=7, streams=320, faults=32, duration_s=120)))
>>> print(result.text())
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from sluice.nemesis.checker import ALLOWED, Verdict, check, queue_order
from sluice.nemesis.clients import Clients, Cutter
from sluice.nemesis.faults import FaultRun, Nemesis
from sluice.nemesis.history import History
from sluice.nemesis.redis_timeline import RedisTimeline
from sluice.nemesis.invariants import Invariant, check_all, redis_used_mib
from sluice.nemesis.report import (
    described,
    draw,
    failover_serving,
    forbidden,
    markdown,
    table,
    totals,
    write_json,
)
from sluice.nemesis.schedule import fault_schedule, kinds_for
from sluice.nemesis.system import GATEWAY_ENV, System, SystemShape
from sluice.nemesis.workload import Mix, Reference, RequestSpec, reference, workload


@dataclass
class NemesisConfig:
    seed: int = 7
    streams: int = 320
    faults: int = 32
    #: Seconds over which requests arrive and faults are injected.
    duration_s: float = 120.0
    #: The system: Redis topology, gateways, ports, workers and their slots, tenants.
    shape: SystemShape = field(default_factory=SystemShape)
    #: Fault kinds to draw from (default: every kind the topology supports).
    kinds: list[str] | None = None
    #: Huge resumable streams (n=16, past the journal's 20,000-event cap).
    huge: int = 1
    redis_bound_mib: float = 64.0
    rss_bound_mib: float = 400.0
    json_path: Path | None = None
    plot_path: Path | None = None
    logs: Path | None = None


@dataclass
class NemesisResult:
    config: NemesisConfig
    verdicts: list[Verdict]
    runs: list[FaultRun]
    invariants: list[Invariant]
    forbidden: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def ok(self) -> bool:
        return not self.forbidden and all(i.ok for i in self.invariants)

    def text(self) -> str:
        s = self.summary
        lines = [
            f"nemesis seed={self.config.seed} topology={self.config.shape.topology}: {s['requests']} requests, "
            f"{s['faults']['applied']} faults of {len(s['faults']['kinds'])} kinds in {s['wall_s']:.0f}s "
            f"(logs: {s['logs']})",
            "outcomes per path: " + "; ".join(f"{p}: {c}" for p, c in s["totals"].items()),
            f"resumable exact: {s['resumable_exact_pct']:.2f}%  probes with a bogus key or none: "
            f"{s['probes']['sent']} sent, {s['probes']['served']} served",
            "", markdown(s["table"]), "",
        ]
        serving = s["failover_serving"]
        if serving["failovers"]:
            lines.insert(3, f"after a failover, every port served again: {serving['served_again']} of "
                            f"{serving['failovers']}, median {serving['median_s']} s, max {serving['max_s']} s "
                            f"({serving['measured_clean']} with no gateway of the port down meanwhile); counting "
                            f"ports whose gateway was down too: median {serving['raw_median_s']} s, "
                            f"max {serving['raw_max_s']} s; {serving['not_applied']} failover(s) not applied")
        lines += [f"invariant {'ok  ' if i.ok else 'FAIL'} {i.name}: {i.detail}" for i in self.invariants]
        if s["fault_errors"]:
            lines.append(f"faults that could not be applied: {s['fault_errors']}")
        lines.append(f"gateway error log entries: {s['gateway_errors'] or 'none'}")
        lines.append(f"\nforbidden outcomes: {len(self.forbidden)}")
        for f in self.forbidden[:40]:
            faults = ", ".join(f"{x['kind']}@{x['target']}[{x['t_s'][0]:.1f}-{x['t_s'][1]:.1f}]" for x in f["faults"])
            detail = "; ".join(f["detail"][:3])
            lines.append(f"- {f['request']} ({f['path']}) {f['kinds']}: {detail} | faults: {faults}")
        return "\n".join(lines)


async def _self_check(system: System, specs: list[RequestSpec], refs: list[Reference]) -> None:
    """The reference function must be the worker's: ask one directly, with no fault, for a few."""
    async with httpx.AsyncClient(timeout=30) as http:
        for spec, ref in list(zip(specs, refs, strict=True))[:4]:
            body = {"request_id": f"selfcheck-{spec.index}", "model": "sim", "messages": spec.messages,
                    "max_tokens": spec.max_tokens, "seed": spec.seed, "ignore_eos": spec.ignore_eos}
            text = ""
            async with http.stream("POST", system.workers[0].url + "/internal/generate", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line:
                        text += orjson.loads(line).get("text", "")
            if text.split() != list(ref.words[0]):
                raise RuntimeError(f"the harness's reference differs from the worker's for request {spec.index}")


def _gateway_errors(system: System) -> dict[str, int]:
    """Error-level log entries of every gateway, by message and exception (last line)."""
    found: dict[str, int] = {}
    for gateway in system.gateways:
        for line in gateway.log_path.read_text(errors="replace").splitlines():
            if '"level":"error"' not in line:
                continue
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            last = (entry.get("exc") or "").strip().splitlines()[-1:] or [""]
            what = re.sub(r"\b[0-9a-f]{32,}\b", "<key>", f"{entry.get('msg', '').strip()} | {last[0][:160]}")
            # A repeated fault's line, said once per few seconds with a count (sluice/redis_faults.py).
            what = re.sub(r" \(\d+ more like it in the last \d+ s\)", " (and more like it)", what)
            found[what] = found.get(what, 0) + 1
    return found


async def run_nemesis(cfg: NemesisConfig) -> NemesisResult:
    logs = cfg.logs or Path(tempfile.mkdtemp(prefix="sluice-nemesis-"))
    shape = cfg.shape
    kinds = cfg.kinds or kinds_for(shape.topology)
    specs = workload(cfg.seed, cfg.streams, cfg.duration_s, shape.ports, shape.tenants, Mix(huge=cfg.huge))
    refs = [reference(s) for s in specs]
    schedule = fault_schedule(cfg.seed, cfg.faults, cfg.duration_s, kinds, shape.gateways, shape.workers)
    system = System(shape, logs)
    clients: Clients | None = None
    try:
        await system.start()
        await _self_check(system, specs, refs)
        redis_before = await asyncio.to_thread(redis_used_mib, system)
        t0 = time.monotonic()
        timeline = RedisTimeline(system.topology, t0).start()
        cutter = Cutter()
        clients = Clients(system.ports, system.api_keys, cutter, t0, f"nem{cfg.seed}")
        nemesis = Nemesis(system, cutter, t0)
        probing = asyncio.create_task(clients.probe(1.5, cfg.duration_s))
        faulting = asyncio.create_task(nemesis.run(schedule))
        histories: list[History] = list(await asyncio.gather(*(clients.run(s) for s in specs)))
        if any(h.hung for h in histories):  # where each gateway's tasks wait, in its log
            for gateway in system.gateways:
                if gateway.alive():
                    os.kill(gateway.pid, signal.SIGUSR1)
            await asyncio.sleep(1.0)
        runs = await faulting
        await probing
        timeline.stop()
        wall = time.monotonic() - t0
        ports = [system.port_of(i) for i in range(shape.gateways)]
        verdicts = [check(s, r, h, runs, ports) for s, r, h in zip(specs, refs, histories, strict=True)]
        queue_order(specs, histories, verdicts, runs)
        invariants = await check_all(system, specs, refs, histories, verdicts, runs, redis_before,
                                     cfg.redis_bound_mib, cfg.rss_bound_mib)
        errors = _gateway_errors(system)
    finally:
        if clients is not None:
            await clients.aclose()
        await system.close()
    bad = forbidden(specs, histories, verdicts, runs)
    served = [p for p in clients.probes if p.status == 200]
    bad += [{"request": "probe", "path": "probe", "kinds": ["auth_open"], "life_s": [p.at_s, p.at_s],
             "detail": [f"a request {'with a bogus key' if p.with_key else 'without a key'} was served"],
             "faults": [], "attempts": []} for p in served]
    applied = [r for r in runs if r.error is None]
    resumable = [v for v in verdicts if v.path == "resumable"]
    summary: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "gateway_env": {**GATEWAY_ENV, **shape.gateway_env}, "logs": str(logs), "wall_s": round(wall, 1),
        "requests": len(specs), "ports": system.ports,
        "faults": {"scheduled": len(schedule), "applied": len(applied),
                   "kinds": sorted({r.fault.kind for r in applied})},
        "fault_errors": [f"{r.fault.kind}@{r.fault.at_s}: {r.error}" for r in runs if r.error],
        "totals": totals(verdicts), "table": table(verdicts),
        "failover_serving": failover_serving(runs, ports),
        "resumable_exact_pct": 100 * sum(v.outcome == "exact" for v in resumable) / max(1, len(resumable)),
        "explicit_reasons": _count(v.reason for v in verdicts if v.outcome == "explicit"),
        "allowed_reasons": sorted(ALLOWED),
        "forbidden_kinds": _count(k for f in bad for k in f["kinds"]),
        "probes": {"sent": len(clients.probes), "served": len(served)},
        "gateway_errors": errors,
        "invariants": [i.public() for i in invariants],
        "forbidden": compact(bad),
        "runs": [r.public() for r in runs],
        "not_exact": [[v.index, v.path, v.outcome, v.reason, v.kinds] for v in verdicts if v.outcome != "exact"],
        "redis_timeline": timeline.changes,
        # What kept resumable streams from being exact, attempt by attempt (the first few).
        "resumable_not_exact": described(specs, histories, verdicts, runs,
                                         lambda v: v.path == "resumable" and v.outcome == "explicit")[:DETAILED],
    }
    if cfg.json_path is not None:
        write_json(cfg.json_path, summary)
    if cfg.plot_path is not None:
        draw(cfg.plot_path, histories, verdicts, runs, specs)
    return NemesisResult(cfg, verdicts, runs, invariants, bad, summary)


#: Forbidden outcomes written with every attempt; the rest with their verdict only (a
#: full run's JSON stays small enough to keep beside its chart).
DETAILED = 30


def compact(bad: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("request", "path", "kinds", "life_s")
    return [f if i < DETAILED else {k: f[k] for k in keep if k in f} | {"detail": f["detail"][-2:]}
            | {"faults": sorted({x["kind"] if isinstance(x, dict) else x for x in f["faults"]})}
            for i, f in enumerate(bad)]


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
