"""Session affinity end to end: two gateway processes, sim workers, the real ``openai`` SDK.

A session (``prompt_cache_key``, ``x-session-id`` or ``user``) sticks to one worker through
either gateway; it moves when its worker drains or dies; bounded load spills a busy session
to its next worker. Prompts are shorter than a prefix block, so cache routing has nothing to
go on and every choice shown here is the session's.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time

import httpx
import openai
import pytest
import redis

from gateway.admission.affinity import session_of
from tests.conftest import wait_for
from tests.long_streams import busy_slots, hold


def _served(http: httpx.Client, worker_urls: dict[str, str]) -> dict[str, float]:
    out = {}
    for name, url in worker_urls.items():
        text = http.get(url + "/metrics").text
        match = re.search(r"^sluice_worker_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE)
        out[name] = float(match.group(1)) if match else 0.0
    return out


def _ask(client: openai.OpenAI, model: str, session: dict[str, object], text: str) -> None:
    client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": text}],
                                   **session)  # type: ignore[arg-type]


def _where(clients: list[openai.OpenAI], workers: dict[str, str], model: str,
           session: dict[str, object], requests: int) -> list[str]:
    """The worker that served each of ``requests`` requests of one session (gateways alternate)."""
    seen = []
    # Kept-alive connections for the scrapes: a new connection per scrape was most of the time.
    with httpx.Client(timeout=10) as http:
        after = _served(http, workers)
        for i in range(requests):
            before = after
            _ask(clients[i % len(clients)], model, session, f"turn {i}")
            # A worker counts a stream once it finished there, which may be just after the
            # client got its answer (CI under load: a turn counted by no worker).
            until = time.monotonic() + 5
            while sum((after := _served(http, workers)).values()) <= sum(before.values()) \
                    and time.monotonic() < until:
                time.sleep(0.02)
            seen += [name for name in workers if after[name] > before[name]]
    return seen


SESSIONS: list[dict[str, object]] = [
    {"extra_body": {"prompt_cache_key": f"conv-{i}"}} for i in range(4)
] + [{"extra_headers": {"x-session-id": f"sid-{i}"}} for i in range(3)] + [{"user": f"user-{i}"} for i in range(3)]


@pytest.mark.parametrize("variant", ["cost", "bounded"])
def test_a_session_sticks_to_one_worker_through_either_gateway(start_worker, start_gateway, variant: str) -> None:
    model = f"affinity-sticks-{variant}"
    workers = {w.name: w.url for w in (start_worker(model, sim_ttft_ms=0, sim_token_ms=1) for _ in range(3))}
    gateways = [start_gateway(env={"SLUICE_GATEWAY_SESSION_AFFINITY": variant}) for _ in range(2)]
    clients = [openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0) for g in gateways]
    homes = set()
    for session in SESSIONS:
        seen = _where(clients, workers, model, session, 4)
        assert len(seen) == 4 and len(set(seen)) == 1, f"{session}: served by {seen}"
        homes.add(seen[0])
    # Sessions spread over the fleet: ten sessions on three workers never share one.
    assert len(homes) >= 2, homes


def test_a_sessions_home_is_the_first_worker_in_rank_that_serves_its_task(start_worker, start_gateway) -> None:
    """Regression (merging affinity with pooling): under ``cost`` affinity a session's home
    was the first live worker in rank of any task; where that was an embedding worker, no
    generating worker was home and the session's turns went wherever cache routing sent them."""
    model = "affinity-tasks"
    generating = {w.name: w.url for w in (start_worker(model, sim_ttft_ms=0, sim_token_ms=1) for _ in range(2))}
    for _ in range(3):
        start_worker(model, task="embed")
    client = openai.OpenAI(base_url=start_gateway().url + "/v1", api_key="unused", max_retries=0)
    for i in range(8):
        key = f"task-conv-{i}"
        session = session_of(key, None, None)
        home = max(generating, key=lambda w: hashlib.sha1(f"{session} {w}".encode()).hexdigest())
        seen = _where([client], generating, model, {"extra_body": {"prompt_cache_key": key}}, 2)
        assert seen == [home, home], f"{key}: served by {seen}, its home is {home}"


def test_a_session_moves_when_its_worker_drains_or_dies(start_worker, start_gateway) -> None:
    model = "affinity-moves"
    procs = {w.name: w for w in (start_worker(model, sim_ttft_ms=0, sim_token_ms=1) for _ in range(3))}
    workers = {name: p.url for name, p in procs.items()}
    gateways = [start_gateway(), start_gateway()]
    clients = [openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0) for g in gateways]
    session: dict[str, object] = {"extra_body": {"prompt_cache_key": "long-conversation"}}
    (home,) = set(_where(clients, workers, model, session, 2))

    procs[home].stop()  # SIGTERM: it drains and leaves the registry
    del workers[home]
    seen = _where(clients, workers, model, session, 3)
    assert len(set(seen)) == 1, seen
    second = seen[0]

    procs[second].kill()  # SIGKILL: its heartbeat stops, the retry and then the registry exclude it
    del workers[second]
    seen = _where(clients, workers, model, session, 3)
    assert seen == [next(iter(workers))] * 3, seen


async def test_bounded_load_spills_a_busy_session_to_its_next_worker(
    start_worker, start_gateway, redis_client: redis.Redis,
) -> None:
    """Four long streams of one session on two workers of four slots. The bound is
    ceil(1.25 x the mean load with this request): its home takes the first two, the third
    (3 > ceil(1.25 x 3/2)) spills to the other worker, the fourth fits home again (3 <= 3)."""
    model = "affinity-bounded"
    for _ in range(2):
        start_worker(model, sim_max_seqs=4, sim_ttft_ms=0, sim_token_ms=20)
    gateway = start_gateway(env={"SLUICE_GATEWAY_SESSION_AFFINITY": "bounded"})

    def inflight() -> dict[str, int]:
        return busy_slots(redis_client, model)

    streams: list[asyncio.Task[None]] = []
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
        try:
            for n in range(1, 5):
                streams.append(asyncio.create_task(hold(client, model, prompt_cache_key="hot-session")))
                await asyncio.to_thread(wait_for, lambda n=n: sum(inflight().values()) == n, 20, f"{n} streams")
                if n == 2:
                    assert len(inflight()) == 1, f"two streams of a session left its home: {inflight()}"
                if n == 3:
                    assert sorted(inflight().values()) == [1, 2], f"the third did not spill: {inflight()}"
            used = inflight()
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    assert sorted(used.values()) == [1, 3], used
