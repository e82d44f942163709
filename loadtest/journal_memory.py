"""What one long resumable stream keeps in Redis: its journal's bytes per event, the
keys' total, and how long they are kept once the stream finished.

One stack (sluice/commands/bench_stack.py: embedded Redis, one sim worker, one gateway), one chat stream with an
``Idempotency-Key`` of ``--tokens`` tokens (greedy, ``ignore_eos``), then ``MEMORY USAGE``
of its journal and its other keys, and Redis's ``used_memory`` before and after.

    .venv/bin/python loadtest/journal_memory.py --tokens 24000     # ~20 s on 2 cores
"""

from __future__ import annotations

import argparse
import tempfile
import uuid
from pathlib import Path

import httpx
import redis

from gateway.streams.idempotency import scoped
from sluice import keys
from sluice.commands.bench_stack import MODEL, Stack, StackShape


def measure(tokens: int) -> str:
    shape = StackShape(gateways=1, workers=1, worker_args=["--sim-token-ms=0", "--sim-ttft-ms=0"])
    with tempfile.TemporaryDirectory() as logs, Stack(shape, Path(logs)) as stack:
        client = redis.Redis.from_url(stack.redis_url)
        before = int(client.info("memory")["used_memory"])
        key = uuid.uuid4().hex
        body = {"model": MODEL, "messages": [{"role": "user", "content": "tell a long story"}],
                "max_tokens": tokens, "ignore_eos": True, "stream": True}
        events = 0
        with httpx.stream("POST", stack.gateway_urls[0] + "/v1/chat/completions", json=body,
                          headers={"Idempotency-Key": key}, timeout=600) as r:
            for line in r.iter_lines():
                events += line.startswith("data: ")
        journal = keys.journal(scoped("-", key))
        size = int(client.memory_usage(journal, samples=0) or 0)
        entries = int(client.xlen(journal))
        others = sum(int(client.memory_usage(k, samples=0) or 0) for k in client.keys(journal + ":*"))
        grown = int(client.info("memory")["used_memory"]) - before
        kept_s = client.pttl(journal) / 1000
        client.close()
    return (f"events {events}, journal entries {entries}: {size} B ({size / max(1, entries):.1f} B per "
            f"entry, {size / max(1, events):.1f} B per event); other keys {others} B; Redis used_memory "
            f"+{grown / 1e6:.2f} MB; kept {kept_s:.0f} s after the stream finished")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=24_000)
    print(measure(parser.parse_args().tokens))


if __name__ == "__main__":
    main()
