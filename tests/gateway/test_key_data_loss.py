"""Redis loses its data (FLUSHALL here; a restart without persistence or a failover that
lost writes does the same to the keys): the API keys gateways verified come back with no
operator action, a revoked key stays revoked, and no gateway starts serving openly.

Against private Redis servers: keys in the shared one would switch every other test's
gateway to authenticated mode."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
import redis.asyncio

from gateway.admission.key_keeper import KeyKeeper
from sluice import keys
from sluice.apikeys import KeyStore, digest, save_records
from sluice.errors import AuthenticationFailed, Unavailable
from sluice.embedded_redis import EmbeddedCluster, EmbeddedRedis, free_port
from sluice.redis_pool import create_pool
from sluice.redis_url import sync_client
from tests.conftest import Proc, _env, wait_for

MODEL = "keyloss"


def _create(url: str, name: str) -> tuple[str, str]:
    """A new key and its prefix, made as ``sluice keys create`` makes it."""
    async def create() -> tuple[str, str]:
        client = await create_pool(url)
        try:
            key, record = await KeyStore(client).create(name)
        finally:
            await client.aclose()
        return key, record.prefix
    return asyncio.run(create())


def _revoke(url: str, prefix: str) -> None:
    async def revoke() -> None:
        client = redis.asyncio.Redis.from_url(url)
        try:
            assert await KeyStore(client).revoke(prefix)
        finally:
            await client.aclose()
    asyncio.run(revoke())


def _sdk(gateway: Proc, key: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=retries)


def _complete(gateway: Proc, key: str, retries: int = 5) -> str:
    with _sdk(gateway, key, retries) as client:
        return client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text


def _list_models(gateway: Proc, key: str) -> None:
    """A call that needs the key and nothing else (no registry): 401 or 200."""
    with _sdk(gateway, key) as client:
        client.models.list()


def _up(gateway: Proc) -> bool:
    try:
        return httpx.get(gateway.url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class Lossy:
    """A Redis of this module's own, and a client to make it lose its data."""

    def __init__(self, server: EmbeddedRedis) -> None:
        self.url, self.client = server.url, redis.Redis.from_url(server.url)


@pytest.fixture(scope="module")
def lossy() -> Iterator[Lossy]:
    with EmbeddedRedis() as server:
        lossy = Lossy(server)
        yield lossy
        lossy.client.close()


@pytest.fixture(scope="module")
def gateways(lossy, start_worker, start_gateway) -> tuple[Proc, Proc]:
    """Two gateways in the default ``auth=auto``, started once keys exist."""
    start_worker(MODEL, redis_at=lossy.url, sim_token_ms=0, sim_ttft_ms=0)
    _create(lossy.url, "first")
    return start_gateway(redis_at=lossy.url), start_gateway(redis_at=lossy.url)


def test_a_key_verified_before_redis_lost_its_data_works_right_after(lossy, gateways) -> None:
    """Regression: after FLUSHALL every key was 401 (invalid_api_key) until an operator made
    the keys again (195 such requests in the Cluster nemesis run)."""
    first, _ = gateways
    key, _ = _create(lossy.url, "verified")
    assert _complete(first, key)
    lossy.client.flushall()
    _list_models(first, key)  # at once, no retry: this gateway writes the record back
    assert _complete(first, key)


def test_a_key_works_after_a_loss_on_a_gateway_that_never_saw_it(lossy, gateways) -> None:
    """Regression: a gateway that had never verified the key had nothing to fall back on
    either: 401 until an operator made the keys again. And a gateway in auth=auto started
    while keys existed, but asked nothing before the loss, served everyone openly after it."""
    first, second = gateways
    key, prefix = _create(lossy.url, "elsewhere")
    assert _complete(first, key)
    lossy.client.flushall()
    assert httpx.get(second.url + "/v1/models").status_code == 401  # no key: not served
    # 503 + Retry-After (the SDK retries) until the first gateway wrote the key back: never 401.
    assert _complete(second, key)
    assert lossy.client.sismember(keys.API_KEYS, prefix)  # `sluice keys list` shows it again


