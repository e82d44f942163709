"""Resumable streams through the faults they exist for, and within their bounds: Redis
losing its data, requests whose history cannot fit, one API key filling Redis."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import orjson
import pytest
import redis

from gateway.streams.event_ids import frame, tag_of
from gateway.streams.idempotency import Idempotency, scoped
from gateway.streams import journal as journal_module
from gateway.streams.journal import APPEND, DONE, JournalCommitter, JournalWriter, producer_gone, start_producer
from gateway.streams.journal_history import JournalHistory
from gateway.streams.journal_keeper import WRITE_BACK_S, Finished, JournalKeeper
from gateway.streams.journal_readers import JournalReaders
from sluice import keys
from sluice.embedded_redis import EmbeddedCluster, EmbeddedRedis
from sluice.nemesis.proxy import LinkProxy
from sluice.redis_pool import create_pool
from tests.conftest import ROOT, wait_for
from tests.gateway.test_resumable import _events, _text


@pytest.fixture
def private_redis():
    holder = {"server": EmbeddedRedis().start()}
    yield holder
    holder["server"].stop()


def _stream(url: str, body: dict[str, object], headers: dict[str, str], during=None, at: int = 0):
    """(id, data) events of a streamed POST; ``during()`` runs once ``at`` events arrived."""
    lines: list[str] = []
    seen = 0
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            lines.append(line)
            seen += line.startswith("data: ")
            if during is not None and seen == at and line.startswith("data: "):
                during()
    return _events(lines)


def _lose(holder: dict[str, EmbeddedRedis], loss: str) -> EmbeddedRedis:
    """Redis loses its data: FLUSHALL, or a restart without persistence (same port). The
    server it runs as now."""
    server = holder["server"]
    if loss == "flushall":
        with redis.Redis.from_url(server.url) as client:
            client.flushall()
    else:
        server.stop()
        holder["server"] = EmbeddedRedis(port=server.port).start()
    return holder["server"]


def _errors(events) -> list[str]:
    return [d for _, d in events if d.startswith('{"error"')]


@pytest.mark.parametrize("loss", ["flushall", "restart"])
def test_a_resumable_stream_goes_on_when_redis_loses_its_data(private_redis, start_worker, start_gateway,
                                                               loss: str) -> None:
    """Regression: Redis losing ``:live`` (FLUSHALL, a restart without persistence) was
    taken for a take-over and every resumable stream in flight ended with "producer is
    gone", while plain streams went on. And (nemesis seed 7: 187 of 1,740 resumable
    streams) a client re-attaching from before the loss got ``stream_history_lost``: the
    producer wrote on after the hole. It now writes the whole journal again first."""
    server = private_redis["server"]
    start_worker("lost", redis_at=server.url, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=server.url)
    body = {"model": "lost", "prompt": "a story", "max_tokens": 150, "ignore_eos": True, "stream": True}
    reference = httpx.post(gateway.url + "/v1/completions", json={**body, "stream": False},
                           timeout=60).json()["choices"][0]["text"]
    key = uuid.uuid4().hex

    events = _stream(gateway.url + "/v1/completions", body, {"Idempotency-Key": key},
                     lambda: _lose(private_redis, loss), at=30)
    assert not _errors(events), _errors(events)
    assert [i for i, _ in events if i is not None] == list(range(1, 151))
    assert events[-1][1] == "[DONE]"
    assert _text(events) == reference
    # Redis lost events 1..~30: a client re-attaching from before the loss gets the rest, exactly.
    with httpx.stream("GET", f"{gateway.url}/v1/streams/{key}", headers={"Last-Event-ID": "5"}, timeout=30) as r:
        assert _events(r.iter_lines()) == events[5:]
    # So does one that saw event 140.
    with httpx.stream("GET", f"{gateway.url}/v1/streams/{key}", headers={"Last-Event-ID": "140"}, timeout=30) as r:
        assert _events(r.iter_lines()) == events[140:]


def test_a_loss_under_many_resumable_streams_is_logged_once_not_once_per_stream(private_redis, start_worker,
                                                                                start_gateway) -> None:
    """A Redis that loses its data under N live resumable streams: every stream goes on,
    and the gateway says so in a line, not N (each stream logged that Redis lost its events,
    and the same for a lost ``:live``: thousands of lines for thousands of streams, burying
    what else the loss did)."""
    server = private_redis["server"]
    start_worker("many", redis_at=server.url, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=server.url)
    body = {"model": "many", "prompt": "a story", "max_tokens": 80, "ignore_eos": True, "stream": True}
    streams = 12
    # Redis is flushed once every stream is past event 20. Flushed by the first to get there,
    # a stream that started later (a loaded CI run) met a registry without the worker: 503.
    all_past = threading.Barrier(streams, action=lambda: _lose(private_redis, "flushall"))

    def one(_: int) -> list:
        return _stream(gateway.url + "/v1/completions", body, {"Idempotency-Key": uuid.uuid4().hex},
                       lambda: all_past.wait(60), at=20)

    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(one, range(streams)))
    for events in results:
        assert not _errors(events), _errors(events)
        assert [i for i, _ in events if i is not None] == list(range(1, 81)) and events[-1][1] == "[DONE]"
    said = gateway.log_path.read_text().count("Redis lost events")
    assert 1 <= said <= 2, said  # a second line only past the 5 s window; before, one per stream


def test_a_resumable_stream_whose_generation_ends_while_redis_is_down_is_journaled_to_its_end(
        private_redis, start_worker, start_gateway) -> None:
    """Regression (nemesis seed 7, most of the resumable streams that were not exact): a
    generation that ended while Redis was down or stalled got three quick write attempts,
    then its producer gave up: its first client got "the stream's producer is gone", the
    journal never got its end, and every re-attach failed. The producer now retries its
    journal through the outage, and writes it again whole if Redis came back empty."""
    server = private_redis["server"]
    worker = start_worker("drain", redis_at=server.url, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=server.url)
    body = {"model": "drain", "prompt": "a story", "max_tokens": 100, "ignore_eos": True, "stream": True}
    reference = httpx.post(gateway.url + "/v1/completions", json={**body, "stream": False},
                           timeout=60).json()["choices"][0]["text"]
    key = uuid.uuid4().hex

    def served() -> int:
        return int(httpx.get(worker.url + "/health", timeout=5).json()["worker"]["served"])

    def down_past_the_end() -> None:
        before = served()
        server.stop()
        wait_for(lambda: served() > before, 30, "the generation to end on the worker")
        time.sleep(2)  # Redis stays down 2 s past the end: the old producer gave up in under one
        private_redis["server"] = EmbeddedRedis(port=server.port).start()  # empty: the journal is lost too

    events = _stream(gateway.url + "/v1/completions", body, {"Idempotency-Key": key}, down_past_the_end, at=30)
    assert not _errors(events), _errors(events)
    assert [i for i, _ in events if i is not None] == list(range(1, 101)) and events[-1][1] == "[DONE]"
    assert _text(events) == reference
    with httpx.stream("GET", f"{gateway.url}/v1/streams/{key}", headers={"Last-Event-ID": "5"}, timeout=30) as r:
        assert _events(r.iter_lines()) == events[5:]


def test_a_migration_while_redis_is_down_waits_for_it_instead_of_ending_the_stream(
        private_redis, start_worker, start_gateway) -> None:
    """Regression (full nemesis run: 82 streams ended "503 the stream could not continue"):
    a worker died while Redis was down; the migration's admission failed at once with the
    ConnectionError and the stream, admitted long before, ended there. It now waits for
    Redis (bounded) and goes on, token-exact."""
    server = private_redis["server"]
    model = "migrate-in-outage"
    first = start_worker(model, redis_at=server.url, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=server.url)
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        reference = client.completions.create(model=model, prompt="an outage", max_tokens=120, seed=3,
                                              extra_body={"ignore_eos": True}).choices[0].text
        text, cut = "", False
        for chunk in client.completions.create(model=model, prompt="an outage", max_tokens=120, seed=3, stream=True,
                                               extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text if chunk.choices else ""
            if not cut and len(text.split()) >= 20:
                cut = True
                start_worker(model, redis_at=server.url, sim_token_ms=20, sim_ttft_ms=0)  # where it can go
                server.stop()  # Redis is down: the migration cannot be admitted yet
                first.kill()
                time.sleep(2)
                private_redis["server"] = EmbeddedRedis(port=server.port).start()  # back, empty
    assert cut and text == reference


def test_a_re_attach_after_redis_lost_a_finished_stream_gets_the_rest(private_redis, start_worker,
                                                                        start_gateway) -> None:
    """Regression (nemesis seed 7): a client that came back after its stream had ended, with
    Redis's data lost meanwhile (FLUSHALL), got ``stream_history_lost``: its gateway now
    writes a finished journal back when the registry's epoch says Redis lost its data."""
    server = private_redis["server"]
    start_worker("finished", redis_at=server.url, sim_token_ms=5, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=server.url)
    body = {"model": "finished", "prompt": "a story", "max_tokens": 60, "ignore_eos": True, "stream": True}
    key = uuid.uuid4().hex
    events = _stream(gateway.url + "/v1/completions", body, {"Idempotency-Key": key})
    assert events[-1][1] == "[DONE]" and not _errors(events)
    _lose(private_redis, "flushall")
    with httpx.stream("GET", f"{gateway.url}/v1/streams/{key}", headers={"Last-Event-ID": "5"}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert _events(r.iter_lines()) == events[5:]


@pytest.mark.parametrize("loss", ["flushall", "restart"])
def test_a_retry_after_redis_lost_its_data_attaches_to_the_running_stream(private_redis, start_worker,
                                                                          start_gateway, loss: str) -> None:
    """Regression: Redis losing its data lost the Idempotency-Key's record while the
    producer went on: GET /v1/streams/{key} was 404 until the stream ended, and a retry
    with the key found no stream to follow. The producer restores the record with its
    next write; a re-attach and a retry during the stream both follow the one generation."""
    server = private_redis["server"]
    start_worker("restored", redis_at=server.url, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=server.url)
    body = {"model": "restored", "prompt": "a story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    key = uuid.uuid4().hex
    live = keys.journal_live(scoped("-", key))
    got: dict[str, object] = {}

    def follow(name: str, method: str, path: str) -> None:
        with httpx.stream(method, gateway.url + path, json=body if method == "POST" else None, timeout=60,
                          headers={"Idempotency-Key": key, "Last-Event-ID": "150"}) as r:
            got[name] = (r.status_code, _events(r.iter_lines()))

    followers = [threading.Thread(target=follow, args=("reattach", "GET", f"/v1/streams/{key}")),
                 threading.Thread(target=follow, args=("retry", "POST", "/v1/completions"))]

    def lose_then_follow() -> None:
        with redis.Redis.from_url(_lose(private_redis, loss).url) as client:
            wait_for(lambda: client.exists(live) == 1, 10, "the producer to write on")
        for follower in followers:
            follower.start()

    events = _stream(gateway.url + "/v1/completions", body, {"Idempotency-Key": key}, lose_then_follow, at=30)
    for follower in followers:
        follower.join(60)
    assert [i for i, _ in events if i is not None] == list(range(1, 201)) and not _errors(events)
    assert got["reattach"] == (200, events[150:])
    assert got["retry"] == (200, events[150:])  # the same events: no second generation


def test_a_resumable_request_whose_history_cannot_fit_is_refused_up_front(stack) -> None:
    """Regression: n x max_tokens past the journal's 20,000 events was accepted and the
    journal trimmed silently; now such a request is refused before any work."""
    body = {"model": "sim", "prompt": "x", "n": 16, "max_tokens": 32_768, "stream": True}
    r = httpx.post(stack.url + "/v1/completions", json=body, headers={"Idempotency-Key": uuid.uuid4().hex},
                   timeout=30)
    assert r.status_code == 400, r.text[:200]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == ("stream_too_long", "max_tokens")
    assert "Idempotency-Key" in error["message"]


def _create_key(redis_url: str) -> str:
    result = subprocess.run([sys.executable, "-m", "sluice", "keys", "create", "--name", "journal",
                             "--redis-url", redis_url], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.timeout(300)
def test_one_api_key_cannot_fill_redis_with_journals(private_redis, start_worker, start_gateway) -> None:
    """Regression: journals were bounded by nothing but a 20,000-event trim and kept an
    hour, so one tenant could run the Redis all admission shares out of memory."""
    server = private_redis["server"]
    start_worker("quota", redis_at=server.url, sim_token_ms=0, sim_ttft_ms=0)
    # The keys first: a gateway that starts with keys enforces them at once.
    greedy, other = _create_key(server.url), _create_key(server.url)
    gateway = start_gateway(redis_at=server.url, env={"SLUICE_GATEWAY_JOURNAL_TENANT_MAX_BYTES": str(1 << 20)})
    url = gateway.url + "/v1/completions"
    body = {"model": "quota", "prompt": "p", "max_tokens": 30_000, "ignore_eos": True, "stream": True}

    def as_(key: str, idem: bool = True) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}", **({"Idempotency-Key": uuid.uuid4().hex} if idem else {})}

    # A stream that outgrows its key's bound ends with the error, in-band.
    events = _stream(url, body, as_(greedy))
    assert events[-1][1] == "[DONE]"
    assert [orjson.loads(e)["error"]["code"] for e in _errors(events)] == ["journal_memory_exceeded"]
    assert 5_000 < len(events) < 30_000
    with redis.Redis.from_url(server.url) as client:
        held = int(client.get(keys.JOURNAL_QUOTA.total))
        assert held <= 1 << 20
        assert int(client.hget(keys.JOURNAL_QUOTA.tenants, greedy.split("-")[2])) == held
    # Its next resumable request: 429 in OpenAI's shape, before any work.
    refused = httpx.post(url, json={**body, "max_tokens": 5}, headers=as_(greedy), timeout=30)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "journal_memory_exceeded"
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert int(refused.headers["retry-after"]) >= 1
    # The key's plain streams, and other keys' resumable ones, are served.
    short = {**body, "max_tokens": 5}
    assert _stream(url, short, as_(greedy, idem=False))[-1][1] == "[DONE]"
    assert not _errors(_stream(url, short, as_(other)))


def test_a_journal_event_costs_under_100_bytes_of_redis(start_worker, start_gateway, redis_client) -> None:
    """A chat stream's journal keeps each chunk without the head every chunk repeats (id,
    created, model) and its token ids in a compact form: it was ~223 B per event."""
    start_worker("journal-bytes", sim_token_ms=0, sim_ttft_ms=0)
    gateway = start_gateway()
    key = uuid.uuid4().hex
    body = {"model": "journal-bytes", "messages": [{"role": "user", "content": "long"}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    events = _stream(gateway.url + "/v1/chat/completions", body, {"Idempotency-Key": key})
    assert len(events) == 4001
    journal = keys.journal(scoped("-", key))
    per_event = redis_client.memory_usage(journal, samples=0) / redis_client.xlen(journal)
    print(f"journal bytes per event: {per_event:.1f}")
    assert per_event < 100
    assert redis_client.exists(keys.journal_plan(scoped("-", key))) == 0  # a finished stream needs none
    assert redis_client.pttl(journal) <= 600_000  # kept journal_done_ttl_s once finished, not an hour


async def test_a_stream_that_ends_while_redis_is_away_is_journaled_to_its_end(private_redis) -> None:
    """Regression: after its generation ended, a producer tried to write the journal's last
    events three times, a few milliseconds apart, then gave up: a resumable stream whose
    generation ended while Redis was restarting or failing over (a Sentinel or Cluster
    promotion takes 1-3 s) ended with "the stream's producer is gone" for its first client.
    It keeps trying for as long as a failover takes."""
    server = private_redis["server"]
    client = await create_pool(server.url)
    committer, idem = JournalCommitter(client), Idempotency(client, ttl_s=60)
    readers = JournalReaders(client, poll_s=0.01, idle_s=0.2)
    back: list[asyncio.Task[None]] = []

    async def restart_in(seconds: float) -> None:
        await asyncio.sleep(seconds)  # the outage: the server is away this long
        await asyncio.to_thread(server.start)

    async def events():
        for i in range(1, 6):
            yield b"data: %d\n\n" % i
        await asyncio.to_thread(server.shutdown, save=True)  # Redis goes away as the generation ends
        back.append(asyncio.create_task(restart_in(1.0)))
        yield DONE

    try:
        _, first, producer = await _first_client(committer, idem, readers, events(), claim_s=10)
        got = [event async for event in first.events()]
        await producer
        assert got == [frame(i, b"data: %d\n\n" % i, tag_of("p")) for i in range(1, 6)] + [DONE]
    finally:
        await asyncio.gather(*back)
        await readers.close()
        await idem.close()
        await committer.close()
        await client.aclose()


async def test_a_first_client_whose_producer_gave_up_on_redis_goes_on_from_the_journal(
        private_redis, monkeypatch) -> None:
    """Regression (the nemesis, Cluster, nem-1647): Redis stayed away past ``DRAIN_S`` as the
    generation ended (a failover that left the stream's slot down 31 s); the producer gave up
    on its last events and its first client read "the stream's producer is gone; the rest is
    lost". The journal keeps its plan and its first events: the first client now goes on from
    it, where a take-over continues the stream from what the client holds."""
    monkeypatch.setattr(journal_module, "DRAIN_S", 0.5)
    server = private_redis["server"]
    client = await create_pool(server.url)
    committer, idem = JournalCommitter(client), Idempotency(client, ttl_s=60)
    readers = JournalReaders(client, poll_s=0.01, idle_s=0.2)
    adopted = _recorded_take_overs(readers)

    async def events():
        for i in range(1, 6):
            yield b"data: %d\n\n" % i
        await asyncio.sleep(0.3)  # written
        await asyncio.to_thread(server.shutdown, save=True)  # away past the drain, its data kept
        yield b"data: 6\n\n"
        yield DONE

    try:
        key, first, producer = await _first_client(committer, idem, readers, events(), claim_s=30)
        got: list[bytes] = []

        async def read() -> None:
            async for event in first.events():
                got.append(event)

        reading = asyncio.create_task(read())
        await producer  # gave up on event 6 and [DONE]
        await asyncio.to_thread(server.start)
        await asyncio.wait_for(_until(lambda: adopted == [key]), 15)  # a take-over from the journal
        assert got == [frame(i, b"data: %d\n\n" % i, tag_of("p")) for i in range(1, 6)]
        assert producer_gone() not in got
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
    finally:
        await readers.close()
        await idem.close()
        await committer.close()
        await client.aclose()


async def _first_client(committer: JournalCommitter, idem: Idempotency, readers: JournalReaders, events,
                        claim_s: float):
    """A resumable stream of ``events`` (producer ``p``), claimed for ``claim_s``, and its first
    client's reader: (key, reader, producer task)."""
    key = uuid.uuid4().hex
    assert await idem.claim(key, "fp", True, time.monotonic() + claim_s, "p") is None
    assert await idem.promote(key, "p", "fp", 10, b"{}")
    writer = JournalWriter(committer, key, ttl_s=60, owner="p")
    first = writer.subscribe(readers.tail)

    async def nothing() -> None:
        return None

    return key, first, await start_producer(writer, events, nothing)


async def _until(check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0.05)


def _recorded_take_overs(readers: JournalReaders) -> list[str]:
    """The streams ``readers`` would take over, recorded instead of taken."""
    adopted: list[str] = []

    async def adopt(key: str, last_id: str) -> bool:
        adopted.append(key)
        return True

    readers.adopt = adopt
    return adopted


async def _quiet_stream(client, committer: JournalCommitter, readers: JournalReaders, idem: Idempotency,
                        resume: asyncio.Event):
    """A resumable stream that sends 3 events, then waits for ``resume``; a reader follows it
    after event 1. Returns (producer task, the reader's events task)."""
    key = uuid.uuid4().hex
    assert await idem.claim(key, "fp", True, time.monotonic() + 30, "p") is None
    assert await idem.promote(key, "p", "fp", 10, b"{}")
    writer = JournalWriter(committer, key, ttl_s=60, owner="p")

    async def events():
        for i in range(1, 4):
            yield b"data: %d\n\n" % i
        await resume.wait()
        yield DONE

    async def nothing() -> None:
        return None

    first = writer.subscribe(readers.tail)
    producer = await start_producer(writer, events(), nothing)
    follower = asyncio.create_task(_collect(readers.tail(key, after=1)))
    consumer = asyncio.create_task(_collect(first.events()))
    return key, producer, follower, consumer


async def _collect(events) -> list[bytes]:
    return [event async for event in events]


async def test_a_reader_never_takes_over_a_stream_its_own_process_produces(private_redis) -> None:
    """Regression (nemesis, Sentinel: one gap): Redis lost a stream's ``:live`` (it expired
    during a stall) while its producer, in the same gateway process, was still writing; a
    reader of that process saw ``:live`` gone and took the stream over from a journal that
    lacked events the first client already had, and that client got a gap."""
    client = await create_pool(private_redis["server"].url)
    committer, idem = JournalCommitter(client), Idempotency(client, ttl_s=60)
    readers = JournalReaders(client, poll_s=0.01, idle_s=0.05)
    adopted = _recorded_take_overs(readers)
    readers.producing = committer.produces
    resume = asyncio.Event()
    try:
        key, producer, follower, consumer = await _quiet_stream(client, committer, readers, idem, resume)
        await asyncio.sleep(0.2)  # the reader is caught up and quiet
        for _ in range(20):  # Redis forgets :live, again and again, faster than the producer refreshes it
            await client.delete(keys.journal_live(key))
            await asyncio.sleep(0.02)
        resume.set()
        await producer
        assert await follower == [frame(2, b"data: 2\n\n", tag_of("p")), frame(3, b"data: 3\n\n", tag_of("p")), DONE]
        assert adopted == []
        await consumer
    finally:
        await readers.close()
        await idem.close()
        await committer.close()
        await client.aclose()


async def test_a_redis_stall_past_live_ttl_is_not_a_dead_producer(private_redis) -> None:
    """Regression (nemesis, Sentinel): Redis stalled past ``:live``'s TTL, so every stream's
    ``:live`` had expired when it answered again, and readers took over streams whose
    producers (in other gateways) were alive and about to re-claim them. A poll that Redis
    held up restarts the readers' quiet clock: producers get ``idle_s`` to re-claim first."""
    client = await create_pool(private_redis["server"].url)
    # idle_s 1.5 (0.3 left 0.2 s for the test's own re-claim below: a loaded machine's pause)
    readers = JournalReaders(client, poll_s=0.01, idle_s=1.5)
    adopted = _recorded_take_overs(readers)
    key = uuid.uuid4().hex
    for number in (1, 2, 3):  # a producer elsewhere wrote three events, and lives
        await client.xadd(keys.journal(key), {"d": b"data: %d\n\n" % number, "s": b""}, id=f"0-{number}")
    await client.set(keys.journal_live(key), "elsewhere", px=3000)
    try:
        follower = asyncio.create_task(_collect(readers.tail(key, after=1)))
        await asyncio.sleep(0.1)  # events 2 and 3 delivered; the reader is quiet
        await client.delete(keys.journal_live(key))  # it expires during the stall
        await client.execute_command("DEBUG", "SLEEP", "2.5")  # Redis stalls, past the reader's idle_s
        await asyncio.sleep(0.1)  # the producer's next write, a retry period later (journal.py)
        await client.set(keys.journal_live(key), "elsewhere", px=3000)  # re-claims the stream
        await asyncio.sleep(3.0)  # two idle periods: a dead producer would be taken over by now
        assert adopted == []
        await client.xadd(keys.journal(key), {"d": DONE, "s": b""}, id="0-4")
        assert await follower == [b"id: 2\ndata: 2\n\n", b"id: 3\ndata: 3\n\n", DONE]
    finally:
        await readers.close()
        await client.aclose()


async def test_a_finished_journal_on_a_cluster_node_that_lost_its_data_is_written_back() -> None:
    """Regression (nemesis, Cluster: finished streams regenerated and billed twice): the
    keeper watched only the registry's epoch on a Cluster, which lives on one node; a node
    that came back empty (a restart without persistence, a failover to a replica without
    the last writes) lost the finished journals in its slots, and nothing wrote them back."""
    cluster = EmbeddedCluster().start()
    client = await create_pool(cluster.url)
    keeper = JournalKeeper(client, check_s=0.1)
    try:
        await client.hset(keys.EPOCH, "id", "epoch-1")
        epoch_node = client.get_node_from_key(keys.EPOCH).port
        scope = next(s for s in (uuid.uuid4().hex for _ in range(1000))
                     if client.get_node_from_key(keys.journal(s)).port != epoch_node)
        history = JournalHistory()
        for number in (1, 2, 3):
            stored = b"data: %d\n\n" % number if number < 3 else DONE
            history.add(stored, b"")
            await client.xadd(keys.journal(scope), {"d": stored, "s": b""}, id=f"0-{number}")
        keeper.keep(Finished(scope, "p", "fp", b"", history, 60_000, None, 0))
        looked = time.monotonic() + 10
        while keeper._watch.seen_epoch != "epoch-1":  # the keeper has looked once (polled: a loaded machine)
            assert time.monotonic() < looked, "the keeper's first look"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        node = next(s for s in cluster.servers if s.port == client.get_node_from_key(keys.journal(scope)).port)
        await asyncio.to_thread(node.shutdown, save=False)
        await asyncio.to_thread(node.start)  # back empty, with its slots (nodes.conf)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                if await client.xlen(keys.journal(scope)) == 3:
                    break
            await asyncio.sleep(0.1)
        assert [f[b"d"] for _, f in await client.xrange(keys.journal(scope))] == [
            b"data: 1\n\n", b"data: 2\n\n", DONE]
    finally:
        await keeper.close()
        await client.aclose()
        cluster.stop()


def _head(chunk_id: str) -> bytes:
    return b'data: {"id":"' + chunk_id.encode() + b'","object":"chat.completion.chunk","created":1,"model":"sim"'


async def _replace_generation(client, key: str, head: bytes, events: int) -> None:
    """Redis lost the stream and now holds another generation of it (a re-sent request's,
    or older data a failover brought back), produced by another gateway."""
    await client.delete(keys.journal(key), keys.journal_head(key), keys.journal_live(key))
    for number in range(1, events + 1):
        await client.xadd(keys.journal(key), {"d": b',"n":%d}\n\n' % number, "s": b""}, id=f"0-{number}")
    await client.set(keys.journal_head(key), head, px=60_000)
    await client.set(keys.journal_live(key), "elsewhere", px=60_000)


async def test_a_first_client_whose_producer_lost_the_journal_to_another_generation_gets_no_splice(
        private_redis) -> None:
    """Regression (nemesis, Sentinel: two splices): a re-sent request started a second
    generation after Redis lost the first one's record; a failover brought the first one's
    journal back, the second producer lost the stream to it and its first client went on
    from the journal: events 1..k of one generation, then k+1.. of the other (two chunk
    ids). The client now gets ``stream_history_lost`` after its k events."""
    client = await create_pool(private_redis["server"].url)
    committer, idem = JournalCommitter(client), Idempotency(client, ttl_s=60)
    readers = JournalReaders(client, poll_s=0.01, idle_s=0.2)
    ours, theirs = _head("chatcmpl-ours"), _head("chatcmpl-theirs")
    resume = asyncio.Event()
    key = uuid.uuid4().hex

    async def events():
        for i in range(1, 4):
            yield ours + b',"n":%d}\n\n' % i
        await resume.wait()
        yield ours + b',"n":4}\n\n'
        yield DONE

    async def nothing() -> None:
        return None

    try:
        assert await idem.claim(key, "fp", True, time.monotonic() + 30, "p") is None
        writer = JournalWriter(committer, key, ttl_s=60, owner="p", head=ours)
        first = writer.subscribe(readers.tail)
        producer = await start_producer(writer, events(), nothing)
        consumer = asyncio.create_task(_collect(first.events()))
        for _ in range(500):  # the first three events journaled
            if await client.xlen(keys.journal(key)) == 3:
                break
            await asyncio.sleep(0.01)
        await _replace_generation(client, key, theirs, events=8)
        resume.set()
        got = await asyncio.wait_for(consumer, 10)
        await asyncio.gather(producer, return_exceptions=True)
        assert got[:3] == [frame(i, ours + b',"n":%d}\n\n' % i, tag_of("p")) for i in range(1, 4)]
        assert all(theirs not in event for event in got), got
        assert b"stream_history_lost" in got[3] and got[4:] == [DONE], got
    finally:
        await readers.close()
        await idem.close()
        await committer.close()
        await client.aclose()


async def test_a_reattached_reader_never_goes_on_with_another_generation(private_redis) -> None:
    """The same splice for a client that re-attached: it follows the generation its first
    events came with, and a journal that now holds another one ends it with the error."""
    client = await create_pool(private_redis["server"].url)
    readers = JournalReaders(client, poll_s=0.01, idle_s=5.0)
    ours, theirs = _head("chatcmpl-ours"), _head("chatcmpl-theirs")
    key = uuid.uuid4().hex
    await _replace_generation(client, key, ours, events=3)
    try:
        follower = asyncio.create_task(_collect(readers.tail(key, after=1)))
        await asyncio.sleep(0.2)  # events 2 and 3 delivered
        await _replace_generation(client, key, theirs, events=8)
        got = await asyncio.wait_for(follower, 10)
        assert got[:2] == [b"id: %d\n" % i + ours + b',"n":%d}\n\n' % i for i in (2, 3)]
        assert all(theirs not in event for event in got), got
        assert b"stream_history_lost" in got[2] and got[3:] == [DONE], got
    finally:
        await readers.close()
        await client.aclose()


async def test_a_finished_journal_whose_end_a_failover_lost_is_written_back_over_its_own_stale_live(
        private_redis) -> None:
    """Regression (nemesis, Sentinel: billed twice): a failover to a replica that lacked a
    finished stream's last writes brought back events 1..21 of 34 and the producer's
    ``:live``, whose release was among the lost writes. The keeper saw the failover but did
    not write the journal back (``:live`` was held), the stale claim expired, a reader took
    the stream over and generated (and billed) its tail a second time. The producer's own
    ``:live`` no longer stops the write-back."""
    client = await create_pool(private_redis["server"].url)
    keeper = JournalKeeper(client, check_s=60)
    scope = uuid.uuid4().hex
    try:
        history = JournalHistory()
        for number in range(1, 35):
            history.add(b"data: %d\n\n" % number if number < 34 else DONE, b"")
        await client.hset(keys.EPOCH, "id", "epoch-1")  # the keeper's first look finds nothing lost
        keeper.keep(Finished(scope, "producer", "fp", b"", history, 60_000, None, 0))
        await asyncio.sleep(0.2)
        await _truncate(client, scope, 21)  # what the promoted replica had
        await client.set(keys.journal_live(scope), "producer", px=3000)
        await client.hset(keys.idempotency(scope), mapping={"fp": "fp", "stream": "1", "state": "streaming",
                                                            "owner": "producer"})
        await keeper.restore_all()
        assert await client.xlen(keys.journal(scope)) == 34
        assert not await client.exists(keys.journal_live(scope))  # nobody produces it: readers read its end
        assert await client.hget(keys.idempotency(scope), "state") == b"done"
        await client.set(keys.journal_live(scope), "a-taker", px=3000)  # another gateway's claim is respected
        await _truncate(client, scope, 21)
        await keeper.restore_all()
        assert await client.xlen(keys.journal(scope)) == 21
    finally:
        await keeper.close()
        await client.aclose()


async def test_a_keeper_writes_its_finished_journals_back_side_by_side_within_write_back_s(
        private_redis) -> None:
    """Regression (nemesis, Cluster, 6ec4b61: nem-1291 billed twice): a gateway wrote its
    kept journals back one at a time, about 0.3 s each while a failover settled, and reached
    nem-1291's 28 s after it saw the loss; 18 s before that, the client's re-sent POST had
    waited its 10 s for a producer, found none, and generated the stream again. With 40 kept
    journals and a 0.1 s round trip to Redis, all are back within ``WRITE_BACK_S``."""
    proxy = await LinkProxy(private_redis["server"].port).start()
    client = await create_pool(f"redis://127.0.0.1:{proxy.port}/0")
    keeper = JournalKeeper(client, check_s=60)
    scopes = [uuid.uuid4().hex for _ in range(40)]
    try:
        await client.hset(keys.EPOCH, "id", "epoch-1")  # the keeper's first look finds nothing lost
        for scope in scopes:
            history = JournalHistory()
            for stored in (b"data: 1\n\n", b"data: 2\n\n", DONE):
                history.add(stored, b"")
            keeper.keep(Finished(scope, "p", "fp", b"", history, 60_000, None, 0))
        await asyncio.sleep(0.2)
        proxy.delay(0.05)  # each way
        started = time.monotonic()
        await keeper.restore_all()
        took_s = time.monotonic() - started
        proxy.heal()
        assert [await client.xlen(keys.journal(scope)) for scope in scopes] == [3] * len(scopes)
        assert took_s < WRITE_BACK_S, f"40 journals back in {took_s:.1f} s"
    finally:
        await keeper.close()
        await client.aclose()
        await proxy.close()


async def _truncate(client, scope: str, events: int) -> None:
    await client.delete(keys.journal(scope))
    for number in range(1, events + 1):
        await client.xadd(keys.journal(scope), {"d": b"data: %d\n\n" % number, "s": b""}, id=f"0-{number}")


async def test_a_stream_is_settled_before_its_producer_lets_go_of_it(private_redis) -> None:
    """Regression (nemesis, Cluster: streams served whole and never billed): the bill (the
    access-log line) waited for the producer's clean-up round trips after its ``[DONE]``
    (releasing ``:live``, settling its memory reservation); a failing-over Cluster held
    those up for seconds and a gateway killed then never logged what it had served. The
    journal's fate is known, and the stream billed, before them."""
    client = await create_pool(private_redis["server"].url)
    committer = JournalCommitter(client)
    held = asyncio.Event()

    async def release_held(key: str, owner: str) -> bool:  # Redis holds the clean-up up
        await held.wait()
        return True

    committer.release = release_held  # type: ignore[method-assign]

    async def events():
        yield b"data: 1\n\n"
        yield DONE

    async def nothing() -> None:
        return None

    try:
        writer = JournalWriter(committer, uuid.uuid4().hex, ttl_s=60, owner="p")
        producer = await start_producer(writer, events(), nothing)
        await asyncio.wait_for(writer.settled(), 5)
        assert writer.ended and not producer.done()
        held.set()
        await producer
    finally:
        held.set()
        await committer.close()
        await client.aclose()


@pytest.mark.parametrize("record_owner", ["me", "taker", None])
async def test_a_batch_whose_reply_was_lost_is_the_producers_own_only_while_the_record_names_it(
        private_redis, record_owner) -> None:
    """Regression (nemesis, Sentinel nem-4986: served 54 tokens, billed 0): a producer's
    batch reached Redis, its reply did not, and ``:live`` expired meanwhile; the retry found
    events from its first on and took them for a take-over's, so the producer stopped and
    billed nothing. The record's owner tells: a take-over makes itself the owner (TAKE); a
    record Redis lost says nothing, and the batch stays lost (a take-over may have run)."""
    client = await create_pool(private_redis["server"].url)
    append = client.register_script(APPEND)
    scope = uuid.uuid4().hex
    try:
        await _truncate(client, scope, 3)  # events 1..3: the batch 2..3 reached Redis
        if record_owner is not None:
            await client.hset(keys.idempotency(scope), mapping={"fp": "f", "stream": "1", "state": "streaming",
                                                                "owner": record_owner})
        names = [keys.journal(scope), keys.journal_live(scope), keys.journal_head(scope), keys.journal_plan(scope),
                 keys.idempotency(scope)]
        args = ["me", 60_000, 3000, 2, b"", "0", "f", b"", 2**53, 0, ""]  # the retry: 2..3, then 4
        for number in (2, 3, 4):
            args += [b"data: %d\n\n" % number, b""]
        status, last = await append(keys=names, args=args)
        assert last == 3
        if record_owner == "me":
            assert status == 2  # written: it goes on, and bills what it served
            assert await client.xlen(keys.journal(scope)) == 4
            assert await client.get(keys.journal_live(scope)) == b"me"
        else:
            assert status == 0  # another generation's, or unknown: lost, nothing written
            assert await client.xlen(keys.journal(scope)) == 3
    finally:
        await client.aclose()


async def test_a_finished_stream_whose_record_alone_redis_lost_gets_it_back_done(private_redis) -> None:
    """Regression (nemesis, Cluster: 11 streams billed twice): Redis lost a stream's record
    (not its journal) just before its producer settled it; the settle changed nothing, and
    the keeper wrote records back only with a lost journal, at the next loss it saw. A
    re-sent request then found the key free and ran it again. The producer now has the
    record written back ``done`` at once; a record another attempt owns is left alone."""
    client = await create_pool(private_redis["server"].url)
    keeper = JournalKeeper(client)
    try:
        scopes = {}
        for name in ("lost", "others"):
            scope = scopes[name] = uuid.uuid4().hex
            history = JournalHistory()
            for stored in (b"data: 1\n\n", b"data: 2\n\n", DONE):
                history.add(stored, b"")
                await client.xadd(keys.journal(scope), {"d": stored, "s": b""}, id=f"0-{len(history)}")
            keeper.keep(Finished(scope, "p", "fp", b"", history, 60_000, None, 0))
        await client.hset(keys.idempotency(scopes["others"]), mapping={"fp": "fp2", "state": "pending", "owner": "q"})
        for scope in scopes.values():
            await keeper.restore(scope)
        record = await client.hgetall(keys.idempotency(scopes["lost"]))
        assert record[b"state"] == b"done" and record[b"fp"] == b"fp" and record[b"owner"] == b"p"
        assert await client.pttl(keys.idempotency(scopes["lost"])) > 0
        assert await client.xlen(keys.journal(scopes["lost"])) == 3  # nothing written twice
        assert (await client.hgetall(keys.idempotency(scopes["others"])))[b"owner"] == b"q"
    finally:
        await keeper.close()
        await client.aclose()


async def _read_one_journal(server, after_first: Callable[[str], None], timeout_s: float,
                            poll_timeout_s: float = 2.0) -> list[bytes]:
    """What one journal reader gets of a journal holding event 1: ``after_first(key)`` runs
    once it has that event (a fault, more events), and the read ends within ``timeout_s``.
    ``poll_timeout_s``: 2 s where no error is expected (a loaded machine's pause with a poll
    outstanding must not end the reader), short where the test waits for it."""
    client = await create_pool(server.url)
    readers = JournalReaders(client, poll_s=0.01, idle_s=5, poll_timeout_s=poll_timeout_s)
    key = uuid.uuid4().hex
    got: list[bytes] = []
    try:
        await client.xadd(keys.journal(key), {"d": b"data: 1\n\n", "s": b""}, id="0-1")

        async def follow() -> None:
            async for data in readers.tail(key):
                got.append(data)
                if len(got) == 1:
                    after_first(key)

        await asyncio.wait_for(follow(), timeout_s)
        return got
    finally:
        await readers.close()
        await client.aclose()


async def test_a_reader_whose_poll_redis_never_answers_ends_with_an_error_not_a_hang(private_redis) -> None:
    """Regression (nemesis, Cluster: 9 requests with no outcome 20 s past their deadline):
    Redis accepted the journal readers' poll and never answered (a stalled node; on a
    Cluster, one slow topology refresh held every command of the process), and the readers
    waited with it. A poll that has no answer within ``poll_timeout_s`` ends its readers with
    the in-band "re-attach" error, then ``[DONE]``, well before the socket's own timeout."""
    server = private_redis["server"]
    try:  # the next poll is never answered; the socket's own timeout is 5 s
        got = await _read_one_journal(server, lambda _: os.kill(server.process.pid, signal.SIGSTOP), 3,
                                      poll_timeout_s=0.5)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert got[0] == b"id: 1\ndata: 1\n\n" and got[-1] == DONE
    assert b"re-attach" in got[-2] and b"service_unavailable" in got[-2]


async def test_a_reader_reads_on_across_seconds_without_redis(private_redis) -> None:
    """Regression (the nemesis, Sentinel, seed 11: nem-250's readers ended three times with
    "the stream's journal could not be read" while Sentinel named no master, each a round
    trip for its client): polls that fail at once are tried again as long as a poll without
    an answer is waited for, so Redis away for 4 s (a failover's length) and back ends no reader."""
    server = private_redis["server"]

    def away_for_a_while(key: str) -> None:
        server.shutdown(save=True)  # every poll now fails at once (connection refused)

        def back() -> None:
            server.start()
            with server.admin() as admin:
                admin.xadd(keys.journal(key), {"d": b"data: [DONE]\n\n", "s": b""}, id="0-2")
        threading.Timer(4.0, back).start()

    got = await _read_one_journal(server, away_for_a_while, 20)
    assert not any(b"re-attach" in data for data in got), got
    assert got[0] == b"id: 1\ndata: 1\n\n" and got[-1].endswith(DONE), got


async def test_a_reader_whose_redis_connection_was_closed_reads_on(private_redis) -> None:
    """Regression (make test, four processes): a re-attach just after a Redis restart ended
    with "the stream's journal could not be read" on its first poll's stale connection. A
    poll that fails at once is tried again (``READ_RETRY_S``) on a fresh connection."""
    server = private_redis["server"]

    def close_every_connection_then_end(key: str) -> None:
        with server.admin() as admin:
            admin.client_kill_filter(_type="normal", skipme=True)  # every pooled connection
            admin.xadd(keys.journal(key), {"d": b"data: [DONE]\n\n", "s": b""}, id="0-2")

    got = await _read_one_journal(server, close_every_connection_then_end, 10)
    assert not any(b"re-attach" in data for data in got), got
    assert got[0] == b"id: 1\ndata: 1\n\n" and got[-1].endswith(DONE), got


async def test_a_keeper_holds_at_most_its_bytes_dropping_the_oldest_copies_first(private_redis, caplog) -> None:
    """What one process keeps of finished journals is bounded by ``keep_bytes`` (the quota
    bounds the fleet's journals, so up to 2 GiB of them could end on one gateway within a
    minute): past it the oldest copies go first, a copy larger than the bound alone is not
    kept, and a loss of Redis's data afterwards writes back exactly what is still kept."""
    client = await create_pool(private_redis["server"].url)

    def finished(scope: str, events: int) -> Finished:
        history = JournalHistory()
        for number in range(1, events):
            history.add(b"data: %d\n\n" % number, b"0|%d|1" % number)
        history.add(DONE, b"")
        return Finished(scope, "p", "fp", b"", history, 60_000, None, 0)

    one = finished("x", 3).history.nbytes
    keeper = JournalKeeper(client, check_s=60, keep_bytes=2 * one + one // 2)
    try:
        await client.hset(keys.EPOCH, "id", "epoch-1")  # the keeper's first look finds nothing lost
        a, b, c, big = uuid.uuid4().hex, uuid.uuid4().hex, uuid.uuid4().hex, uuid.uuid4().hex
        with caplog.at_level("WARNING", logger="sluice.journal"):
            for scope in (a, b):
                keeper.keep(finished(scope, 3))
            assert (keeper.bytes, keeper.dropped) == (2 * one, 0)
            keeper.keep(finished(c, 3))  # a, the oldest, goes
            assert (keeper.bytes, keeper.dropped) == (2 * one, 1)
            keeper.keep(finished(big, 400))  # alone over the bound: b and c stay
            assert (keeper.bytes, keeper.dropped) == (2 * one, 2)
        reports = [r.getMessage() for r in caplog.records if "journal_keep_max_bytes" in r.getMessage()]
        assert len(reports) == 1 and "1 dropped early" in reports[0], reports  # once a minute at most
        await asyncio.sleep(0.2)
        await client.flushall()  # Redis lost its data
        await keeper.restore_all()
        assert [await client.xlen(keys.journal(scope)) for scope in (a, b, c, big)] == [0, 3, 3, 0]
        assert keeper.restored == 2
    finally:
        await keeper.close()
        await client.aclose()
