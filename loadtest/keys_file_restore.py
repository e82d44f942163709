"""How long a gateway takes to write a keys file back after Redis lost every key record.

The keys file (sluice/apikeys.py) is unbounded: an operator may keep any number of keys in
it. Each gateway process writes every record back after each loss, a pipeline of script
calls per batch of records (gateway/admission/key_keeper.py ``restore_all``). Keys unknown
meanwhile get 503 ``registry_rebuilding`` for 3 s after the loss, then 401: past the size
at which one restore takes longer than that, clients whose keys come late get 401.

    .venv/bin/python loadtest/keys_file_restore.py --sizes 1000,10000,50000,200000 --keepers 1,4 --repeat 3

Prints, per size, batch (``--batches``: 1 is a record per round trip, as before the
pipeline; 1000 is the default) and number of gateway processes that saw the loss
(``--keepers``: their keepers, in this one process), the file's load time and the restore's
median time with its spread (FLUSHALL before each repeat) against one embedded Redis, and the
Redis CPU it took: one process writes the file back under a lease, the others wait for it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path

import redis.asyncio

from gateway.admission.key_keeper import KeyKeeper
from sluice.apikeys import KeyStore, digest, save_records
from sluice.embedded_redis import EmbeddedRedis

#: The window in which an unknown key is 503, not 401, after a loss (sluice/keys.py).
RESTORE_WINDOW_S = 3.0


def records(n: int) -> list[dict[str, str]]:
    return [{"prefix": f"{i:08x}", "name": f"tenant-{i}", "tier": "standard", "rpm": "600", "tpm": "400000",
             "max_concurrent": "32", "priority_ceiling": "0", "created": "1764892800.0", "revoked": "0",
             "sha256": digest(f"sk-sluice-{i:08x}-secret")} for i in range(n)]


async def redis_cpu_s(client: redis.asyncio.Redis) -> float:
    info = await client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def measure(url: str, path: str, n: int, batch: int, keepers: int,
                  repeat: int) -> tuple[float, list[float], list[float]]:
    """The file's load time, then per repeat: the time until every record is back after a
    FLUSHALL that ``keepers`` processes' keepers all saw, and the Redis CPU it took."""
    save_records(path, records(n))
    clients = [redis.asyncio.Redis.from_url(url) for _ in range(keepers)]
    admin = clients[0]
    try:
        started = time.perf_counter()
        kept = [KeyKeeper(c, KeyStore(c), keys_file=path, batch=batch) for c in clients]
        loaded = (time.perf_counter() - started) / keepers
        times, redis_cpu = [], []
        for _ in range(repeat):
            await admin.flushall()
            started, cpu = time.perf_counter(), await redis_cpu_s(admin)
            await asyncio.gather(*(k.restore_all() for k in kept))
            times.append(time.perf_counter() - started)
            redis_cpu.append(await redis_cpu_s(admin) - cpu)
            assert await admin.scard("sl:apikeys") == n
        return loaded, times, redis_cpu
    finally:
        for client in clients:
            await client.aclose()


def main() -> None:
    logging.getLogger("sluice.tenancy").setLevel(logging.ERROR)  # each restore's own line
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,50000", help="records in the file, comma-separated")
    parser.add_argument("--batches", default="1,1000", help="records per pipeline, comma-separated")
    parser.add_argument("--keepers", default="1,4", help="gateway processes that saw the loss, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        print(f"{'records':>8} {'batch':>6} {'keepers':>8} {'load s':>8} {'restore s (median)':>19} {'spread':>16} "
              f"{'Redis CPU s':>12} {'within the 3 s window':>22}")
        for n in (int(s) for s in args.sizes.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                for keepers in (int(k) for k in args.keepers.split(",")):
                    loaded, times, cpu = asyncio.run(measure(server.url, str(Path(tmp) / "keys.jsonl"), n, batch,
                                                             keepers, args.repeat))
                    median = statistics.median(times)
                    print(f"{n:>8} {batch:>6} {keepers:>8} {loaded:>8.3f} {median:>19.3f} "
                          f"{min(times):>7.3f}–{max(times):<8.3f} {statistics.median(cpu):>12.3f} "
                          f"{'yes' if median <= RESTORE_WINDOW_S else 'NO':>22}", flush=True)


if __name__ == "__main__":
    main()