def test_a_key_revoked_before_redis_lost_its_data_stays_revoked(lossy, gateways) -> None:
    """Regression: a revoked key that gateways still kept a copy of came back valid when its
    copy was written back; and, before copies were written back at all, the key that was not
    revoked stayed 401 after the loss."""
    first, second = gateways
    kept, _ = _create(lossy.url, "kept")
    doomed, prefix = _create(lossy.url, "doomed")
    for gateway in gateways:
        assert _complete(gateway, kept) and _complete(gateway, doomed)
    _revoke(lossy.url, prefix)  # no request with it since: the gateways learn it from Redis
    for gateway in gateways:
        wait_for(lambda g=gateway: f"API key {prefix} was revoked" in g.log_path.read_text(), 10,
                 f"{gateway.name} to learn the revocation")
    lossy.client.flushall()
    assert _complete(first, kept)
    for gateway in (second, first):
        with pytest.raises(openai.AuthenticationError):
            _list_models(gateway, doomed)
    assert lossy.client.hget(keys.api_key(prefix), "revoked") == b"1"  # written back as its tombstone


def test_an_auto_gateway_started_after_a_loss_does_not_serve_without_a_key(tmp_path: Path, procs, start_gateway) -> None:
    """Regression: a gateway in auth=auto that started while Redis had lost the keys served
    everyone openly (the Cluster nemesis served a probe without a key that way). Here the
    gateway that kept the key is stalled through the loss and resumed only once the new one
    is starting, so the new one has to wait for the write-back."""
    with EmbeddedRedis() as server:
        key, _ = _create(server.url, "seen")
        seen = start_gateway(redis_at=server.url)  # no worker: nobody else makes the new epoch
        _list_models(seen, key)
        os.kill(seen.pid, signal.SIGSTOP)
        try:
            client = redis.Redis.from_url(server.url)
            client.flushall()
            client.close()
            port = free_port()
            fresh = Proc("gateway-fresh", [sys.executable, "-m", "sluice", "gateway", "--port", str(port),
                                           "--redis-url", server.url, "--procs", "1"], tmp_path / "fresh.log", _env())
            fresh.url = f"http://127.0.0.1:{port}"
            procs.append(fresh)
            # It waits for keys to come back (before the fix: it came up at once, open).
            wait_for(lambda: "waiting" in fresh.log_path.read_text() or _up(fresh), 30, "the new gateway to start")
        finally:
            os.kill(seen.pid, signal.SIGCONT)
        fresh.wait_http("/health")
        assert httpx.get(fresh.url + "/v1/models").status_code == 401  # no key: not served
        _list_models(fresh, key)  # written back by the gateway that had verified it



def test_a_key_one_cluster_node_lost_is_never_401(start_worker, start_gateway) -> None:
    """Regression (nemesis, Cluster: 5 invalid_api_key): a node restarted empty and lost the
    records of the keys it held, while the node holding the registry's epoch kept it. A
    gateway that had never verified such a key answered 401 (the epoch was old), and the
    gateways that had verified it never wrote it back (they watched the epoch alone). Every
    gateway now watches which servers answer: those that kept the key write it back, the
    others answer 503 + Retry-After meanwhile (the SDK retries)."""
    with EmbeddedCluster() as cluster:
        client = sync_client(cluster.url)
        start_worker(MODEL, redis_at=cluster.url, sim_token_ms=0, sim_ttft_ms=0)
        _create(cluster.url, "first")  # gateways that start with a key enforce keys at once
        first, second = start_gateway(redis_at=cluster.url), start_gateway(redis_at=cluster.url)
        epoch_node = client.get_node_from_key(keys.EPOCH).port
        key, prefix = _create(cluster.url, "lost")
        while client.get_node_from_key(keys.api_key(prefix)).port == epoch_node:
            key, prefix = _create(cluster.url, "lost")
        assert _complete(first, key, retries=0)
        port = client.get_node_from_key(keys.api_key(prefix)).port
        node = next(server for server in cluster.servers if server.port == port)
        node.shutdown(save=False)
        node.start()  # back empty, with its slots (nodes.conf)
        assert _complete(second, key, retries=8)
        assert client.hget(keys.api_key(prefix), "sha256")  # written back by the first gateway
        client.close()


