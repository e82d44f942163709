"""How long a gateway takes to write a keys file back after Redis lost every key record.

The keys file (sluice/apikeys.py) is unbounded: an operator may keep any number of keys in
it. Each gateway process writes every record back after each loss, one script call per
record, one after another (gateway/admission/key_keeper.py ``restore_all``). Keys unknown
meanwhile get 503 ``registry_rebuilding`` for 3 s after the loss, then 401: past the size
at which one restore takes longer than that, clients whose keys come late get 401.

    .venv/bin/python loadtest/keys_file_restore.py --sizes 1000,10000,50000 --repeat 3

Prints, per size: the file's load time, and the restore's median time with its spread
(FLUSHALL before each repeat) against one embedded Redis, one gateway process's keeper.
"""

from __future__ import annotations

import argparse
import asyncio
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


async def measure(url: str, path: str, n: int, repeat: int) -> tuple[float, list[float]]:
    save_records(path, records(n))
    client = redis.asyncio.Redis.from_url(url)
    try:
        started = time.perf_counter()
        keeper = KeyKeeper(client, KeyStore(client), keys_file=path)
        loaded = time.perf_counter() - started
        times = []
        for _ in range(repeat):
            await client.flushall()
            started = time.perf_counter()
            await keeper.restore_all()
            times.append(time.perf_counter() - started)
        assert await client.scard("sl:apikeys") == n
        return loaded, times
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,50000", help="records in the file, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        print(f"{'records':>8} {'load s':>8} {'restore s (median)':>19} {'spread':>16} {'within the 3 s window':>22}")
        for n in (int(s) for s in args.sizes.split(",")):
            loaded, times = asyncio.run(measure(server.url, str(Path(tmp) / "keys.jsonl"), n, args.repeat))
            median = statistics.median(times)
            print(f"{n:>8} {loaded:>8.3f} {median:>19.3f} {min(times):>7.3f}–{max(times):<8.3f} "
                  f"{'yes' if median <= RESTORE_WINDOW_S else 'NO':>22}")


if __name__ == "__main__":
    main()
