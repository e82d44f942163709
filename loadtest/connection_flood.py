"""What one client's connections can hold of a gateway process, while others stream.

Starts a private stack (embedded Redis, one sim worker, one gateway process), then, for
``--seconds``: ``--holders`` attacker processes each open ``--per-holder`` connections to the
gateway (each process is bounded by its own descriptor limit), while ``--streams`` threads of
the ``openai`` SDK (no retries) stream 20-token chats in a loop (everyone else). The attack:

- ``idle``: connections that send nothing;
- ``trickle``: requests that never finish coming: a head, then a body byte every 2 s, each
  connection reopened when the gateway closes it;
- ``unread``: requests for a 10.7 MB answer (``n=16``, 500 tokens, ``top_logprobs=20``) whose
  client reads nothing, a new one each second per holder.

Every half second it reads the gateway's open descriptors and RSS and asks ``GET /v1/models``.
Prints what the streams got, the gateway's peak and last RSS, and the probes' worst.

    .venv/bin/python loadtest/connection_flood.py                 # idle, ~40 s
    .venv/bin/python loadtest/connection_flood.py --attack trickle --per-holder 300 --max-connections 200
    .venv/bin/python loadtest/connection_flood.py --attack unread --holders 1 --per-holder 60 --seconds 70
    cd <a checkout> && PYTHONPATH=. <this venv>/bin/python <this file>    # that code's gateway

(sluice/connection_bounds.py says what the gateway does at its bounds.)
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import orjson

from sluice.commands.bench_probe import rss_mib
from sluice.commands.bench_stack import Stack, StackShape
from sluice.connection_bounds import descriptors


BIG_ANSWER = orjson.dumps({"model": "sim", "messages": [{"role": "user", "content": "x"}], "n": 16,
                           "max_tokens": 500, "ignore_eos": True, "logprobs": True, "top_logprobs": 20})


def _open(address: tuple[str, int], attack: str) -> socket.socket:
    sock = socket.socket()
    sock.settimeout(5)
    if attack == "unread":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address)
    if attack == "trickle":
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
    elif attack == "unread":
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(BIG_ANSWER), BIG_ANSWER))
    return sock


def hold(url: str, attack: str, count: int, seconds: float, opened: multiprocessing.Queue) -> None:
    """Open ``count`` connections and keep them (idle: those the server closes stay closed;
    trickle: each is reopened; unread: one opened a second)."""
    descriptors()  # as many as this process may have
    parts = urlsplit(url)
    address = (parts.hostname or "127.0.0.1", parts.port or 80)
    held: list[socket.socket] = []
    made = failed = 0
    until = time.monotonic() + seconds

    def one() -> None:
        nonlocal made, failed
        try:
            held.append(_open(address, attack))
            made += 1
        except OSError:
            failed += 1

    if attack == "unread":
        while time.monotonic() < until and made + failed < count:
            one()
            time.sleep(1)
    else:
        for _ in range(count):
            one()
    while attack == "trickle" and time.monotonic() < until:
        for i, sock in enumerate(held):
            try:
                sock.sendall(b" ")
            except OSError:  # closed by the gateway: another in its place
                sock.close()
                try:
                    held[i] = _open(address, attack)
                    made += 1
                except OSError:
                    failed += 1
        time.sleep(2)
    opened.put((made, failed))
    time.sleep(max(0.0, until - time.monotonic()))
    for sock in held:
        sock.close()


def stream_loop(url: str, until: float, results: dict[str, int], errors: list[str]) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    while time.monotonic() < until:
        try:
            stream = client.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=20, stream=True)
            if "".join(c.choices[0].delta.content or "" for c in stream if c.choices):
                results["ok"] += 1
        except openai.OpenAIError as exc:
            results["failed"] += 1
            errors.append(repr(exc)[:120])
        time.sleep(0.05)
    client.close()


def sample(pid: int, url: str, until: float, peak: dict[str, float]) -> None:
    with httpx.Client(timeout=10) as http:
        while time.monotonic() < until:
            fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
            rss = rss_mib(pid) or 0.0
            began = time.monotonic()
            try:
                ok = http.get(url + "/v1/models").status_code == 200
            except httpx.HTTPError:
                ok = False
            peak["fds"] = max(peak["fds"], fds)
            peak["rss_mb"] = max(peak["rss_mb"], rss)
            peak["last_rss_mb"] = rss
            peak["probe_s"] = max(peak["probe_s"], time.monotonic() - began)
            peak["probes_failed"] += not ok
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attack", choices=("idle", "trickle", "unread"), default="idle")
    parser.add_argument("--holders", type=int, default=2, help="attacker processes")
    parser.add_argument("--per-holder", type=int, default=12_000, help="connections each opens")
    parser.add_argument("--streams", type=int, default=16, help="SDK threads streaming meanwhile")
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--max-connections", type=int, default=None,
                        help="SLUICE_GATEWAY_MAX_CONNECTIONS (default: the gateway's)")
    args = parser.parse_args()
    env = {} if args.max_connections is None else {"SLUICE_GATEWAY_MAX_CONNECTIONS": str(args.max_connections)}
    with tempfile.TemporaryDirectory() as logs, Stack(StackShape(gateways=1, workers=1, gateway_env=env),
                                                     Path(logs)) as stack:
        url, pid = stack.gateway_urls[0], stack.gateways[0].pid
        limit = int(next(line for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
                         if line.startswith("Max open files")).split()[3])
        until = time.monotonic() + args.seconds
        opened: multiprocessing.Queue = multiprocessing.Queue()
        holders = [multiprocessing.Process(target=hold, args=(url, args.attack, args.per_holder, args.seconds, opened))
                   for _ in range(args.holders)]
        results, errors = {"ok": 0, "failed": 0}, []
        peak = {"fds": 0, "rss_mb": 0.0, "last_rss_mb": 0.0, "probe_s": 0.0, "probes_failed": 0}
        threads = [threading.Thread(target=stream_loop, args=(url, until, results, errors))
                   for _ in range(args.streams)]
        threads.append(threading.Thread(target=sample, args=(pid, url, until, peak)))
        for worker in holders + threads:
            worker.start()
        for worker in holders + threads:
            worker.join()
        counts = [opened.get() for _ in holders]
        print(f"gateway descriptors limit {limit}; attacker ({args.attack}): {sum(c[0] for c in counts)} "
              f"connections opened, "
              f"{sum(c[1] for c in counts)} failed to open")
        print(f"gateway peak: {peak['fds']} descriptors, {peak['rss_mb']:.0f} MB RSS (at the end "
              f"{peak['last_rss_mb']:.0f}); GET /v1/models: "
              f"{peak['probes_failed']} failed, slowest {peak['probe_s'] * 1000:.0f} ms")
        total = results["ok"] + results["failed"]
        print(f"the others' streams: {results['ok']} of {total} whole, {results['failed']} failed "
              f"{sorted(set(errors))[:3]}")


if __name__ == "__main__":
    main()