async def test_a_key_whose_listing_redis_lost_is_listed_again(lossy) -> None:
    """Regression (nemesis, Cluster: "the gateways had not written the API keys back 30 s
    after a data loss"): a node lost ``sl:apikeys`` (the list `sluice keys list` reads) but
    another kept the key's record; the keeper wrote back only records that were missing, so
    the key stayed unlisted for good."""
    client = await create_pool(lossy.url)
    keeper = KeyKeeper(client, KeyStore(client))
    try:
        key, record = await KeyStore(client).create("listed")
        await keeper.verify(key)
        await client.srem(keys.API_KEYS, record.prefix)
        await keeper.restore_all()
        assert await client.sismember(keys.API_KEYS, record.prefix)
    finally:
        await client.aclose()


@pytest.mark.parametrize("topology", ["one server", "cluster"])
async def test_kept_records_are_written_back_in_batches_whatever_redis_kept(topology: str) -> None:
    """The write-back of many records goes a pipeline per batch (one record per round trip
    took 14 s for 50,000 records, past the 3 s an unknown key is 503 rather than 401): after
    a loss that also took Redis's scripts, every batch writes what was lost, leaves another
    key's record under a kept prefix alone, keeps a revocation Redis has, and writes back one
    this process knows."""
    with (EmbeddedCluster() if topology == "cluster" else EmbeddedRedis()) as server:
        client = await create_pool(server.url)
        keeper = KeyKeeper(client, KeyStore(client), batch=3)
        try:
            made = [await KeyStore(client).create(f"tenant-{i}") for i in range(8)]
            for key, _ in made:
                await keeper.verify(key)
            prefixes = [record.prefix for _, record in made]
            await keeper.verify(made[0][0])  # the scripts are loaded: a restart takes them
            await client.flushall()
            await client.script_flush()
            await client.hset(keys.api_key(prefixes[1]), mapping={"sha256": "another key's", "revoked": "0"})
            await client.hset(keys.api_key(prefixes[2]), mapping={**keeper._kept[prefixes[2]].fields, "revoked": "1"})
            assert await KeyStore(client).revoke(prefixes[3]) is False  # Redis has no record to revoke
            keeper._kept[prefixes[3]].revoke()  # as if learned from sl:apikeys:revoked before the loss
            await keeper.restore_all()
            assert keeper.restored == 6  # all but the other key's record and the one Redis kept
            assert (await client.hget(keys.api_key(prefixes[1]), "sha256")) == b"another key's"
            for prefix in prefixes[2:4]:
                assert (await client.hget(keys.api_key(prefix), "revoked")) == b"1"
                assert await client.sismember(keys.API_KEYS_REVOKED, prefix)
            for key, _ in made[4:] + made[:1]:
                assert (await keeper.verify(key)).name.startswith("tenant-")
            assert keeper._kept[prefixes[2]].revoked  # learned from the write-back
            listed = set(await client.smembers(keys.API_KEYS))
            assert listed == {p.encode() for i, p in enumerate(prefixes) if i != 1}
        finally:
            await keeper.close()
            await client.aclose()


def test_a_gateway_started_while_write_backs_are_late_says_503_not_401(start_worker, start_gateway) -> None:
    """Regression (nemesis, Cluster: 4 invalid_api_key): Redis lost the keys, the gateway that
    kept them could not write them back at once (stalled here; a stalled node there), and a
    gateway restarted after the new epoch was 3 s old answered 401 for a valid key: it could
    not know of the loss. A gateway's first seconds are now as unsure as a young epoch's."""
    with EmbeddedRedis() as server:
        key, _ = _create(server.url, "late")
        start_worker(MODEL, redis_at=server.url, sim_token_ms=0, sim_ttft_ms=0)  # makes the new epoch
        env = {"SLUICE_GATEWAY_AUTH": "keys"}
        kept = start_gateway(env=env, redis_at=server.url)
        assert _complete(kept, key, retries=0)
        os.kill(kept.pid, signal.SIGSTOP)
        try:
            client = redis.Redis.from_url(server.url)
            client.flushall()
            wait_for(lambda: client.hget(keys.EPOCH, "id") is not None, 10, "the worker to make a new epoch")
            time.sleep(keys.API_KEYS_RESTORE_S + 0.5)  # the epoch is too old to say "unsure" by itself
            client.close()
            fresh = start_gateway(env=env, redis_at=server.url)
            resp = httpx.post(fresh.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=10)
            assert resp.status_code == 503, resp.text  # was 401
            assert resp.json()["error"]["code"] == "registry_rebuilding"
        finally:
            os.kill(kept.pid, signal.SIGCONT)
        assert _complete(fresh, key, retries=5)  # written back by the gateway that kept it


