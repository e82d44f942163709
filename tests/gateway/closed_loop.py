"""A closed loop of users against engines in virtual time, routed by the real admission scripts.

Routing shows its worth in TTFT, and TTFT measured on wall clocks (a shared CI machine, a
GPU shared by four engines) moved 6x between two runs of the same arm. Here time is
virtual, so a run is exact and repeatable: each engine is a vLLM-style step loop
(continuous batching, chunked prefill oldest first, one token per running sequence per
step; a step costs ``step_s`` plus ``prefill_s_per_token`` per prompt token it prefills)
behind a serial front end (``frontend_s_per_token``: HTTP, chat template, tokenization and
hand-over in the worker's one Python process, one request at a time, before the engine's
queue sees it); each user sends its next request when its last one finished (at once, or
a seeded random round trip later: ``return_s``), and every choice of worker is the
admission script's (``Admission.acquire`` / ``prefilled`` / ``release`` on a real Redis).
Requests that end in the same engine step release their slots first and come back after,
as they do through a gateway (the releases leave with the final chunks, the users' next
requests a round trip later).

With no noise (the default ``Shape``) the fleet the start's burst launched stays in step
for good; :data:`H200` adds the noise a GPU has (steps of varying length, users back
after varying round trips) and the front end, and reproduces the H200's figures.

>>> shape = Shape(users=8, requests=32)                       # doctest: +SKIP
>>> (await run([gateway], "m", shape)).ttft_p90_s             # doctest: +SKIP
"""

from __future__ import annotations

import heapq
import math
import random
import uuid
from collections import deque
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
    #: Each engine's front end (the worker's HTTP server, chat template, tokenizer and
    #: hand-over to the engine: one Python process) takes its requests one at a time, this
    #: long per prompt token, before they join the engine's queue; on its own CPU, not the
    #: device's. 0: no front end (requests reach the engine as they arrive).
    frontend_s_per_token: float = 0.0
    #: A user's next request reaches the gateway a uniform random time below this after its
    #: last one ended (the round trip through client and gateway, the client's own lateness;
    #: seeded, so a run repeats). 0: at once, in the order the requests ended.
    return_s: float = 0.0
    #: Each step's device time is its cost times a uniform random factor within this share
    #: of 1 (a real step's time varies with its batch, kernels, the other engines' steps).
    #: 0: exact, and a fleet started by one burst stays in step for good.
    step_jitter: float = 0.0
    seed: int = 0


