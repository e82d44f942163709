"""The faults of a nemesis run, drawn from its seed: the same seed gives the same schedule.

Every kind of DESIGN.md §2 that one machine can inflict. Durations are chosen against
the TTLs the run's gateways get (system.py): a stalled gateway sleeps past its lease,
``:live`` and liveness TTLs (3 s each); a stalled worker past the stall timeout (2 s).

Constraints that keep the system alive enough to be tested: one fault per target at a
time, at most one gateway process down or stalled at a time (the others serve), and at
most ``workers - 1`` workers down or stalled.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

#: Kind -> (target family, shortest, longest duration in seconds).
KINDS: dict[str, tuple[str, float, float]] = {
    "gateway_kill": ("gateway", 0.3, 2.0),       # SIGKILL, down this long, restarted
    "gateway_stop": ("gateway", 4.5, 7.0),       # SIGSTOP past every lease/liveness TTL, SIGCONT
    "worker_kill": ("worker", 0.3, 2.0),         # SIGKILL, down this long, restarted
    "worker_stop": ("worker", 2.5, 6.0),         # SIGSTOP past the stall timeout, SIGCONT
    "redis_restart": ("redis", 0.2, 1.5),        # SHUTDOWN SAVE, down, restart: nothing lost
    "redis_restart_lossy": ("redis", 0.2, 1.5),  # SHUTDOWN NOSAVE, down, restart empty
    "flushall": ("redis", 0.0, 0.0),
    "redis_stop": ("redis", 1.0, 6.0),           # SIGSTOP, SIGCONT
    "redis_full": ("redis", 1.0, 5.0),           # a master at its maxmemory: every write refused (OOM)
    "link_delay": ("link", 2.0, 6.0),            # one gateway's Redis link: each chunk delayed
    "link_cut": ("link", 1.0, 5.0),              # one gateway's Redis link: connections cut, refused
    "client_cut": ("clients", 0.0, 0.0),         # some clients drop their connection mid-stream
    "sentinel_failover": ("redis", 0.0, 0.0),    # Sentinel topology: the replica becomes master
    "cluster_failover": ("redis", 0.0, 0.0),     # Cluster topology: a master killed, its replica takes over
}

#: Kinds that lose Redis data (the harness restores the API keys afterwards, as an operator would).
DATA_LOSS = frozenset({"redis_restart_lossy", "flushall", "sentinel_failover", "cluster_failover"})
#: Kinds during which a gateway process cannot answer its clients.
GATEWAY_DOWN = frozenset({"gateway_kill", "gateway_stop", "link_cut"})
#: A restarted process needs a few seconds (a busy 2-core machine) before it serves again.
RESTART_MARGIN_S = 6.0
#: How long a failover keeps Redis in a fault after its command: the new master promoted,
#: the old one back as its replica and linked (medians of the 2026-12-03 runs: Sentinel
#: 11.2 s, Cluster 6.3 s). Scheduled as if instant, the next Redis faults queued behind them.
SETTLE_S = {"sentinel_failover": 11.0, "cluster_failover": 6.5}
#: Redis answers at least this long between two of its faults. Without it, Redis faults ran
#: back to back and held Redis in a fault 445-570 s of a 600 s run: what such runs measured
#: was how long a stream outlives a Redis that never comes back (its deadline), not what a
#: fault does to it. A gateway gets a moment to write back what it holds.
REDIS_GAP_S = 3.0


@dataclass(frozen=True, slots=True)
class Fault:
    index: int
    at_s: float
    kind: str
    #: "gateway-<i>", "worker-<i>", "redis", "link", "clients".
    target: str
    duration_s: float
    #: link_delay: seconds added per chunk; client_cut: clients cut; else 0.
    param: float = 0.0

    def public(self) -> dict[str, object]:
        return asdict(self)


def kinds_for(topology: str) -> list[str]:
    """Every kind the topology supports (failovers only where there is something to fail over)."""
    # The link proxy sits in front of one server: Sentinel and Cluster clients are told the
    # servers' own addresses, so only the single topology has a link to delay or cut.
    skip = {"single": {"sentinel_failover", "cluster_failover"},
            "sentinel": {"cluster_failover", "link_delay", "link_cut"},
            "cluster": {"sentinel_failover", "link_delay", "link_cut"}}[topology]
    return [k for k in KINDS if k not in skip]


def fault_schedule(seed: int, count: int, duration_s: float, kinds: list[str], gateways: int,
                   workers: int) -> list[Fault]:
    """``count`` faults spread over ``duration_s``, kinds taken in shuffled rounds so every
    kind comes up about equally often."""
    rng = random.Random(seed * 7_919 + 3)
    busy: dict[str, float] = {}  # target -> busy until
    faults: list[Fault] = []
    slot = duration_s / count
    queue: list[str] = []
    for k in range(count):
        at = (k + rng.uniform(0.1, 0.9)) * slot
        if not queue:
            queue = list(kinds)
            rng.shuffle(queue)
        for attempt, kind in enumerate(queue + kinds):
            fault = _place(k, at, kind, rng, busy, gateways, workers)
            if fault is not None:
                faults.append(fault)
                if attempt < len(queue):
                    queue.pop(attempt)
                break
    return faults


def _place(k: int, at: float, kind: str, rng: random.Random, busy: dict[str, float], gateways: int,
           workers: int) -> Fault | None:
    family, low, high = KINDS[kind]
    duration = round(rng.uniform(low, high), 2)
    until = at + duration + SETTLE_S.get(kind, 0.0) + (
        RESTART_MARGIN_S if kind.endswith("kill") else REDIS_GAP_S if family == "redis" else 1.0)
    if family == "gateway":
        if any(t.startswith("gateway") and u > at for t, u in busy.items()) or busy.get("link", 0) > at:
            return None
        target = f"gateway-{rng.randrange(gateways)}"
    elif family == "worker":
        free = [i for i in range(workers) if busy.get(f"worker-{i}", 0) <= at]
        if len(free) < 2:
            return None
        target = f"worker-{rng.choice(free)}"
    elif family == "link":
        # The proxied gateway is gateway-0; its link is not cut while another gateway is down.
        if busy.get("link", 0) > at or any(t.startswith("gateway") and u > at for t, u in busy.items()):
            return None
        target = "link"
    else:
        target = family
        if busy.get(target, 0) > at:
            return None
    busy[target] = until
    param = 0.0
    if kind == "link_delay":
        param = round(rng.uniform(0.05, 0.6), 3)
    elif kind == "client_cut":
        param = float(rng.randint(1, 6))
    return Fault(index=k, at_s=round(at, 3), kind=kind, target=target, duration_s=duration, param=param)
