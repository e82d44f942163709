"""``sluice keys create|list|revoke|export``: manage API keys in the Redis the gateways use,
and the keys file that outlives it (sluice/apikeys.py)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from redis.asyncio import Redis

from sluice.apikeys import TIERS, KeyStore, save_records
from sluice.redis_pool import RedisClient, create_pool
from sluice.redis_url import is_sentinel_url

#: How long create and revoke wait for a replica to acknowledge the change.
REPLICA_WAIT_MS = 2000  # per WAIT: under the pool's socket timeout
REPLICA_WAITS = 3


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", help="create a key (shown once) with a tier and limits")
    create.add_argument("--name", required=True, help="who or what the key is for")
    create.add_argument("--tier", choices=sorted(TIERS), default="standard",
                        help="default limits and priority ceiling (default standard)")
    create.add_argument("--rpm", type=_positive, help="requests per minute (tier default otherwise)")
    create.add_argument("--tpm", type=_positive, help="tokens per minute")
    create.add_argument("--max-concurrent", type=_positive, help="requests in flight at once")
    create.add_argument("--priority-ceiling", type=int,
                        help="most urgent priority the key may ask for (lower is more urgent)")
    sub.add_parser("list", help="list keys (prefixes, names, tiers, limits; never the secrets)")
    revoke = sub.add_parser("revoke", help="revoke a key by its public prefix")
    revoke.add_argument("prefix", help="the 8 characters after 'sk-sluice-'")
    export = sub.add_parser("export", help="write every key record (hashes, never keys) to a keys file the "
                                           "gateways load (SLUICE_GATEWAY_KEYS_FILE): keys then outlive Redis "
                                           "losing its data")
    export.add_argument("file", help="the keys file to write (replaced whole; mode 0600)")
    for child in (create, revoke):
        child.add_argument("--keys-file", default=os.environ.get("SLUICE_GATEWAY_KEYS_FILE"),
                           help="rewrite this keys file with every record after the change (env "
                                "SLUICE_GATEWAY_KEYS_FILE): the gateways that load it then keep the key, or its "
                                "revocation, whatever Redis loses")
    for child in sub.choices.values():
        child.add_argument("--redis-url", default=os.environ.get("SLUICE_REDIS_URL", "redis://127.0.0.1:6379/0"),
                           help="the gateways' Redis (env SLUICE_REDIS_URL)")


def main(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _replicated(redis: RedisClient, url: str) -> None:
    """Wait until a replica has this command's writes: a failover that loses them would
    bring a revoked key back, or forget a created one."""
    if not isinstance(redis, Redis):
        return  # a Cluster: WAIT is per node, and each key's node differs; not checked
    # Sentinel means replicas, even when none is connected right now; a lone server has none.
    if not is_sentinel_url(url) and int((await redis.info("replication")).get("connected_slaves", 0)) == 0:
        return
    for _ in range(REPLICA_WAITS):
        if await redis.wait(1, REPLICA_WAIT_MS) >= 1:
            return
    print(f"sluice keys: warning: no replica acknowledged this change within {REPLICA_WAIT_MS * REPLICA_WAITS} ms; "
          "a failover now would undo it: check the replicas, then run the command again", file=sys.stderr)


async def _run(args: argparse.Namespace) -> int:
    pool = await create_pool(args.redis_url, retries=3)
    # One connection for the whole command: WAIT counts the writes of its own connection.
    redis = pool.client() if isinstance(pool, Redis) else pool
    store = KeyStore(redis)
    try:
        if args.keys_command == "create":
            key, record = await store.create(
                args.name, args.tier, rpm=args.rpm, tpm=args.tpm, max_concurrent=args.max_concurrent,
                priority_ceiling=args.priority_ceiling,
            )
            await _replicated(redis, args.redis_url)
            print(key)
            print(f"# {record.name}: tier {record.tier}, {record.rpm} rpm, {record.tpm} tpm, "
                  f"{record.max_concurrent} concurrent, priority ceiling {record.priority_ceiling}. "
                  "Store it now: it is not shown again.", file=sys.stderr)
        elif args.keys_command == "list":
            print(f"{'prefix':10} {'name':20} {'tier':9} {'rpm':>6} {'tpm':>9} {'conc':>5} {'ceiling':>7} "
                  f"{'created':20} revoked")
            for k in await store.list():
                created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(k.created))
                print(f"{k.prefix:10} {k.name[:20]:20} {k.tier:9} {k.rpm:>6} {k.tpm:>9} {k.max_concurrent:>5} "
                      f"{k.priority_ceiling:>7} {created:20} {'yes' if k.revoked else 'no'}")
        elif args.keys_command == "revoke":
            if not await store.revoke(args.prefix):
                print(f"sluice keys revoke: no key with prefix {args.prefix!r}", file=sys.stderr)
                return 1
            await _replicated(redis, args.redis_url)
            print(f"revoked {args.prefix}")
        target = args.file if args.keys_command == "export" else getattr(args, "keys_file", None)
        if target:
            count = save_records(target, await store.records())
            print(f"# {target}: {count} key record(s); gateways that load it take the change within a second",
                  file=sys.stderr)
        return 0
    finally:
        if redis is not pool:
            await redis.aclose()
        await pool.aclose()
