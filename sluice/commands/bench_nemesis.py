"""``sluice bench --scenario nemesis``: random faults of every kind under load, every stream
checked against its exact reference (sluice/nemesis/).

The seed reproduces a run: the same requests (kinds, sizes, tenants, priorities, slow and
leaving clients) and the same fault schedule. Printed: the fault kind × path table, the
invariants after the run, and every forbidden outcome with the faults under way during
its life. Written: a JSON summary (``--nemesis-json``) and a PNG timeline
(``--nemesis-plot``). The exit status is 1 on any forbidden outcome or failed invariant.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from sluice.nemesis.run import NemesisConfig, run_nemesis
from sluice.nemesis.schedule import KINDS
from sluice.nemesis.system import SystemShape


def main(args: argparse.Namespace) -> int:
    kinds = [k.strip() for k in args.nemesis_kinds.split(",") if k.strip()] if args.nemesis_kinds else None
    if unknown := [k for k in kinds or [] if k not in KINDS]:
        raise SystemExit(f"sluice bench: unknown fault kind(s) {unknown}; known: {list(KINDS)}")
    config = NemesisConfig(
        seed=args.seed, streams=args.requests or 5000, faults=args.nemesis_faults, duration_s=args.nemesis_duration_s,
        shape=SystemShape(topology=args.topology, gateways=args.nemesis_gateways, workers=args.nemesis_workers,
                          slots=args.nemesis_slots, gateway_env=_route_sample_env(args.nemesis_route_sample)),
        kinds=kinds, huge=args.nemesis_huge, json_path=Path(args.nemesis_json), plot_path=Path(args.nemesis_plot),
    )
    print(f"sluice bench --scenario nemesis: seed {config.seed}, {config.streams} requests and {config.faults} "
          f"faults over {config.duration_s:.0f}s, {config.shape.topology} Redis", flush=True)
    result = asyncio.run(run_nemesis(config))
    print(result.text(), flush=True)
    print(f"\nsummary: {config.json_path}; timeline: {config.plot_path}", flush=True)
    return 0 if result.ok else 1


def _route_sample_env(sample: int | None) -> dict[str, str]:
    """The gateways' ``route_sample``: a fleet of more than four times it is routed by a sample
    (gateway/admission/scripts.py, "Large fleets"), so a small one puts the nemesis's few
    workers on the paths a large fleet takes."""
    return {} if sample is None else {"SLUICE_GATEWAY_ROUTE_SAMPLE": str(sample)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("nemesis scenario (--requests: requests in the run, default 5000)")
    g.add_argument("--seed", type=int, default=7, help="nemesis: the seed of the requests and the fault schedule")
    g.add_argument("--topology", choices=["single", "sentinel", "cluster"], default="single",
                   help="nemesis: the Redis under test")
    g.add_argument("--nemesis-faults", type=int, default=330, help="nemesis: faults in the run")
    g.add_argument("--nemesis-duration-s", type=float, default=600.0,
                   help="nemesis: seconds over which requests arrive and faults happen")
    g.add_argument("--nemesis-kinds", default="", help="nemesis: fault kinds, comma-separated (default: all the "
                   "topology supports): " + ", ".join(KINDS))
    g.add_argument("--nemesis-gateways", type=int, default=3, help="nemesis: gateway processes (on 2 ports)")
    g.add_argument("--nemesis-workers", type=int, default=3, help="nemesis: sim workers")
    g.add_argument("--nemesis-slots", type=int, default=24,
                   help="nemesis: slots per sim worker (fewer: requests queue under the faults)")
    g.add_argument("--nemesis-route-sample", type=int, default=None, metavar="N",
                   help="nemesis: the gateways' SLUICE_GATEWAY_ROUTE_SAMPLE (default: the gateway's, 8). A fleet "
                   "of more than 4*N workers is routed by a sample of N: with --nemesis-workers 5 or more, 1 runs "
                   "the large-fleet admission paths under the faults")
    g.add_argument("--nemesis-huge", type=int, default=2,
                   help="nemesis: huge resumable streams (n=16, past the journal's event cap)")
    g.add_argument("--nemesis-json", default="loadtest/nemesis.json", help="nemesis: JSON summary path")
    g.add_argument("--nemesis-plot", default="loadtest/nemesis.png", help="nemesis: PNG timeline path")