async def test_a_cluster_gateway_in_its_first_seconds_says_503_for_an_unknown_key() -> None:
    """Regression (nemesis, Cluster: 2 invalid_api_key): a Cluster node lost key records while
    the node holding the registry's epoch kept it, and a gateway started 0.6 s later answered
    401 for valid keys: nothing told it of the loss, and the gateways that kept the keys wrote
    them back within a second. On a Cluster an unknown key is 503 in a process's first 3 s;
    after that, 401."""
    with EmbeddedCluster() as cluster:
        client = await create_pool(cluster.url)
        keeper = KeyKeeper(client, KeyStore(client))
        try:
            await client.hset(keys.EPOCH, mapping={"id": "old", "at": int(time.time() * 1000) - 60_000})
            key, record = await KeyStore(client).create("lost-on-a-node")
            await client.delete(keys.api_key(record.prefix))  # what the node lost
            keeper.start()
            await asyncio.sleep(0.6)  # its first look at Redis: nothing changed since it started
            with pytest.raises(Unavailable):
                await keeper.verify(key)
            keeper._started_at -= keys.API_KEYS_RESTORE_S  # past its first seconds
            with pytest.raises(AuthenticationFailed):
                await keeper.verify(key)
        finally:
            await keeper.close()
            await client.aclose()


def _keys_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``sluice keys ...`` as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "sluice", "keys", *args], env=_env(), capture_output=True,
                          text=True, timeout=60, check=True)


def test_keys_in_a_keys_file_outlive_every_gateway_that_verified_them(
        tmp_path: Path, start_worker, start_gateway) -> None:
    """Regression (nemesis, Sentinel, seed 13: 584 forbidden 401s). Redis lost the key records
    and took no writes for 27 s; every gateway process that had verified the keys was
    restarted meanwhile, and their copies died with them: valid keys got 401 for the rest of
    the run. A keys file (``sluice keys export``, ``SLUICE_GATEWAY_KEYS_FILE``) outlives them:
    a gateway that never saw the key writes it back from the file, and a revocation made with
    ``--keys-file`` stays one."""
    with EmbeddedRedis() as server:
        start_worker(MODEL, redis_at=server.url, sim_token_ms=0, sim_ttft_ms=0)
        key, prefix = _create(server.url, "filed")
        doomed, doomed_prefix = _create(server.url, "revoked-in-the-file")
        _, stale_prefix = _create(server.url, "revoked-without-the-file")
        path = tmp_path / "keys.jsonl"
        _keys_cli("export", str(path), "--redis-url", server.url)
        _keys_cli("revoke", doomed_prefix, "--redis-url", server.url, "--keys-file", str(path))
        assert oct(path.stat().st_mode & 0o777) == "0o600" and key not in path.read_text()
        filed = {"SLUICE_GATEWAY_KEYS_FILE": str(path)}
        first = start_gateway(env=filed, redis_at=server.url)
        assert _complete(first, key)
        first.kill()  # the only process that verified the key
        client = redis.Redis.from_url(server.url)
        client.flushall()
        fresh = start_gateway(env=filed, redis_at=server.url)
        assert _complete(fresh, key)  # written back from the file (without it: 401 for good)
        assert client.sismember(keys.API_KEYS, prefix)
        with pytest.raises(openai.AuthenticationError):
            _list_models(fresh, doomed)
        assert client.hget(keys.api_key(doomed_prefix), "revoked") == b"1"
        assert httpx.get(fresh.url + "/v1/models").status_code == 401  # no key: not served
        # A revocation the file does not have: the gateway keeps it, and says the file would undo it.
        _keys_cli("revoke", stale_prefix, "--redis-url", server.url)
        wait_for(lambda: f"API key {stale_prefix} was revoked, but the keys file" in fresh.log_path.read_text(), 10,
                 "the gateway to warn that its keys file still has the revoked key valid")
        client.close()


