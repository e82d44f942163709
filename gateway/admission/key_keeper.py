"""API key records a gateway process verified lately, written back when Redis loses them.

Redis that loses its data (a restart without persistence, ``FLUSHALL``, a failover that
lost writes) loses the key records too (sluice/apikeys.py), and every client would get
401 until an operator made the keys again. So each gateway process keeps a copy of the
records it verified (the stored record: the key's SHA-256, never the key), at most
:data:`KEPT` of them, each until :data:`KEEP_S` after its last successful verify, and
writes them back, only where Redis has none:

- at once, when a verify finds the record of a key it keeps missing (that request is
  served; the other kept records follow);
- when the process's loss watcher (gateway/loss_watch.py) sees that Redis may have lost
  writes: a new registry epoch, Redis back after being unreachable, other server processes
  answering (a failover; on a Cluster, a node that lost its slice while the node holding
  the epoch kept it), so every gateway, and one started since, finds them again.

A process that enforces keys first writes back ``sl:apikeys:enforced``, so a gateway in
``auth=auto`` that starts after the loss enforces keys too (gateway/admission/tenancy.py).
Until the new epoch is :data:`~sluice.keys.API_KEYS_RESTORE_S` old (an epoch nobody has
marked as following a loss: :data:`~sluice.keys.API_KEYS_UNMARKED_S`), or this process saw
other servers answer that recently, a key Redis does not know may be one being written
back: 503 + ``Retry-After`` (SDKs retry it), not 401 (the nemesis, Cluster: a node lost
the records of keys only other gateways had verified, and their clients got 401).

With a keys file (``SLUICE_GATEWAY_KEYS_FILE``, sluice/apikeys.py), the process also holds
the file's records, loaded at start and again whenever the file changes. They are copies
that never expire: written back at the first look at Redis and after every loss, and
verified from as any copy is. So the keys survive a loss that outlives every gateway
process that verified them (the nemesis, Sentinel, seed 13: Redis took no writes for 27 s
after a loss, every gateway was restarted meanwhile, and the copies died with them).
One process writes a file back at a time, under a lease (``sl:apikeys:filing``), and marks
it written (``sl:apikeys:filed``: the records' digest); the others only wait for the mark,
so a file of N records costs Redis N writes after a loss, not N per gateway process (about
8 µs of Redis CPU each, loadtest/keys_file_restore.py), and nothing at a start that finds
the mark. Their own copies are not held back meanwhile: a key whose record is missing is
written back by whichever process verifies it.

Revocations are never undone by a copy. A record changes once at most, when it is
revoked, so writing back merges one way: a missing record is written whole, a valid one
that this process knows revoked is marked revoked, nothing else is touched (another key's
record under the same prefix least of all). A kept copy learns the revocation when a
verify reads the record revoked, or from ``sl:apikeys:revoked`` (read after each of the
watcher's looks), which ``sluice keys revoke`` adds the prefix to; a revocation that Redis
loses later is then written back by every gateway that kept the key. Not covered: a revocation that Redis
loses within a look of being made (a restart without persistence right after
``sluice keys revoke``) is undone by the copies, and a key created and lost before any
gateway verified it is gone (401) unless a keys file holds it: both are ``sluice keys``
commands to run again.

>>> keeper = KeyKeeper(redis, KeyStore(redis))
>>> record = await keeper.verify(key)   # raises AuthenticationFailed or Unavailable
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError

from gateway.admission.queue import REGISTRY_REBUILDING, stop_tasks
from gateway.loss_watch import LossWatch
from sluice import keys
from sluice.apikeys import ApiKey, KeyStore, digest, load_records, matches, parse_prefix, parse_record
from sluice.directory import Directory
from sluice.errors import AuthenticationFailed, Unavailable
from sluice.ids import random_hex
from sluice.script_channel import ScriptRunner

log = logging.getLogger("sluice.tenancy")

#: A kept record is dropped this long after the last request that verified it.
KEEP_S = 600.0
#: At most this many records are kept (about 300 bytes each: ~3 MB), the least recently
#: verified dropped first.
KEPT = 10_000
#: Prefixes asked about in one SMISMEMBER, and records written back in one pipeline: one at a
#: time, 10,000 records took 2.8 s to write back and 50,000 took 14 s, past the 3 s in which an
#: unknown key is 503 rather than 401 (loadtest/keys_file_restore.py prints both ways).
_BATCH = 1_000

#: The lease of the process writing a keys file back; renewed after each batch.
FILING_TTL_MS = 30_000

#: A key's stored record, read at every request that sends one: a script, so that it runs on
#: the connection the per-request scripts share (sluice/script_channel.py). Through redis-py's
#: ``HGETALL`` (a pooled connection checked out and in, its own parser and timeout) it was
#: about half of what a key added to a request's CPU in the gateway, and the pool opened a
#: connection for each request waiting at once (loadtest/peers/README.md).
RECORD = "return redis.call('HGETALL', KEYS[1])"

#: Give the keys file's lease up, if still this process's. KEYS: the lease. ARGV: the owner.
UNLEASE = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

#: Write one kept record back. KEYS: the record. ARGV: its sha256, '1' if this process knows
#: it revoked, then field, value pairs. Returns {1 if written, 'valid' | 'revoked' | 'other'}.
WRITE_BACK = r"""
local sha = redis.call('HGET', KEYS[1], 'sha256')
if not sha then
  redis.call('HSET', KEYS[1], unpack(ARGV, 3))
  return {1, ARGV[2] == '1' and 'revoked' or 'valid'}
