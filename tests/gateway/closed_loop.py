"""A closed loop of users against engines in virtual time, routed by the real admission scripts.

Routing shows its worth in TTFT, and TTFT measured on wall clocks (a shared CI machine, a
GPU shared by four engines) moved 6x between two runs of the same arm. Here time is
virtual, so a run is exact and repeatable: each engine is a vLLM-style step loop
(continuous batching, chunked prefill oldest first, one token per running sequence per
step; a step costs ``step_s`` plus ``prefill_s_per_token`` per prompt token it prefills),
each user sends its next request the instant its last one finished, and every choice of
worker is the admission script's (``Admission.acquire`` / ``prefilled`` / ``release`` on a
real Redis). Requests that end in the same engine step release their slots first and come
back after, as they do through a gateway (the releases leave with the final chunks, the
users' next requests a round trip later).

>>> shape = Shape(users=8, requests=32)                       # doctest: +SKIP
>>> (await run([gateway], "m", shape)).ttft_p90_s             # doctest: +SKIP
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from gateway.admission.queue import Admission, Ask, Lease
from sluice.commands.bench_report import quantile


@dataclass(frozen=True)
class Shape:
    """The fleet and the load: ``workers`` engines of ``capacity`` slots, ``users`` in a
    closed loop sending ``requests`` in all, each a ``prompt_tokens`` prompt (none shared)
    and ``output_tokens`` out (fixed, as ``ignore_eos`` makes them)."""

    workers: int = 4
    capacity: int = 32
    users: int = 64
    requests: int = 1280
    prompt_tokens: int = 1500
    output_tokens: int = 32
    step_s: float = 0.010
    prefill_s_per_token: float = 0.00002
    batch_tokens: int = 8192
    #: The engines share one device (four vLLM workers on one GPU): the steps in progress
    #: share its time equally.
    shared_device: bool = True


@dataclass
class _Seq:
    user: int
    gateway: Admission
    lease: Lease
    arrived: float
    prompt_left: int
    tokens: int = 0


@dataclass
class _Engine:
    shape: Shape
    running: list[_Seq] = field(default_factory=list)
    busy: bool = False
    prefilling: list[tuple[_Seq, int]] = field(default_factory=list)
    decoding: list[_Seq] = field(default_factory=list)

    def start_step(self) -> float:
        """Plan one step (decodes first, then prefill chunks oldest first); its duration."""
        self.decoding = [s for s in self.running if s.prompt_left == 0]
        budget = self.shape.batch_tokens - len(self.decoding)
        self.prefilling = []
        for seq in self.running:
            if seq.prompt_left and budget > 0:
                take = min(budget, seq.prompt_left)
                budget -= take
                self.prefilling.append((seq, take))
        self.busy = True
        return self.shape.step_s + self.shape.prefill_s_per_token * sum(t for _, t in self.prefilling)

    def end_step(self) -> tuple[list[_Seq], list[_Seq]]:
        """The step's first tokens and finished sequences."""
        firsts = []
        for seq, take in self.prefilling:
            seq.prompt_left -= take
            if seq.prompt_left == 0:
                seq.tokens = 1  # the step that ends a prompt samples its first token
                firsts.append(seq)
        for seq in self.decoding:
            seq.tokens += 1
        done = [s for s in self.running if s.tokens >= self.shape.output_tokens]
        self.running = [s for s in self.running if s.tokens < self.shape.output_tokens]
        self.busy = False
        return firsts, done


@dataclass(frozen=True)
class Outcome:
    ttfts_s: list[float]
    #: Share of requests sent to the worker that served the same user's previous request.
    same_worker: float
    wall_s: float

    @property
    def ttft_p50_s(self) -> float:
        return quantile(self.ttfts_s, 0.5)

    @property
    def ttft_p90_s(self) -> float:
        return quantile(self.ttfts_s, 0.9)


async def run(gateways: list[Admission], model: str, shape: Shape) -> Outcome:
    """Serve ``shape.requests``, each admitted by the next of ``gateways`` in turn (they
    share nothing but Redis, as gateway processes); TTFTs after the first round."""
    engines: dict[str, _Engine] = {}
    sent, ttfts, last_worker, same, now = 0, [], {}, 0, 0.0

    async def arrive(user: int) -> None:
        nonlocal sent, same
        sent += 1
        gateway = gateways[sent % len(gateways)]
        (lease,) = await gateway.acquire(Ask(model=model, request_id=uuid.uuid4().hex))
        same += last_worker.get(user) == lease.worker_id
        last_worker[user] = lease.worker_id
        engines.setdefault(lease.worker_id, _Engine(shape)).running.append(
            _Seq(user, gateway, lease, now, shape.prompt_tokens))

    #: Busy engines -> device time their step still needs; a shared device divides its time
    #: equally among the steps in progress (GPU time-slicing), else each runs at full speed.
    left: dict[str, float] = {}

    def start_idle() -> None:
        for worker_id, engine in sorted(engines.items()):
            if engine.running and not engine.busy:
                left[worker_id] = engine.start_step()

    def next_step() -> str:
        nonlocal now
        share = len(left) if shape.shared_device else 1
        worker_id = min(left, key=lambda w: (left[w], w))
        spent = left[worker_id]
        now += spent * share
        for w in left:
            left[w] -= spent
        del left[worker_id]
        return worker_id

    for user in range(min(shape.users, shape.requests)):
        await arrive(user)
    start_idle()
    served = 0
    while left:
        worker_id = next_step()
        firsts, done = engines[worker_id].end_step()
        for seq in firsts:
            seq.gateway.prefilled(seq.lease)
            if served >= shape.users:  # the first round is the start's burst, whatever the routing
                ttfts.append(now - seq.arrived)
        for gateway in gateways:
            await gateway.report_prefilled()
        for seq in done:
            await seq.gateway.release(seq.lease)
            served += 1
        for seq in done:
            if sent < shape.requests:
                await arrive(seq.user)
        start_idle()
    returning = max(sent - shape.users, 1)
    return Outcome(ttfts_s=ttfts, same_worker=same / returning, wall_s=now)
