"""One client's idle connections against a gateway process, and the streams of the others.

Starts a private stack (embedded Redis, one sim worker, one gateway process), then, for
``--seconds``: ``--holders`` processes each open ``--per-holder`` TCP connections to the
gateway and send nothing (the attacker: each process is bounded by its own descriptor limit),
while ``--streams`` threads of the ``openai`` SDK (no retries) stream 20-token chats in a loop
(everyone else). Every half second it reads the gateway's open descriptors and RSS and asks
``GET /v1/models``. Prints what the streams got, the gateway's peak, and the probes' worst.

    .venv/bin/python loadtest/connection_flood.py                 # ~40 s
    cd <a checkout> && PYTHONPATH=. <this venv>/bin/python <this file>    # that code's gateway

(sluice/connection_bounds.py says what the gateway does at its bound.)
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import socket
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai

from sluice.commands.bench_stack import Stack, StackShape


def hold(url: str, count: int, seconds: float, opened: multiprocessing.Queue) -> None:
    """Open ``count`` connections and keep them (those the server closes stay closed)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    parts = urlsplit(url)
    held, failed = [], 0
    until = time.monotonic() + seconds
    for _ in range(count):
        try:
            held.append(socket.create_connection((parts.hostname, parts.port), timeout=5))
        except OSError:
            failed += 1
    opened.put((len(held), failed))
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
            rss = int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
            began = time.monotonic()
            try:
                ok = http.get(url + "/v1/models").status_code == 200
            except httpx.HTTPError:
                ok = False
            peak["fds"] = max(peak["fds"], fds)
            peak["rss_mb"] = max(peak["rss_mb"], rss)
            peak["probe_s"] = max(peak["probe_s"], time.monotonic() - began)
            peak["probes_failed"] += not ok
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--holders", type=int, default=2, help="attacker processes")
    parser.add_argument("--per-holder", type=int, default=12_000, help="idle connections each opens")
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
        holders = [multiprocessing.Process(target=hold, args=(url, args.per_holder, args.seconds, opened))
                   for _ in range(args.holders)]
        results, errors = {"ok": 0, "failed": 0}, []
        peak = {"fds": 0, "rss_mb": 0.0, "probe_s": 0.0, "probes_failed": 0}
        threads = [threading.Thread(target=stream_loop, args=(url, until, results, errors))
                   for _ in range(args.streams)]
        threads.append(threading.Thread(target=sample, args=(pid, url, until, peak)))
        for worker in holders + threads:
            worker.start()
        for worker in holders + threads:
            worker.join()
        counts = [opened.get() for _ in holders]
        print(f"gateway descriptors limit {limit}; attacker: {sum(c[0] for c in counts)} connections opened, "
              f"{sum(c[1] for c in counts)} failed to open")
        print(f"gateway peak: {peak['fds']} descriptors, {peak['rss_mb']:.0f} MB RSS; GET /v1/models: "
              f"{peak['probes_failed']} failed, slowest {peak['probe_s'] * 1000:.0f} ms")
        total = results["ok"] + results["failed"]
        print(f"the others' streams: {results['ok']} of {total} whole, {results['failed']} failed "
              f"{sorted(set(errors))[:3]}")


if __name__ == "__main__":
    main()