async def test_one_gateway_process_writes_a_keys_file_back_not_every_one(tmp_path: Path) -> None:
    """Every process wrote the whole keys file back at its start and after every loss: N
    processes, N times the file's writes on Redis at once (about 8 µs of Redis CPU a record:
    1.6 s per process for 200,000 keys). One process writes it under a lease and marks it
    written; the others wait for the mark, and one that finds it at start writes nothing.
    A writer that dies leaves its lease to expire, and another process writes the file."""
    records = [{"prefix": f"{i:08x}", "name": f"t{i}", "tier": "standard", "rpm": "60", "tpm": "1000",
                "max_concurrent": "4", "priority_ceiling": "0", "created": "1764892800.0", "revoked": "0",
                "sha256": digest(f"sk-sluice-{i:08x}-secret")} for i in range(40)]
    path = str(tmp_path / "keys.jsonl")
    save_records(path, records)

    async def script_calls(client: redis.asyncio.Redis) -> int:
        """Write-backs run (each reads the record's sha256 first; one sent before Redis had
        the script is not run)."""
        return int((await client.info("commandstats")).get("cmdstat_hget", {}).get("calls", 0))

    with EmbeddedRedis() as server:
        clients = [redis.asyncio.Redis.from_url(server.url) for _ in range(4)]
        keepers = [KeyKeeper(c, KeyStore(c), keys_file=path, batch=7) for c in clients]
        admin = clients[0]
        try:
            await asyncio.gather(*(k._after_look(False) for k in keepers))  # four processes' first look
            assert await script_calls(admin) == 40  # was 40 + 3 × 80: each process wrote all 40
            assert await admin.scard(keys.API_KEYS) == 40
            for _ in range(2):
                await admin.config_resetstat()
                await admin.flushall()
                await asyncio.gather(*(k._after_look(True) for k in keepers))  # the loss, seen by all four
                assert await admin.scard(keys.API_KEYS) == 40 and await script_calls(admin) == 40
                await asyncio.gather(*(k._after_look(False) for k in keepers))  # the mark seen: done
                assert await script_calls(admin) == 40 and not any(k._file_owed for k in keepers)
            await admin.config_resetstat()
            late = KeyKeeper(admin, KeyStore(admin), keys_file=path)
            await late._after_look(False)  # a process started after: the mark is there
            assert await script_calls(admin) == 0 and not late._file_owed
            # A writer that died part-way: its lease outlives it, the mark is gone.
            await admin.flushall()
            await admin.config_resetstat()
            await admin.set(keys.API_KEYS_FILING, "a dead process", px=600)
            await asyncio.gather(*(k._after_look(True) for k in keepers))
            assert await admin.scard(keys.API_KEYS) == 0 and all(k._file_owed for k in keepers)
            await asyncio.sleep(0.7)
            await asyncio.gather(*(k._after_look(False) for k in keepers))
            assert await admin.scard(keys.API_KEYS) == 40 and await script_calls(admin) == 40
        finally:
            for keeper, client in zip(keepers, clients):
                await keeper.close()
                await client.aclose()


def test_a_gateway_given_a_keys_file_it_cannot_read_does_not_start(tmp_path: Path) -> None:
    """A keys file that is missing, or is not one, stops the gateway with a message naming
    it, rather than starting with no keys to fall back on."""
    bad = tmp_path / "keys.jsonl"
    bad.write_text('{"prefix": "abcd1234"}\n')
    for path in (tmp_path / "missing.jsonl", bad):
        run = subprocess.run([sys.executable, "-m", "sluice", "gateway", "--port", str(free_port()), "--procs", "1",
                              "--redis-url", "redis://127.0.0.1:1/0"], env={**_env(), "SLUICE_GATEWAY_KEYS_FILE":
                                                                           str(path)},
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2, run.stderr[-2000:]
        assert "SLUICE_GATEWAY_KEYS_FILE" in run.stderr and str(path) in run.stderr
        assert "Traceback" not in run.stderr
