"""The requests of a nemesis run, drawn from its seed, and the exact answer each must get.

The simulator's token ``i`` depends only on (prompt, seed, i) (engine_worker/engines/sim.py),
so every choice of every request has one right text, whatever worker, gateway or
take-over produced it: :func:`reference` computes it with the simulator's own function.
Choice ``c`` of a request runs with seed ``seed + c``, as the gateway sends it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from engine_worker.engines.sim import SimSequence, render_chat

Path = Literal["plain", "resumable", "nonstream"]
PATHS: tuple[Path, ...] = ("plain", "resumable", "nonstream")

#: Priority per tenant role: "urgent" requests come from the priority-tier key only
#: (a standard key's urgent priority is clamped, which would test nothing here).
PRIORITIES = {"default": 0, "low": 5, "urgent": -5}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One logical request of the run (with its retries and re-attaches)."""

    index: int
    path: Path
    at_s: float
    tenant: int
    priority: int
    n: int
    max_tokens: int
    ignore_eos: bool
    seed: int
    #: Seconds the client waits between two events it reads (0: reads at once).
    slow_s: float = 0.0
    #: After this many events the client leaves; a resumable one comes back ``away_s`` later.
    leave_after: int | None = None
    away_s: float = 0.0
    #: A resumable client that re-attaches by sending its POST again (the SDK's retry, same
    #: Idempotency-Key and Last-Event-ID) instead of ``GET /v1/streams/{key}``.
    repost: bool = False
    #: Whole-request deadline sent as ``X-Sluice-Timeout-Ms``.
    deadline_s: float = 60.0
    #: Which gateway port the first attempt goes to.
    port_index: int = 0

    @property
    def request_id(self) -> str:
        return f"nem-{self.index}"

    @property
    def messages(self) -> list[dict[str, object]]:
        return [{"role": "user", "content": f"nemesis request {self.index}: tell me about rivers"}]

    def body(self) -> dict[str, object]:
        body: dict[str, object] = {
            "model": "sim", "messages": self.messages, "max_tokens": self.max_tokens, "seed": self.seed,
            "n": self.n, "ignore_eos": self.ignore_eos, "priority": self.priority,
            "stream": self.path != "nonstream",
        }
        if self.path != "nonstream":
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass(frozen=True, slots=True)
class Reference:
    """What every choice must read, how it must end, and the usage it must report."""

    words: tuple[tuple[str, ...], ...]
    finish: tuple[str, ...]
    prompt_tokens: int

    @property
    def completion_tokens(self) -> int:
        return sum(len(w) for w in self.words)


def reference(spec: RequestSpec) -> Reference:
    prompt = render_chat(spec.messages)
    words, finish = [], []
    for choice in range(spec.n):
        seq = SimSequence(prompt, spec.seed + choice)
        length = spec.max_tokens if spec.ignore_eos else min(seq.natural_length, spec.max_tokens)
        words.append(tuple(SimSequence.text(seq.token(i)).strip() for i in range(length)))
        finish.append("length" if length == spec.max_tokens else "stop")
    return Reference(tuple(words), tuple(finish), len(prompt.split()))


@dataclass(frozen=True, slots=True)
class Mix:
    """Shares of the workload (each drawn independently per request)."""

    resumable: float = 0.35
    nonstream: float = 0.2
    multi: float = 0.15  # n in 2..4
    slow: float = 0.1
    leave: float = 0.12
    repost: float = 0.4  # of resumable clients: re-attach by re-sending the POST
    low: float = 0.2
    urgent: float = 0.1
    natural_end: float = 0.2  # no ignore_eos: the simulator's own end-of-sequence
    #: Huge resumable streams (n=16, past the journal's 20,000 events) per run.
    huge: int = 1
    huge_tokens: int = 1300  # x 16 choices: 20,800 events, past the journal's 20,000
    burst: float = 0.03  # a request that brings 8 more at the same instant


def workload(seed: int, count: int, duration_s: float, ports: int, tenants: int, mix: Mix = Mix()) -> list[RequestSpec]:
    """``count`` requests over ``duration_s`` (open loop, with bursts), reproducible from ``seed``.

    Tenant ``tenants - 1`` is the priority-tier key: urgent requests come from it.
    """
    rng = random.Random(seed * 1_000_003 + 17)
    specs: list[RequestSpec] = []
    rate = count / duration_s / (1 + 8 * mix.burst)  # a burst brings 8 more
    at = 0.0
    # Early, so that the run does not wait for a huge stream long after the others.
    huge_at = {int(count * (0.05 + 0.6 * k / max(1, mix.huge))) for k in range(mix.huge)}
    while len(specs) < count:
        at += rng.expovariate(rate) if specs else 0.5
        batch = 9 if rng.random() < mix.burst else 1
        for _ in range(min(batch, count - len(specs))):
            i = len(specs)
            specs.append(_huge(i, at, rng, ports, tenants, mix) if i in huge_at
                         else _one(i, min(at, duration_s), rng, ports, tenants, mix))
    return specs


def _one(i: int, at: float, rng: random.Random, ports: int, tenants: int, mix: Mix) -> RequestSpec:
    roll = rng.random()
    path: Path = ("nonstream" if roll < mix.nonstream
                  else "resumable" if roll < mix.nonstream + mix.resumable else "plain")
    role = rng.random()
    tenant = rng.randrange(tenants - 1)
    priority = PRIORITIES["default"]
    if role < mix.urgent:
        tenant, priority = tenants - 1, PRIORITIES["urgent"]
    elif role < mix.urgent + mix.low:
        priority = PRIORITIES["low"]
    n = rng.randint(2, 4) if rng.random() < mix.multi else 1
    max_tokens = rng.randint(12, 96)
    slow = rng.uniform(0.02, 0.08) if rng.random() < mix.slow and path != "nonstream" else 0.0
    leave = rng.randint(1, max_tokens * n) if rng.random() < mix.leave and path != "nonstream" else None
    return RequestSpec(
        index=i, path=path, at_s=at, tenant=tenant, priority=priority, n=n, max_tokens=max_tokens,
        ignore_eos=rng.random() >= mix.natural_end, seed=rng.randrange(1, 1 << 30), slow_s=slow,
        leave_after=leave, away_s=rng.uniform(0.3, 3.0) if leave is not None else 0.0,
        port_index=rng.randrange(ports), repost=path == "resumable" and rng.random() < mix.repost,
    )


def _huge(i: int, at: float, rng: random.Random, ports: int, tenants: int, mix: Mix) -> RequestSpec:
    """n=16 resumable choices past the journal's cap; its client leaves after 10 events and
    comes back when most of the stream has been produced (issue 20, item 1)."""
    return RequestSpec(
        index=i, path="resumable", at_s=at, tenant=0, priority=0, n=16, max_tokens=mix.huge_tokens,
        ignore_eos=True, seed=rng.randrange(1, 1 << 30), leave_after=10, away_s=42.0, deadline_s=240.0,
        port_index=rng.randrange(ports),
    )
