"""What one request body costs a gateway's event loop, by its shape.

A body is read, parsed and validated on the gateway process's one event loop, so its CPU is
time every stream of that process waits. The body's byte limit (4 MiB) bounds its size, not
its shape: a body of many small arrays or objects costs the parser and the validator
microseconds each. Starts a private stack (embedded Redis, one sim worker, one gateway
process), sends each shape ``--requests`` times one after the other, and prints the wall
time, the gateway's CPU per request (from /proc) and the statuses.

    .venv/bin/python loadtest/body_cost.py                  # ~10 s on this code
    cd <worktree> && PYTHONPATH=. <venv>/bin/python <this file>   # another code, same shapes
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from sluice.commands.bench_probe import cpu_s
from sluice.commands.bench_stack import Stack, StackShape

SHAPES = {
    "500k one-token prompts (2 MB)":
        b'{"model":"sim","max_tokens":1,"prompt":[' + b",".join([b"[1]"] * 500_000) + b"]}",
    "100k content parts (3.9 MB)": orjson.dumps({"model": "sim", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}]}),
    "130k messages (3.9 MB)": orjson.dumps({"model": "sim", "max_tokens": 1,
                                            "messages": [{"role": "user", "content": "a"}] * 130_000}),
    "one 3.9 MB text prompt": orjson.dumps({"model": "sim", "max_tokens": 1,
                                            "messages": [{"role": "user", "content": "[a], {b} " * 430_000}]}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8, help="requests per shape")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs, Stack(StackShape(gateways=1, workers=1), Path(logs)) as stack:
        url = stack.gateway_urls[0]
        pid = stack.gateways[0].pid
        with httpx.Client(timeout=300) as http:
            for name, body in SHAPES.items():
                path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
                before, started = cpu_s(pid) or 0.0, time.monotonic()
                statuses = sorted({http.post(url + path, content=body,
                                             headers={"content-type": "application/json"}).status_code
                                   for _ in range(args.requests)})
                spent = ((cpu_s(pid) or 0.0) - before) / args.requests
                print(f"{name:<32} {args.requests} requests in {time.monotonic() - started:6.2f} s, gateway CPU "
                      f"{spent * 1000:6.0f} ms a request, statuses {statuses}")


if __name__ == "__main__":
    main()
