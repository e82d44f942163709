"""What one client can grow: gateway memory and Redis state after requests that name things.

Starts a private stack (embedded Redis, one sim worker, one gateway process), then sends,
one phase after another: requests with 1 MB model names, requests naming invented models,
and invented names asked of ``GET /v1/models/{name}``. After each phase it prints the
gateway's RSS, Redis's ``used_memory`` and its key count, and what the requests got.

    .venv/bin/python loadtest/client_growth.py            # ~20 s
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import httpx

from sluice.commands.bench_stack import Stack, StackShape, sync_client


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big", type=int, default=30, help="requests with a 1 MB model name")
    parser.add_argument("--invented", type=int, default=200, help="requests naming invented models")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs, Stack(StackShape(gateways=1, workers=1), Path(logs)) as stack:
        client = sync_client(stack.redis_url)
        url = stack.gateway_urls[0]
        pid = stack.gateways[0].pid
        http = httpx.Client(timeout=120)
        assert http.post(url + "/v1/completions", json={"model": "sim", "prompt": "warm", "max_tokens": 2}).status_code == 200

        def report(phase: str, statuses: collections.Counter[int]) -> None:
            memory = client.info("memory")["used_memory"] / 2**20
            print(f"{phase:<34} gateway RSS {rss_mb(pid):7.1f} MB   Redis {memory:6.1f} MB, "
                  f"{client.dbsize():4d} keys   statuses {dict(statuses)}")

        report("after start and one request", collections.Counter())
        big = "m" * 2**20
        statuses = collections.Counter(
            http.post(url + "/v1/completions", json={"model": f"{big}{i}", "prompt": "x", "max_tokens": 2}).status_code
            for i in range(args.big))
        report(f"{args.big} x 1 MB model names", statuses)
        statuses = collections.Counter(
            http.post(url + "/v1/completions", json={"model": f"invented-{i}", "prompt": "x"}).status_code
            for i in range(args.invented))
        report(f"{args.invented} invented models", statuses)
        statuses = collections.Counter(http.get(f"{url}/v1/models/invented-{i}").status_code
                                       for i in range(args.invented))
        report(f"{args.invented} x GET /v1/models/<invented>", statuses)
        http.close()
        client.close()


if __name__ == "__main__":
    main()
