"""What one request body costs a gateway's event loop, by its shape.

A body is read, parsed, validated (and, with a tokenizer, tokenized) in the gateway process
whose one event loop serves every stream of the process: what it holds that loop for, they
wait. The body's byte limit (4 MiB) bounds its size, not its shape: a body of many small
arrays or objects costs the parser and the validator microseconds each, a long prompt the
tokenizer about 0.6 µs a character. Starts a private stack (embedded Redis, one sim worker,
one gateway process; ``--tokenizer``: the gateway tokenizes prompts with the default model's
tokenizer, as ``sluice up`` does with vLLM), keeps one bystander stream reading throughout
(in a process of its own), sends each shape ``--requests`` times one after the other, and prints the wall time, the
gateway's CPU per request (from /proc), the statuses, and the bystander's longest gap between
two chunks meanwhile (its tokens come every 5 ms). ``--embed``: answers instead of bodies, an
embeddings request of ``--embed-inputs`` inputs to a simulated model 4,096 wide (~80 KB of
answer an input as floats, passed through the gateway).

    .venv/bin/python loadtest/body_cost.py [--tokenizer]     # ~15 s on this code
    .venv/bin/python loadtest/body_cost.py --embed --embed-inputs 1024
    cd <worktree> && PYTHONPATH=. <venv>/bin/python <this file>   # another code, same shapes
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson

from sluice.commands.bench_probe import cpu_s
from sluice.commands.bench_stack import Stack, StackShape
from sluice.models import default_model_dir

SHAPES: dict[str, bytes | Callable[[int], bytes]] = {
    "500k one-token prompts (2 MB)":
        b'{"model":"sim","max_tokens":1,"prompt":[' + b",".join([b"[1]"] * 500_000) + b"]}",
    "100k content parts (3.9 MB)": orjson.dumps({"model": "sim", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}]}),
    "130k messages (3.9 MB)": orjson.dumps({"model": "sim", "max_tokens": 1,
                                            "messages": [{"role": "user", "content": "a"}] * 130_000}),
    "one 3.9 MB text prompt": orjson.dumps({"model": "sim", "max_tokens": 1,
                                            "messages": [{"role": "user", "content": "[a], {b} " * 430_000}]}),
    "one 1M-character prompt (served)": lambda i: _long_prompt(""),
    "a new 1M-character prompt each time": lambda i: _long_prompt(f"{i} {time.time()} "),
}


def _long_prompt(head: str) -> bytes:
    text = head + "The gate opens at dawn for boats, 1234. " * 25_000
    return orjson.dumps({"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": text[:999_000]}]})


class Bystander:
    """One long stream read throughout, in a process of its own (the client reading a large
    answer in this one would hold the interpreter, and the chunks' arrival times with it):
    the arrival time of each chunk (``time.monotonic``: one clock for every process)."""

    def __init__(self, url: str, times: Path) -> None:
        self._times = times
        self._proc = subprocess.Popen([sys.executable, __file__, "--bystander", url, str(times)])

    @staticmethod
    def run(url: str, times: Path) -> None:
        body = {"model": "sim", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 30_000,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=600) as http, times.open("w", buffering=1) as out:
            while True:
                with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_lines():
                        out.write(f"{time.monotonic()}\n")

    def longest_gap_s(self, since: float, until: float) -> float:
        arrivals = [float(t) for t in self._times.read_text().split()]
        times = [t for t in arrivals if since <= t <= until]
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8, help="requests per shape")
    parser.add_argument("--tokenizer", action="store_true",
                        help="the gateway tokenizes prompts (SLUICE_GATEWAY_TOKENIZER: the default model's)")
    parser.add_argument("--embed", action="store_true", help="embeddings answers instead of bodies")
    parser.add_argument("--embed-inputs", type=int, default=1024, help="inputs of each embeddings request")
    parser.add_argument("--bystander", nargs=2, metavar=("URL", "TIMES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bystander:
        Bystander.run(args.bystander[0], Path(args.bystander[1]))
        return
    env = {"SLUICE_GATEWAY_TOKENIZER": str(default_model_dir())} if args.tokenizer else {}
    shape = StackShape(gateways=1, workers=1, gateway_env=env)
    with tempfile.TemporaryDirectory() as logs, Stack(shape, Path(logs)) as stack:
        url = stack.gateway_urls[0]
        pid = stack.gateways[0].pid
        shapes = SHAPES
        if args.embed:
            stack.add_worker("--served-model-name", "wide", "--task", "embed", "--sim-embed-dim", "4096")
            shapes = {f"embeddings of {args.embed_inputs:,} x 4,096, {encoding}": orjson.dumps(
                {"model": "wide", "input": ["the quick brown fox"] * args.embed_inputs, "encoding_format": encoding})
                for encoding in ("float", "base64")}
        bystander = Bystander(url, Path(logs) / "bystander.times")
        with httpx.Client(timeout=300) as http:
            time.sleep(1.0)
            for name, shape in shapes.items():
                bodies = [shape(i) if callable(shape) else shape for i in range(args.requests)]
                path = "/v1/embeddings" if args.embed else \
                    "/v1/completions" if b'"prompt"' in bodies[0] else "/v1/chat/completions"
                before, started = cpu_s(pid) or 0.0, time.monotonic()
                statuses = sorted({http.post(url + path, content=body,
                                             headers={"content-type": "application/json"}).status_code
                                   for body in bodies})
                ended = time.monotonic()
                spent = ((cpu_s(pid) or 0.0) - before) / args.requests
                print(f"{name:<34} {args.requests} requests in {ended - started:6.2f} s, gateway CPU "
                      f"{spent * 1000:6.0f} ms a request, statuses {statuses}, the bystander's longest gap "
                      f"{bystander.longest_gap_s(started, ended) * 1000:5.0f} ms")
        bystander.stop()


if __name__ == "__main__":
    main()
