"""Cache-aware routing on the real engine: 2 vLLM CPU workers, cache vs least loaded.

Each arm starts its own stack (embedded Redis, 2 ``sluice worker --engine vllm`` with
the default model and a small KV cache each, 1 gateway), sends the same shared-prefix
workload, and prints TTFT and the engines' hit rate (``cached_tokens / prompt_tokens``
from every response's usage). The groups' prefixes together overflow one worker's KV
cache but fit the two: routing by prefix keeps each group on one worker, least loaded
spreads every group over both and each worker's cache churns.

    flock /tmp/sluice-heavy.lock .venv/bin/python loadtest/prefix_vllm.py     # ~6 min on 2 cores

Each vLLM worker takes about a minute to start and ~3 GB of memory.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from sluice.commands.bench_prefix import Client, Messages, Tally, _closed
from sluice.commands.bench_report import quantile, table
from sluice.commands.bench_stack import Stack, StackShape

#: Common English words, about one token each with the default model's tokenizer (so the
#: gateway's blocks of 64 words are about 64 tokens, as with real text).
WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "his", "they", "be",
         "at", "one", "have", "this", "from", "or", "had", "by", "hot", "word", "but", "what", "some", "we",
         "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an",
         "each", "she", "which", "do", "their", "time", "if", "will", "way", "about", "many", "then", "them",
         "write", "would", "like", "so", "these", "her", "long", "make", "thing", "see", "him", "two", "has",
         "look", "more", "day", "could", "go", "come", "did", "number", "sound", "no", "most", "people",
         "my", "over", "know", "water", "than", "call", "first", "who", "may", "down", "side", "been", "now",
         "find", "any", "new", "work", "part", "take", "get", "place", "made", "live", "where", "after",
         "back", "little", "only", "round", "man", "year", "came", "show", "every", "good", "me", "give",
         "our", "under", "name", "very", "through", "just", "form", "sentence", "great", "think", "say",
         "help", "low", "line", "differ", "turn", "cause", "much", "mean", "before", "move", "right", "boy",
         "old", "too", "same", "tell", "does", "set", "three", "want", "air", "well", "also", "play",
         "small", "end", "put", "home", "read", "hand", "port", "large", "spell", "add", "even", "land",
         "here", "must", "big", "high", "such", "follow", "act", "why", "ask", "men", "change", "went",
         "light", "kind", "off", "need", "house")


def _text(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def workload(args: argparse.Namespace) -> list[Messages]:
    """Groups x rounds: each group's long system prompt, then a short question; shuffled per round."""
    prefixes = [_text(random.Random(g), args.prefix_words) for g in range(args.groups)]
    rng = random.Random(7)
    prompts = []
    for r in range(args.rounds):
        order = list(range(args.groups))
        rng.shuffle(order)
        prompts += [[{"role": "system", "content": prefixes[g]},
                     {"role": "user", "content": f"Question {r}: " + _text(rng, 12)}] for g in order]
    return prompts


async def run_arm(routing: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    worker_args = ["--engine", "vllm", f"--vllm-kv-cache-gib={args.kv_cache_gib}",
                   f"--vllm-max-num-seqs={args.max_num_seqs}", "--served-model-name", "sim"]
    env = {"SLUICE_GATEWAY_ROUTING": routing, "SLUICE_GATEWAY_QUEUE_TIMEOUT_S": "600",
           "SLUICE_GATEWAY_TTFT_TIMEOUT_S": "300"}
    stack = Stack(StackShape(gateways=1, workers=2, gateway_env=env, worker_args=worker_args),
                  logs, label=f"vllm-{routing}")
    try:
        stack.start(timeout_s=600)
        async with httpx.AsyncClient(timeout=600) as http:
            client = Client(http, stack.gateway_urls, args.max_tokens)
            # Warm-up, not counted: one request per worker (two at once go to both workers).
            await asyncio.gather(*(client.chat([{"role": "user", "content": f"Warm up {i}."}]) for i in range(2)))
            client.tally = Tally()
            started = time.perf_counter()
            await _closed(client, workload(args), args.concurrency)
            wall = time.perf_counter() - started
    finally:
        stack.close()
    t = client.tally
    return {"arm": f"vllm {routing}", "requests": len(t.ttfts), "errors": t.errors,
            "prompt_tok_avg": t.prompt / max(len(t.ttfts), 1),
            "ttft_p50_ms": quantile(t.ttfts, 0.5) * 1000, "ttft_p90_ms": quantile(t.ttfts, 0.9) * 1000,
            "hit_pct": 100 * t.cached / max(t.prompt, 1), "out_tok_s": t.completion / wall, "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--routings", default="least,cache")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefix-words", type=int, default=800, help="words of each group's system prompt")
    p.add_argument("--kv-cache-gib", type=float, default=0.25,
                   help="each worker's KV cache (float32 SmolLM2-135M: ~45 KB per token, 0.25 GiB ~ 5,800 tokens)")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="sluice-prefix-vllm-"))
    print(f"2 vLLM CPU workers, KV cache {args.kv_cache_gib} GiB each; {args.groups} groups x {args.rounds} rounds, "
          f"{args.prefix_words}-word prefixes; logs under {logs}", flush=True)
    rows = []
    for routing in args.routings.split(","):
        rows.append(asyncio.run(run_arm(routing, args, logs)))
        print(table(rows[-1:]), flush=True)
    print("\n" + table(rows))
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
