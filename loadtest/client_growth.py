"""What one client can grow: gateway memory and Redis state after requests that name things.

Starts a private stack (embedded Redis, one sim worker, one gateway process), then sends,
one phase after another: requests with 1 MB model names, requests naming invented models,
invented names asked of ``GET /v1/models/{name}``, then long resumable streams with the
largest ``n`` (``n=16`` x 1,300 tokens, 20,802 events each, journaled) and as many plain
ones, read to their end at once; then non-streaming ``n=16`` chats with top-20 logprobs at
once (answers of ~86 MB each at 4,000 tokens, built whole in the gateway). After each phase it prints the gateway's RSS (and, for
the streams, its peak), Redis's ``used_memory`` and its key count, and what the requests got.
``--embed-only`` instead serves a wide embedding model (the simulator's, 4,096 floats an
input) and sends embeddings requests of 2,048 inputs at once (~170 MB answers).

    .venv/bin/python loadtest/client_growth.py            # ~20 s
    .venv/bin/python loadtest/client_growth.py --streams-only --huge 8 --tenant-max-mib 8
                                                          # one API key past its journal bound
    .venv/bin/python loadtest/client_growth.py --whole-only --whole 3 --whole-tokens 4000
                                                          # the whole answers alone (~45 s)
    ... --streams-only --plain-only --huge 16 --huge-tokens 16000 --sim-max-seqs 256
                                                          # long plain streams: what a stream holds a token
    ... --whole-only --whole 16 --whole-tokens 8000 --whole-top-logprobs 0 --sim-max-seqs 256 --max-answer-mib 16
                                                          # text alone: what the bound's bytes hold
    .venv/bin/python loadtest/client_growth.py --embed-only --embed 4
                                                          # 4 embeddings requests of 2,048 x 4,096 at once
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import threading
from collections.abc import Callable
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
    parser.add_argument("--huge", type=int, default=4, help="concurrent n=16 x 1,300-token streams, per kind")
    parser.add_argument("--huge-tokens", type=int, default=1300, help="tokens of each of their choices")
    parser.add_argument("--plain-only", action="store_true", help="--streams-only: the plain streams alone")
    parser.add_argument("--tenant-max-mib", type=float, default=None,
                        help="SLUICE_GATEWAY_JOURNAL_TENANT_MAX_BYTES, in MiB (default: the gateway's)")
    parser.add_argument("--streams-only", action="store_true", help="only the long streams' phases")
    parser.add_argument("--whole", type=int, default=2,
                        help="concurrent non-streaming n=16 chats with top-20 logprobs (0: none)")
    parser.add_argument("--whole-tokens", type=int, default=4000, help="tokens of each of their choices")
    parser.add_argument("--whole-top-logprobs", type=int, default=20,
                        help="top_logprobs of each (0: no logprobs, the text alone)")
    parser.add_argument("--whole-only", action="store_true", help="only the non-streaming answers' phase")
    parser.add_argument("--embed", type=int, default=2, help="--embed-only: concurrent embeddings requests")
    parser.add_argument("--embed-inputs", type=int, default=2048, help="inputs of each")
    parser.add_argument("--embed-dim", type=int, default=4096, help="the simulated embedding model's width")
    parser.add_argument("--embed-encoding", choices=["float", "base64"], default="float",
                        help="the encoding the requests ask for (the SDK's default is base64)")
    parser.add_argument("--embed-only", action="store_true",
                        help="only the embeddings phase (its worker serves embeddings alone)")
    parser.add_argument("--sim-max-seqs", type=int, default=None,
                        help="the sim worker's slots (an n=16 request takes 16; default: the worker's)")
    parser.add_argument("--max-answer-mib", type=float, default=None,
                        help="SLUICE_GATEWAY_MAX_ANSWER_BYTES, in MiB (default: the gateway's; a large one: as unbounded)")
    args = parser.parse_args()
    env = {} if args.tenant_max_mib is None else \
        {"SLUICE_GATEWAY_JOURNAL_TENANT_MAX_BYTES": str(int(args.tenant_max_mib * 2**20))}
    if args.max_answer_mib is not None:
        env["SLUICE_GATEWAY_MAX_ANSWER_BYTES"] = str(int(args.max_answer_mib * 2**20))
    worker_args = ["--task", "embed", "--sim-embed-dim", str(args.embed_dim)] if args.embed_only else []
    if args.sim_max_seqs is not None:
        worker_args += ["--sim-max-seqs", str(args.sim_max_seqs)]
    shape = StackShape(gateways=1, workers=1, gateway_env=env, worker_args=worker_args)
    with tempfile.TemporaryDirectory() as logs, Stack(shape, Path(logs)) as stack:
        client = sync_client(stack.redis_url)
        url = stack.gateway_urls[0]
        pid = stack.gateways[0].pid
        http = httpx.Client(timeout=120)
        warm = ("/v1/embeddings", {"model": "sim", "input": "warm"}) if args.embed_only else \
            ("/v1/completions", {"model": "sim", "prompt": "warm", "max_tokens": 2})
        assert http.post(url + warm[0], json=warm[1]).status_code == 200

        def report(phase: str, statuses: collections.Counter[int | str]) -> None:
            memory = client.info("memory")["used_memory"] / 2**20
            print(f"{phase:<34} gateway RSS {rss_mb(pid):7.1f} MB   Redis {memory:6.1f} MB, "
                  f"{client.dbsize():4d} keys   statuses {dict(statuses)}")

        def whole() -> None:
            peak, statuses = whole_answers(url, pid, args.whole, args.whole_tokens, args.whole_top_logprobs)
            report(f"{args.whole} x n=16 x {args.whole_tokens:,} whole, top-{args.whole_top_logprobs} "
                   f"(peak RSS {peak:.0f} MB)", statuses)

        report("after start and one request", collections.Counter())
        if args.embed_only:
            peak, statuses = embeddings(url, pid, args.embed, args.embed_inputs, args.embed_encoding)
            report(f"{args.embed} x {args.embed_inputs:,} x {args.embed_dim:,} {args.embed_encoding} embeddings "
                   f"(peak RSS {peak:.0f} MB)", statuses)
            return
        if args.whole_only:
            whole()
            return
        for resumable in ((False,) if args.plain_only else (True, False)) if args.streams_only else ():
            peak, statuses = huge_streams(url, pid, args.huge, resumable, args.huge_tokens)
            kind = "resumable" if resumable else "plain"
            report(f"{args.huge} x n=16 x {args.huge_tokens:,} {kind} (peak RSS {peak:.0f} MB)", statuses)
        if args.streams_only:
            return
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
        for resumable in (True, False):
            peak, statuses = huge_streams(url, pid, args.huge, resumable)
            kind = "resumable" if resumable else "plain"
            report(f"{args.huge} x n=16 x 1,300 {kind} (peak RSS {peak:.0f} MB)", statuses)
        if args.whole:
            whole()
        http.close()
        client.close()


def huge_streams(url: str, pid: int, count: int, resumable: bool,
                 tokens: int = 1300) -> tuple[float, collections.Counter[int | str]]:
    """``count`` concurrent n=16 x ``tokens`` streams read to their end; the gateway's
    peak RSS meanwhile, and the statuses."""
    body = {"model": "sim", "prompt": "long", "n": 16, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    statuses: collections.Counter[int | str] = collections.Counter()

    def one(i: int) -> None:
        headers = {"Idempotency-Key": f"huge-{i}-{threading.get_ident()}"} if resumable else {}
        with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            cut = False
            for raw in r.iter_raw():
                cut = cut or b"journal_memory_exceeded" in raw
            statuses["200, ended in-band: journal_memory_exceeded" if cut and r.status_code == 200
                     else r.status_code] += 1

    return _peak_while(one, count, pid), statuses


def whole_answers(url: str, pid: int, count: int, tokens: int,
                  top_logprobs: int = 20) -> tuple[float, collections.Counter[int | str]]:
    """``count`` concurrent non-streaming n=16 x ``tokens`` chats with ``top_logprobs`` (0: none);
    the gateway's peak RSS meanwhile, and the statuses (with the error's code)."""
    body = {"model": "sim", "messages": [{"role": "user", "content": "long"}], "n": 16, "max_tokens": tokens,
            "ignore_eos": True}
    if top_logprobs:
        body.update(logprobs=True, top_logprobs=top_logprobs)
    statuses: collections.Counter[int | str] = collections.Counter()

    def one(i: int) -> None:
        with httpx.Client(timeout=900) as c:
            r = c.post(url + "/v1/chat/completions", json={**body, "user": f"whole-{i}"})
            code = r.json()["error"]["code"] if r.status_code != 200 else f"{len(r.content) / 1e6:.0f} MB"
            statuses[f"{r.status_code} {code}"] += 1

    return _peak_while(one, count, pid), statuses


def embeddings(url: str, pid: int, count: int, inputs: int,
               encoding: str) -> tuple[float, collections.Counter[int | str]]:
    """``count`` concurrent embeddings requests of ``inputs`` inputs each, in ``encoding``;
    the gateway's peak RSS meanwhile, and the statuses."""
    statuses: collections.Counter[int | str] = collections.Counter()

    def one(i: int) -> None:
        body = {"model": "sim", "input": [f"the quick brown fox {i}"] * inputs, "encoding_format": encoding}
        with httpx.Client(timeout=900) as c:
            r = c.post(url + "/v1/embeddings", json=body)
            code = r.json()["error"]["code"] if r.status_code != 200 else f"{len(r.content) / 1e6:.0f} MB"
            statuses[f"{r.status_code} {code}"] += 1

    return _peak_while(one, count, pid), statuses


def _peak_while(one: Callable[[int], None], count: int, pid: int) -> float:
    """Run ``one(i)`` for ``count`` threads at once; the gateway's peak RSS until all end."""
    peak = [rss_mb(pid)]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak.append(rss_mb(pid))
        threads[0].join(0.2)
    return max(peak)


if __name__ == "__main__":
    main()
