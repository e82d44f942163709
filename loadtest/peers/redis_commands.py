"""Redis commands one streamed request sends, plain and resumable (Idempotency-Key), counted
exactly with ``MONITOR`` on a private stack (one gateway, one sim worker, one Redis).

Timings on a shared 2-core machine move by milliseconds between runs; the commands a request
sends do not. Requests run one at a time, each left a moment to settle (a resumable stream
lets go of its key and its journal memory after its end). Commands a script runs inside
Redis are not counted, only what the gateway sends. Two counts per request:

- ``keyed``: commands naming the request's own keys (its Idempotency-Key's record and
  journal, ``sl:{journals}``' quota): exact;
- ``all``: every command in the window, less what the same stack sends while idle for as
  long (heartbeats, the loss watch's looks, lease renewals): exact up to that background.

    .venv/bin/python loadtest/peers/redis_commands.py --requests 50

It counts the checkout it is in (its stack runs that checkout's code).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import importlib
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's code, here and in the stack's processes
os.environ["PYTHONPATH"] = str(ROOT)

from gateway.streams.idempotency import scoped  # noqa: E402
from sluice.commands.bench_stack import MODEL, Stack, StackShape  # noqa: E402

_STOP = "redis-commands-stop"


class Monitor:
    """Every command Redis receives from a client (not from a script), with the time seen."""

    def __init__(self, url: str) -> None:
        self._url = url
        self.seen: list[tuple[float, str, list[str]]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()

    def __enter__(self) -> Monitor:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        client = redis.Redis.from_url(self._url)
        client.echo(_STOP)
        client.close()
        self._thread.join(10)

    def _run(self) -> None:
        client = redis.Redis.from_url(self._url)
        with client.monitor() as monitor:
            self._ready.set()
            for entry in monitor.listen():
                words = entry["command"].split(" ")
                if entry.get("client_type") == "lua":
                    continue
                if words[0].upper() == "ECHO" and _STOP in entry["command"]:
                    return
                self.seen.append((time.monotonic(), words[0].upper(), words[1:]))

    def window(self, start: float, end: float) -> list[tuple[str, list[str]]]:
        return [(name, args) for at, name, args in self.seen if start <= at < end]


def _body(i: int, tokens: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"count {i}"}], "max_tokens": tokens,
            "ignore_eos": True, "stream": True}


def _run(client: httpx.Client, n: int, tokens: int, keyed: bool, settle_s: float) -> list[str]:
    scopes = []
    for i in range(n):
        headers = {}
        if keyed:
            key = uuid.uuid4().hex
            headers["Idempotency-Key"] = key
            scopes.append(scoped("-", key))
        with client.stream("POST", "/v1/chat/completions", json=_body(i, tokens), headers=headers) as resp:
            assert resp.status_code == 200, resp.status_code
            for _ in resp.iter_lines():
                pass
        time.sleep(settle_s)
    return scopes


def _scripts() -> dict[str, str]:
    """SHA1 -> name of every Lua script in the gateway's and sluice's modules."""
    names = {}
    for path in [*(ROOT / "gateway").rglob("*.py"), *(ROOT / "sluice").rglob("*.py")]:
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for name, value in vars(module).items():
            if isinstance(value, str) and "redis.call" in value:
                names[hashlib.sha1(value.encode()).hexdigest()] = f"{path.stem}.{name}"
    return names


_SCRIPTS: dict[str, str] = {}


def _count(commands: list[tuple[str, list[str]]]) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for name, args in commands:
        if name == "EVALSHA" and args:
            sha = args[0].strip('"')[:40]
            name = _SCRIPTS.get(sha, "EVALSHA " + sha[:10])
        counts[name] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--settle-s", type=float, default=0.2)
    args = parser.parse_args()
    _SCRIPTS.update(_scripts())
    shape = StackShape(gateways=1, workers=1, worker_args=["--sim-token-ms=1", "--sim-ttft-ms=0"])
    with tempfile.TemporaryDirectory() as logs, Stack(shape, Path(logs), "count") as stack, \
            httpx.Client(base_url=stack.gateway_urls[0], timeout=60) as client:
        _run(client, 5, args.tokens, True, args.settle_s)  # scripts loaded, connections open
        _run(client, 5, args.tokens, False, args.settle_s)
        with Monitor(stack.redis_url) as monitor:
            windows = {}
            for path in ("plain", "resumable", "idle"):
                start = time.monotonic()
                if path == "idle":
                    time.sleep(max(windows["plain"][1], windows["resumable"][1]))
                    scopes: list[str] = []
                else:
                    scopes = _run(client, args.requests, args.tokens, path == "resumable", args.settle_s)
                end = time.monotonic()
                windows[path] = (start, end - start, scopes)
        idle_start, idle_s, _ = windows["idle"]
        idle = _count(monitor.window(idle_start, idle_start + idle_s))
        print(f"per request, {args.requests} requests of {args.tokens} tokens each path; idle {idle_s:.1f} s: "
              f"{sum(idle.values())} commands")
        for path in ("plain", "resumable"):
            start, length, scopes = windows[path]
            commands = monitor.window(start, start + length)
            counts = _count(commands)
            background = {name: count * length / idle_s for name, count in idle.items()}
            total = (sum(counts.values()) - sum(background.values())) / args.requests
            tags = ["{" + scope + "}" for scope in scopes] + ["{journals}"]
            keyed = [(name, a) for name, a in commands if any(tag in " ".join(a) for tag in tags)]
            print(f"  {path:<10} all {total:.2f}   keyed {len(keyed) / args.requests:.2f}")
            for name in sorted(set(counts) | set(background)):
                extra = (counts[name] - background.get(name, 0.0)) / args.requests
                if abs(extra) >= 0.05:
                    print(f"      {name:<14} {extra:6.2f}")
            if keyed:
                for name, count in sorted(_count(keyed).items()):
                    print(f"      keyed {name:<8} {count / args.requests:6.2f}")


if __name__ == "__main__":
    main()
