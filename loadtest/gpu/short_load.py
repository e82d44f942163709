"""Short requests at one OpenAI-compatible URL, read by ``loadtest/peers/load.py``'s client (every
body read to its end, each loop's connection kept), spread over several processes so that the
client is not the bound; one JSON line per load with each process's own CPU beside the figures.

    python3 loadtest/gpu/short_load.py URL MODEL --tag direct --levels 64,256 --max-tokens 1

Written for loadtest/gpu/short.sh (on the GPU machine: the kit's lg.py read p99s of 1.3-2.4 s
there that its own CPU may have caused, loadtest/gpu/h100-2026-12-06-short/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.peers.load import percentile, run  # noqa: E402


def _one(url: str, model: str, streams: int, warmup_s: float, measure_s: float, max_tokens: int,
         start_at: float, out: "multiprocessing.Queue[dict[str, object]]") -> None:
    time.sleep(max(0.0, start_at - time.time()))
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    win = asyncio.run(run(url, model, streams, warmup_s, measure_s, max_tokens, keep_alive=True))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    out.put({"requests": win.requests, "chunks": win.chunks, "ttfts": win.ttfts, "errors": win.errors,
             "error_kinds": win.error_kinds, "client_cpu_share": cpu_s / (warmup_s + measure_s)})


def load(url: str, model: str, streams: int, procs: int, warmup_s: float, measure_s: float,
         max_tokens: int) -> dict[str, object]:
    out: multiprocessing.Queue[dict[str, object]] = multiprocessing.Queue()
    start_at = time.time() + 1.0
    workers = [multiprocessing.Process(target=_one, args=(url, model, streams // procs, warmup_s, measure_s,
                                                          max_tokens, start_at, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    parts = [out.get() for _ in workers]
    for w in workers:
        w.join()
    ttfts = [t for p in parts for t in p["ttfts"]]  # type: ignore[union-attr]
    kinds: dict[str, int] = {}
    for p in parts:
        for k, n in p["error_kinds"].items():  # type: ignore[union-attr]
            kinds[k] = kinds.get(k, 0) + n
    p50, p99 = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
    return {"streams": streams, "procs": procs, "max_tokens": max_tokens, "measure_s": measure_s,
            "req_per_s": round(sum(p["requests"] for p in parts) / measure_s, 1),  # type: ignore[misc]
            "chunks_per_s": round(sum(p["chunks"] for p in parts) / measure_s, 1),  # type: ignore[misc]
            "ttft_p50_ms": round(1000 * p50, 1) if p50 is not None else None,
            "ttft_p99_ms": round(1000 * p99, 1) if p99 is not None else None,
            "errors": sum(p["errors"] for p in parts), "error_kinds": kinds,  # type: ignore[misc]
            "client_cpu_share_max": round(max(p["client_cpu_share"] for p in parts), 2)}  # type: ignore[type-var]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("model")
    parser.add_argument("--tag", default="")
    parser.add_argument("--levels", default="64,256", help="concurrent streams, comma-separated")
    parser.add_argument("--procs", type=int, default=4, help="client processes sharing each level's streams")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--measure-s", type=float, default=10.0)
    parser.add_argument("--out", help="append each line to this file too")
    args = parser.parse_args()
    for level in (int(x) for x in args.levels.split(",")):
        line = {"tag": args.tag, "label": os.environ.get("LABEL", ""), "url": args.url,
                **load(args.url, args.model, level, args.procs, args.warmup_s, args.measure_s, args.max_tokens)}
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