#: The H200 bench of 2026-12-03 (README.md, issue 24: 4 vLLM workers on one GPU, 64 users,
#: 1,500-token prompts, 32 tokens out), in virtual time: a 1,500-token prompt costs the
#: device 4.5 ms and its worker's front end 6 ms (tokenizing and templating 1,500 words in
#: Python), steps vary by 20 %, users come back within 5 ms. Round robin here: TTFT p50 / p90
#: 60 / 94 ms, 10 % of arrivals within 10 ms of the previous one at their worker (H200: 46-62
#: / 73-117 ms, 5-7 %); least as it was (slots alone, spread 1): 2.7x rr's p90, 64 % (H200:
#: 2.5-3.2x, 67-70 %). Without the noise the fleet keeps the lockstep the start's burst set,
#: whatever the routing (rr too: 69-75 % of arrivals in waves).
H200 = Shape(step_s=0.003, prefill_s_per_token=0.000003, frontend_s_per_token=0.000004,
             return_s=0.005, step_jitter=0.2)


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
    #: Requests in the front end, the first being handled until ``frontend_done``.
    frontend: deque[_Seq] = field(default_factory=deque)
    frontend_done: float = 0.0

    def enter(self, seq: _Seq, now: float) -> None:
        """``seq`` reaches the worker: the engine's queue, or the front end's."""
        if not self.shape.frontend_s_per_token:
            self.running.append(seq)
            return
        self.frontend.append(seq)
        if len(self.frontend) == 1:
            self.frontend_done = now + self._frontend_s(seq)

    def leave_frontend(self, now: float) -> None:
        """The front end hands its request to the engine's queue and takes the next one."""
        self.running.append(self.frontend.popleft())
        if self.frontend:
            self.frontend_done = now + self._frontend_s(self.frontend[0])

    def _frontend_s(self, seq: _Seq) -> float:
        return self.shape.frontend_s_per_token * seq.prompt_left

    def start_step(self, rng: random.Random) -> float:
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
        cost = self.shape.step_s + self.shape.prefill_s_per_token * sum(t for _, t in self.prefilling)
        if self.shape.step_jitter:
            cost *= rng.uniform(1 - self.shape.step_jitter, 1 + self.shape.step_jitter)
        return cost

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
    #: Share of requests that reached their worker within 10 ms of its previous arrival (the
    #: GPU bench's measure of waves: rr 5-7 %, least 67-70 % on the H200).
    waves: float
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
    last_arrival: dict[str, float] = {}
    waves = 0
    rng = random.Random(shape.seed)
    #: Users on their way back: (when, user), soonest first.
    coming: list[tuple[float, int]] = []

    async def arrive(user: int) -> None:
        nonlocal sent, same, waves
        sent += 1
        gateway = gateways[sent % len(gateways)]
        (lease,) = await gateway.acquire(Ask(model=model, request_id=uuid.uuid4().hex))
        same += last_worker.get(user) == lease.worker_id
        last_worker[user] = lease.worker_id
        if sent > shape.users:
            waves += now - last_arrival.get(lease.worker_id, -math.inf) < 0.010
        last_arrival[lease.worker_id] = now
        engines.setdefault(lease.worker_id, _Engine(shape)).enter(
            _Seq(user, gateway, lease, now, shape.prompt_tokens), now)

    #: Busy engines -> device time their step still needs; a shared device divides its time
    #: equally among the steps in progress (GPU time-slicing), else each runs at full speed.
    left: dict[str, float] = {}

    def start_idle() -> None:
        for worker_id, engine in sorted(engines.items()):
            if engine.running and not engine.busy:
                left[worker_id] = engine.start_step(rng)

    def share() -> int:
        return len(left) if shape.shared_device else 1

    def wait_until(at: float) -> None:
        """Move the clock to ``at``, before any step ends: each step in progress ran its share."""
        nonlocal now
        for w in left:
            left[w] -= (at - now) / share()
        now = at

    def end_step() -> str:
        """Move the clock to the next step's end; its worker."""
        nonlocal now
        worker_id = min(left, key=lambda w: (left[w], w))
        spent = left[worker_id]
        now += spent * share()
        for w in left:
            left[w] -= spent
        del left[worker_id]
        return worker_id

    for user in range(min(shape.users, shape.requests)):
        await arrive(user)
    start_idle()
    served = 0
    while left or coming or any(e.frontend for e in engines.values()):
        step_at = now + min(left.values()) * share() if left else math.inf
        handing = min((e for e in engines.values() if e.frontend), key=lambda e: e.frontend_done, default=None)
        handed_at = handing.frontend_done if handing else math.inf
        back_at = coming[0][0] if coming else math.inf
        if min(handed_at, back_at) < step_at:  # something happens before the next step ends
            if handing and handed_at <= back_at:
                wait_until(handed_at)
                handing.leave_frontend(now)
            else:
                wait_until(back_at)
                await arrive(heapq.heappop(coming)[1])
            start_idle()
            continue
        worker_id = end_step()
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
            if sent + len(coming) >= shape.requests:
                continue
            if shape.return_s:
                heapq.heappush(coming, (now + rng.uniform(0, shape.return_s), seq.user))
            else:
                await arrive(seq.user)
        start_idle()
    returning = max(sent - shape.users, 1)
    return Outcome(ttfts_s=ttfts, same_worker=same / returning, waves=waves / returning, wall_s=now)
