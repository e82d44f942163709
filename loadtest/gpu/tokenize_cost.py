"""What the precise index costs the gateway per request, two ways (CPU seconds of this process).

- ``gateway``: the gateway tokenizes (chat template + tokenizer, as the worker does) and
  hashes the token blocks (gateway/admission/prompt_tokens.py, sluice/prefix_tokens.py);
- ``endpoint``: the gateway asks the worker for the token ids instead: its share is one
  HTTP round trip on its pooled client and the ids' JSON (measured here against a
  loopback server in another process that answers with the same ids), and the worker
  then spends the ``gateway`` figure's tokenization in its place;
- ``approx``: today's word blocks (sluice/prefix.py), for scale.

    python -m loadtest.gpu.tokenize_cost --tokenizer ~/.cache/sluice/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson

from gateway.admission.prompt_tokens import PromptTokenizer
from gateway.admission.routing import PromptPrefix
from loadtest.gpu.workloads import text
from sluice.embedded_redis import free_port

_SERVER = r"""
import asyncio, sys
body = open(sys.argv[2], 'rb').read()
head = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n' % len(body)
async def handle(reader, writer):
    while True:
        line = await reader.readline()
        if not line:
            break
        length = 0
        while line not in (b'\r\n', b''):
            if line.lower().startswith(b'content-length:'):
                length = int(line.split(b':')[1])
            line = await reader.readline()
        await reader.readexactly(length)
        writer.write(head + body)
        await writer.drain()
async def main():
    server = await asyncio.start_server(handle, '127.0.0.1', int(sys.argv[1]))
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


def per_call_us(fn: object, payloads: list[dict[str, object]]) -> float:
    started = time.process_time()
    for p in payloads:
        fn(p)  # type: ignore[operator]
    return 1e6 * (time.process_time() - started) / len(payloads)


async def endpoint_us(payloads: list[dict[str, object]], ids: list[int], scratch: Path) -> float:
    answer = scratch / "ids.json"
    answer.write_bytes(orjson.dumps({"ids": ids}))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), str(answer)])
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(50):
                try:
                    await http.post(f"http://127.0.0.1:{port}/tokenize", content=b"{}")
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)
            started = time.process_time()
            for p in payloads:
                response = await http.post(f"http://127.0.0.1:{port}/tokenize", content=orjson.dumps(p))
                PromptPrefix.of_tokens(orjson.loads(response.content)["ids"])
            return 1e6 * (time.process_time() - started) / len(payloads)
    finally:
        server.kill()
        server.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--prefix-words", type=int, default=1000)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--out", default="")
    args = p.parse_args()
    rng = random.Random(3)
    system = text(rng, args.prefix_words)
    payloads = [{"messages": [{"role": "system", "content": system},
                              {"role": "user", "content": text(rng, 24) + "?"}]} for _ in range(args.requests)]
    tokenizer = PromptTokenizer(args.tokenizer)
    ids = tokenizer.ids_now(payloads[0]) or []
    row = {
        "prompt_tokens": len(ids), "prompt_words": args.prefix_words + 24,
        "gateway_tokenize_and_hash_us": round(per_call_us(
            lambda q: PromptPrefix.of_tokens(tokenizer.ids_now(q) or []), payloads), 1),
        "approx_word_blocks_us": round(per_call_us(PromptPrefix.of, payloads), 1),
        "endpoint_gateway_share_us": round(asyncio.run(endpoint_us(payloads, ids, Path("/tmp"))), 1),
    }
    row["endpoint_total_us"] = round(row["endpoint_gateway_share_us"] + row["gateway_tokenize_and_hash_us"], 1)
    print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