end
if sha ~= ARGV[1] then return {0, 'other'} end
if redis.call('HGET', KEYS[1], 'revoked') == '1' then return {0, 'revoked'} end
if ARGV[2] == '1' then
  redis.call('HSET', KEYS[1], 'revoked', '1')
  return {1, 'revoked'}
end
return {0, 'valid'}
"""


@dataclass(slots=True)
class _Kept:
    fields: dict[str, str]
    #: When a request last verified it (monotonic).
    seen: float

    @property
    def revoked(self) -> bool:
        return self.fields.get("revoked") == "1"

    def revoke(self) -> None:
        self.fields = {**self.fields, "revoked": "1"}


def _learn_revoked(prefix: str, kept: _Kept | None, filed: _Kept | None, keys_file: str | None) -> None:
    """Mark this process's copies of a record revoked (``kept``: the one it verified;
    ``filed``: the keys file's), and say so once, whichever way it was learned (a verify, a
    write-back that found the record revoked, ``sl:apikeys:revoked``): CI, 2026-12-02, a
    write-back right after a loss learned it first and no line said so.

    A keys file that still says valid is said at warning level: this process keeps the
    revocation, but a loss that outlives every gateway process would bring the key back
    from the file (a ``sluice keys revoke`` run without ``--keys-file``)."""
    fresh = [copy for copy in (kept, filed) if copy is not None and not copy.revoked]
    for copy in fresh:
        copy.revoke()
    if any(copy is filed for copy in fresh):
        log.warning("API key %s was revoked, but the keys file %s still has it valid: this gateway keeps the "
                    "revocation, while a Redis loss that outlives every gateway would bring the key back. "
                    "Rewrite the file (sluice keys export %s), or revoke with --keys-file", prefix, keys_file,
                    keys_file)
    elif fresh:
        log.info("API key %s was revoked: this gateway's copy is marked revoked", prefix)


class KeyKeeper:
    """The kept key records of one gateway process (see the module)."""

    def __init__(self, redis: Any, store: KeyStore, *, keep_s: float = KEEP_S, kept: int = KEPT,
                 watch: LossWatch | None = None, keys_file: str | None = None, batch: int = _BATCH,
                 runner: ScriptRunner | None = None) -> None:
        """``runner``: what runs the per-request scripts (the tenancy's :func:`script_runner`),
        which reads each request's key record; redis-py's scripts without one."""
        self._redis = redis
        self._cluster = isinstance(redis, RedisCluster)
        self._store = store
        self._directory = Directory(redis)
        self._write_back_script = redis.register_script(WRITE_BACK)
        self._unlease = redis.register_script(UNLEASE)
        self._record = (runner or redis).register_script(RECORD)
        self._owner = random_hex()
        self._keep_s, self._cap, self._batch = keep_s, kept, batch
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # least recently verified first
        #: This process enforces keys: after a loss it writes ``sl:apikeys:enforced`` back too.
        self.enforcing = False
        #: The process's loss watcher (its own when none is given).
        self.watch = watch if watch is not None else LossWatch(redis)
        self._owns_watch = watch is None
        self.watch.listen(self._after_look)
        self._started_at = -math.inf  # when start() ran (monotonic)
        self._revocations = -1  # size of sl:apikeys:revoked at the last read
        self._restoring: asyncio.Task[None] | None = None
        self.restored = 0
        #: The keys file's records (copies that never expire), and the file's state when read.
        self._keys_file = keys_file
        self._filed: dict[str, _Kept] = {}
        self._file_stamp: tuple[int, int] | None = None
        self._file_digest = ""  # of its records: what sl:apikeys:filed holds once they are written back
        self._file_owed = False  # its records are to be written back at the next look
        self._leased = False  # this process holds sl:apikeys:filing
        if keys_file is not None:  # (one that cannot be read stops the gateway first: gateway/gateway.py)
            self._read_keys_file(quiet=True)  # said by start(): a gateway's preflight builds one too

    def __repr__(self) -> str:
        return f"<KeyKeeper kept={len(self._kept)} filed={len(self._filed)} restored={self.restored}>"

    @property
    def filed(self) -> bool:
        """Whether a keys file gave this process records: keys exist, whatever Redis says."""
        return bool(self._filed)

    def _read_keys_file(self, quiet: bool = False) -> None:
        """(Re)load the keys file when it changed; a file that cannot be read, or is not one,
        leaves the records last loaded (and says so) rather than none: a key must not stop
        working because its file was being edited."""
        assert self._keys_file is not None
        try:
            stat = os.stat(self._keys_file)
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp == self._file_stamp:
                return
            records = load_records(self._keys_file)
        except (OSError, ValueError) as exc:
            if self._file_stamp != (0, 0):
                log.error("keys file %s: %s; keeping the %d record(s) loaded before", self._keys_file, exc,
                          len(self._filed))
                self._file_stamp = (0, 0)  # said once until it changes
            return
        filed: dict[str, _Kept] = {}
        for prefix, fields in records.items():
            old = self._filed.get(prefix)
            filed[prefix] = _Kept(fields, math.inf)
            if old is not None and old.revoked and old.fields.get("sha256") == fields.get("sha256"):
                filed[prefix].revoke()  # a revocation learned since is kept
        self._filed, self._file_stamp, self._file_owed = filed, stamp, True
        self._file_digest = hashlib.sha256(orjson.dumps(records, option=orjson.OPT_SORT_KEYS)).hexdigest()
        if not quiet:
            self._say_filed()

    def _say_filed(self) -> None:
        log.info("keys file %s: %d API key record(s) loaded; written back wherever Redis lacks them",
                 self._keys_file, len(self._filed))

    def _copy(self, prefix: str) -> _Kept | None:
        """This process's copy of the record of ``prefix``: the one it verified, else the file's."""
        kept = self._kept.get(prefix)
        return kept if kept is not None else self._filed.get(prefix)

    def start(self) -> None:
        self._started_at = time.monotonic()
        if self._keys_file is not None:
            self._say_filed()
        self.watch.start()

    async def close(self) -> None:
        if self._restoring is not None:
            await stop_tasks([self._restoring])
        if self._owns_watch:
            await self.watch.close()

    async def verify(self, key: str) -> ApiKey:
        """The record of ``key``; raises 401 for a key that is not genuine or is revoked,
        503 for one Redis does not know while keys may still be being written back."""
        prefix = parse_prefix(key)
        if prefix is None:
            raise AuthenticationFailed("invalid or revoked API key")
        raw = await self._record(keys=[keys.api_key(prefix)])
        fields = {raw[i].decode(): raw[i + 1].decode() for i in range(0, len(raw), 2)} if raw else None
        missing = fields is None
        key_digest = digest(key)
        kept = self._copy(prefix)
        if kept is not None and not matches(key_digest, kept.fields):
            kept = None  # a copy of another key's record under this prefix says nothing of this one
        if kept is not None and (fields is None or (kept.revoked and fields.get("revoked") != "1")):
            # Redis lost the record (or its revocation): write back what this process verified.
            fields = await self._write_back(prefix, kept)
            self._restore_soon()  # the loss took the other records too
        if fields is None or not matches(key_digest, fields):
            if missing and kept is None:
                await self._unknown()
            raise AuthenticationFailed("invalid or revoked API key")
        record = parse_record(fields)
        if record.revoked:
            if kept is not None:
                _learn_revoked(prefix, self._kept.get(prefix), self._filed.get(prefix), self._keys_file)
            raise AuthenticationFailed("invalid or revoked API key")
        self._keep(prefix, fields)
        return record

    async def get(self, prefix: str) -> ApiKey | None:
        """The record of ``prefix``, revoked or not: Redis's, else this process's copy."""
        record = await self._store.get(prefix)
        kept = self._copy(prefix)
        return record if record is not None or kept is None else parse_record(kept.fields)

    async def _unknown(self) -> None:
        """Redis has no record for the key: 503 while the keys may be being written back."""
        # (Made now if Redis has none, marked as after a loss.)
        epoch = await self._directory.epoch(self.watch.seen_epoch)
        # Also while this process has no fresh look at Redis (Redis away, or the process
        # stalled): a loss may have happened unnoticed (nemesis, Cluster: a gateway resumed
        # from SIGSTOP answered 401 for keys a failover had just lost).
        # And in this process's first moments, in a registry rebuilt after a loss: it cannot
        # know whether the write-backs are late (nemesis, Cluster: a gateway restarted while
        # the node the keepers had to write to was stalled answered 401 for 4 valid keys).
        # On a Cluster in any registry: one node's loss leaves the epoch, on another node, as
        # it was, so nothing tells a process that started after it (nemesis, Cluster: a gateway
        # 0.6 s old answered 401 for 2 valid keys that the others wrote back within a second).
        just_started = time.monotonic() - self._started_at < keys.API_KEYS_RESTORE_S
        if epoch.keys_restore_s > 0 or self.watch.unsure_s() > 0 or \
                (just_started and (epoch.rebuilding or self._cluster)):
            raise Unavailable("API key not known yet: Redis lost its data moments ago and gateways are writing "
                              "the keys back", retry_after_s=1, code=REGISTRY_REBUILDING)

    def _keep(self, prefix: str, fields: dict[str, str]) -> None:
        kept = self._kept.get(prefix)
        if kept is None:
            self._kept[prefix] = _Kept(fields, time.monotonic())
            if len(self._kept) > self._cap:
                self._kept.popitem(last=False)
        else:
            kept.fields, kept.seen = fields, time.monotonic()
            self._kept.move_to_end(prefix)

    def _expire(self) -> None:
        horizon = time.monotonic() - self._keep_s
        while self._kept:
            prefix, kept = next(iter(self._kept.items()))
            if kept.seen >= horizon:
                break
            del self._kept[prefix]

    async def _write_back(self, prefix: str, kept: _Kept) -> dict[str, str] | None:
        """Write one kept record back where Redis lost it; the record Redis has afterwards
        (None: another key's record holds the prefix)."""
        return (await self._write_back_many([(prefix, kept)]))[0]

    async def _write_back_many(self, copies: list[tuple[str, _Kept]]) -> list[dict[str, str] | None]:
        """Write kept records back where Redis lost them, in one pipeline; per record, what
        :meth:`_write_back` returns."""
        replies = await self._run_write_backs(copies)
        if any(isinstance(reply, NoScriptError) for reply in replies):  # Redis restarted: its scripts went too
            await self._redis.script_load(WRITE_BACK)  # (on a Cluster, every primary)
            replies = await self._run_write_backs(copies)
        failed = next((reply for reply in replies if isinstance(reply, BaseException)), None)
        if failed is not None:
            raise failed
        held: list[dict[str, str] | None] = []
        listed, revoked = [], []
        for (prefix, kept), (written, state) in zip(copies, replies):
            state = state.decode() if isinstance(state, bytes) else str(state)
            if state == "other":
                held.append(None)
                continue
            if state == "revoked":
                filed = self._filed.get(prefix)
                _learn_revoked(prefix, None if kept is filed else kept, filed, self._keys_file)
            self.restored += int(written)
            held.append(kept.fields)
            listed.append(prefix)
            if kept.revoked:
                revoked.append(prefix)
        # Listed again (sluice keys list), and its revocation readable by every gateway; also
        # when Redis kept the record but lost the lists (on a Cluster they live on another
        # node than the record: the nemesis found keys missing from `sluice keys list`).
        if listed:
            await self._redis.sadd(keys.API_KEYS, *listed)
        if revoked:
            await self._redis.sadd(keys.API_KEYS_REVOKED, *revoked)
        return held

    async def _run_write_backs(self, copies: list[tuple[str, _Kept]]) -> list[Any]:
        pipe = self._redis.pipeline(transaction=False)
        for prefix, kept in copies:
            args: list[str] = [kept.fields.get("sha256", ""), "1" if kept.revoked else "0"]
            for name, value in kept.fields.items():
                args += [name, value]
            pipe.evalsha(self._write_back_script.sha, 1, keys.api_key(prefix), *args)
        return await pipe.execute(raise_on_error=False)

    def _restore_soon(self) -> None:
        if self._restoring is None or self._restoring.done():
            self._restoring = asyncio.create_task(self._restore_quietly(), name="key-restore")

    async def _restore_quietly(self) -> None:
        try:
            await self.restore_all()
        except (RedisError, OSError) as exc:  # the watch loop writes them back once Redis answers
            log.warning("could not write API key records back: %s", exc)

    async def restore_all(self) -> None:
        """Redis lost its data: write back the marker, then every kept record, the most
        recently verified first, then the keys file's records (:meth:`_write_file_back`)."""
        if self.enforcing:
            await self._redis.set(keys.API_KEYS_ENFORCED, "1")
        before = self.restored
        await self._write_batches(list(reversed(self._kept.items())))
        if self._filed:
            await self._write_file_back(lost=True)
        if self.restored > before:
            log.warning("Redis lost API key records: %d written back from this gateway's copies",
                        self.restored - before)

    async def _write_batches(self, copies: list[tuple[str, _Kept]]) -> None:
        for i in range(0, len(copies), self._batch):
            await self._write_back_many(copies[i:i + self._batch])
            if self._leased:  # (a file written back: its lease lasts while it is)
                await self._redis.pexpire(keys.API_KEYS_FILING, FILING_TTL_MS)

    async def _write_file_back(self, lost: bool) -> None:
        """The keys file's records where Redis lacks them, unless ``sl:apikeys:filed`` says
        they were written back whole (not trusted after a loss: on a Cluster the mark may
        outlive records another node lost), and by one process at a time: the others look
        again at their next look, until the mark says the writer finished (a writer that
        died leaves the lease to expire, and another takes it)."""
        self._file_owed = True  # until written, or seen written
        if not lost and await self._file_written():
            self._file_owed = False
            return
        if not await self._redis.set(keys.API_KEYS_FILING, self._owner, nx=True, px=FILING_TTL_MS):
            return  # another process writes them
        self._leased = True
        try:
            await self._redis.delete(keys.API_KEYS_FILED)  # not written whole until this process says so
            skip = self._kept if lost else {}  # (written just before, by restore_all)
            copies = [(p, self._copy(p) or k) for p, k in self._filed.items() if p not in skip]
            await self._write_batches(copies)
            await self._redis.set(keys.API_KEYS_FILED, self._file_digest)
            self._file_owed = False
        finally:
            self._leased = False
            with contextlib.suppress(RedisError, OSError):
                await self._unlease(keys=[keys.API_KEYS_FILING], args=[self._owner])

    async def _file_written(self) -> bool:
        """Whether the mark names this process's file and nobody is writing one back now."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.get(keys.API_KEYS_FILED)
        pipe.exists(keys.API_KEYS_FILING)
        filed, filing = await pipe.execute()
        return filed == self._file_digest.encode() and not filing

    async def _learn_revocations(self) -> None:
        """Mark revoked the kept copies whose prefix ``sl:apikeys:revoked`` lists, when its size changed."""
        count = int(await self._redis.scard(keys.API_KEYS_REVOKED))
        if count == self._revocations:
            return
        self._revocations = count
        prefixes = [p for p, copy in {**self._filed, **self._kept}.items() if not copy.revoked]  # (as _copy picks)
        for i in range(0, len(prefixes), self._batch):
            batch = prefixes[i:i + self._batch]
            for prefix, member in zip(batch, await self._redis.smismember(keys.API_KEYS_REVOKED, batch)):
                if member:
                    _learn_revoked(prefix, self._kept.get(prefix), self._filed.get(prefix), self._keys_file)

    async def _after_look(self, lost: bool) -> bool:
        """After each of the watcher's looks: drop old copies, write every copy back if Redis
        may have lost them (raises if that failed: tried again at the next look), learn
        revocations."""
        self._expire()
        if self._keys_file is not None:
            self._read_keys_file()
        if lost:
            await self.restore_all()
        elif self._file_owed:  # (the file's records: at the first look, once changed, and until written)
            await self._write_file_back(lost=False)
        if self._kept or self._filed:
            await self._learn_revocations()
        return True
