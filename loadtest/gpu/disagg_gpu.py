"""Prefill/decode disaggregation on one GPU (issue 26): three vLLM workers sharing it, one
gateway, model ``agg`` served whole by a ``--role both`` worker and model ``pd`` by a
``--role prefill`` + ``--role decode`` pair joined by one of vLLM's KV connectors:
``--connector NixlConnector`` (KV read GPU to GPU through NIXL/UCX; the ``nixl-cu13``
wheel; tried with the KV buffer on the GPU, then through host memory), or a file
connector (``ExampleConnector``; ``SharedStorageConnector`` in vLLMs that still use that
name; the default).

1. correctness: the same greedy requests (prompts of 200-2,000 words, each many KV blocks)
   to both models; the outputs must be equal (all three engines hold the same seeded dummy
   weights), and the KV must have come from the prefill worker: the decode worker's log
   shows it injected (file connectors), or the decode hop reports the prompt as cached
   (``cached_tokens``; NIXL) with no failed or expired transfer in the decode log (a failed
   transfer is recomputed under ``kv_load_failure_policy: recompute``, which would hide it);
2. load: closed-loop streams with long prompts against each model in turn: TTFT p50/p90,
   ITL p50/p99, output tok/s.

Both arms share one GPU, so the load figures measure what the two hops cost (a second
request, a KV copy through files, two schedulers), not what disaggregation gains (that needs
the prefill and the decode on separate GPUs).

    python -m loadtest.gpu.disagg_gpu --engine vllm --model /tmp/m_1b --deadline EPOCH --out $OUT   (device)
    python -m loadtest.gpu.disagg_gpu --engine sim --out /tmp/o --quick                              (rehearsal)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.gpu.client import Recorder
from loadtest.gpu.fleet import Fleet, FleetShape, log, stop_on_sigterm
from loadtest.gpu.workloads import text
from sluice.commands.bench_report import quantile
from sluice.commands.bench_stack import LoggedChild, _child_env

CONNECTORS = ("ExampleConnector", "SharedStorageConnector")
NIXL = "NixlConnector"
INJECT = "Inject KV cache of"
#: Decode-log lines of a NIXL transfer that failed or whose KV expired before it was read.
NIXL_FAILURES = ("failed request", "handshake_failed", "handshake_setup_failed", "Releasing expired KV blocks",
                 "Potentially invalid KV blocks", "Declining expired remote read")
#: NIXL's side channel (a ZMQ port per engine for the handshake): one base per worker, apart
#: from vLLM's own ports (VLLM_PORT, 41000 + 500 i in fleet.py).
NIXL_SIDE_CHANNEL_BASE = 5600
LIMITS = httpx.Limits(max_connections=512, max_keepalive_connections=512)


def registered_connectors() -> list[str] | None:
    """The file connectors this vLLM registers (None: the probe failed; try them in order)."""
    probe = ("from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F;"
             "print(' '.join(F._registry))")
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return None
    names = done.stdout.split()
    return [c for c in CONNECTORS if c in names] or None if done.returncode == 0 else None


@dataclass(frozen=True)
class Try:
    """One way to join the pair: a connector, and for NIXL where its KV buffer lives and
    which UCX transports it may use ("" leaves UCX's choice)."""

    connector: str
    buffer: str = ""
    ucx_tls: str = ""

    def __str__(self) -> str:
        return " ".join(x for x in (self.connector, self.buffer and f"buffer {self.buffer}",
                                    self.ucx_tls and f"UCX_TLS={self.ucx_tls}") if x)


def nixl_tries(spec: str) -> list[Try]:
    """``cuda;cpu:tcp,self`` -> NIXL with the KV on the GPU (UCX's choice), then through host
    memory over TCP."""
    out = []
    for item in spec.split(";"):
        buffer, _, tls = item.partition(":")
        out.append(Try(NIXL, buffer, tls))
    return out


def kv_transfer_config(connector: str, role: str, kv_dir: Path, buffer: str) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for one side of the pair (``kv_both`` is deprecated
    for NIXL since vLLM 0.26: producer on the prefill side, consumer on the decode side)."""
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"}
    if connector == NIXL:
        return config | {"kv_buffer_device": buffer}
    return config | {"kv_connector_extra_config": {"shared_storage_path": str(kv_dir)}}


class PdFleet(Fleet):
    """The agg worker (w0), the prefill (w1) and decode (w2) workers of ``pd``."""

    def __init__(self, shape: FleetShape, logs: Path, kv_dir: Path, transfer_ms: float) -> None:
        super().__init__(shape, logs)
        self.kv_dir = kv_dir
        self.transfer_ms = transfer_ms
        self.attempt = Try("")
        self.by_role: dict[str, LoggedChild] = {}
        self.ports: set[str] = set()

    @property
    def connector(self) -> str:
        return self.attempt.connector

    def spawn(self, i: int, served: str, role: str) -> LoggedChild:
        argv, env = self.worker_argv(i, served)
        while (port := argv[argv.index("--port") + 1]) in self.ports:  # free_port can repeat before a child binds
            argv, env = self.worker_argv(i, served)
        self.ports.add(port)
        argv += ["--role", role]
        if role != "both" and self.shape.engine == "vllm":
            argv[argv.index("--log-level") + 1] = "INFO"  # the connector logs each injection at INFO
            argv += ["--kv-transfer-config",
                     json.dumps(kv_transfer_config(self.connector, role, self.kv_dir, self.attempt.buffer))]
            if self.connector == NIXL:  # two engines on one host: each its own handshake port
                env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(NIXL_SIDE_CHANNEL_BASE + 10 * i)
                if self.attempt.ucx_tls:
                    env["UCX_TLS"] = self.attempt.ucx_tls
        elif role == "decode":
            argv.append(f"--sim-kv-transfer-ms-per-token={self.transfer_ms}")
        child = LoggedChild(f"worker-{role}", argv, _child_env(env), self.logs / f"worker-{role}-{i}.log")
        child.start()
        self.workers.append(child)
        self.by_role[role] = child
        log(f"{child.name}: {' '.join(argv[2:])}")
        if self.shape.engine == "vllm":
            time.sleep(2)  # engines that start at one instant race for the GPU memory check
        return child

    def start_all(self, tries: list[Try], timeout_s: float, check: Callable[[], str | None]) -> list[dict[str, str]]:
        """Start the three workers. The pd pair is started with each try in turn until one
        serves: its workers register and ``check`` (a request through the pair) finds
        nothing wrong. Returns what each failed try did."""
        until = time.monotonic() + timeout_s  # for every try together
        self.spawn(0, "agg", "both")
        index = 1
        failures: list[dict[str, str]] = []
        for attempt in tries:
            self.attempt = attempt
            pair = [self.spawn(index, "pd", "prefill"), self.spawn(index + 1, "pd", "decode")]
            index += 2
            try:
                failed = self.wait_registered({"agg": 1, "pd": 2}, pair, until - time.monotonic())
                problem = f"{failed.name} exited; log {failed.log_path.name}" if failed is not None else check()
            except RuntimeError as exc:  # out of time
                problem = str(exc)
            if problem is None:
                log(f"pd workers serve with {attempt}")
                return failures
            log(f"{attempt}: {problem}")
            failures.append({"try": str(attempt), "problem": problem})
            for child in pair:
                child.stop(timeout_s=15)
                self.workers.remove(child)
            if time.monotonic() > until:
                break
        raise RuntimeError(f"no connector try served: {failures}")

    def decode_log_count(self, needles: tuple[str, ...]) -> int:
        decode = self.by_role.get("decode")
        if decode is None:
            return 0
        text = decode.log_path.read_text(errors="replace")
        return sum(text.count(n) for n in needles)

    def injections(self) -> int:
        return self.decode_log_count((INJECT,))

    def transfer_failures(self) -> int:
        return self.decode_log_count(NIXL_FAILURES) if self.connector == NIXL else 0


def prompt(rng: random.Random, tag: str, words: int) -> str:
    # A unique head: no request finds another's blocks in a prefix cache.
    return f"[{tag}] " + text(rng, words)


async def first_request(url: str, fleet: PdFleet, timeout_s: float) -> str | None:
    """One request through the pair: None if it was served and, with NIXL, its KV came
    through the connector (the decode hop reports most of the prompt cached, and its log
    no failed transfer); else what went wrong."""
    failed_before = fleet.transfer_failures()
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        rec = Recorder(http, url, "pd")
        try:
            await asyncio.wait_for(rec.send({"prompt": prompt(random.Random(1), "probe", 300), "max_tokens": 8},
                                            path="/v1/completions"), timeout_s)
        except TimeoutError:
            return f"no answer in {timeout_s:.0f} s"
    r = rec.records[-1]
    if r["error"]:
        return f"error: {r['error']}"
    if fleet.transfer_failures() > failed_before:
        return "the decode log shows a failed transfer"
    if fleet.connector == NIXL and r["cached"] < r["prompt"] / 2:
        return f"the decode hop computed the prompt itself (cached {r['cached']} of {r['prompt']})"
    return None


async def correctness(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(26)
    prompts = [prompt(rng, f"c{i}", rng.randint(args.check_min_words, args.check_max_words))
               for i in range(args.check_requests)]
    async with httpx.AsyncClient(timeout=300, limits=LIMITS) as http:
        runs: dict[str, list[dict[str, Any]]] = {}
        for model in ("agg", "pd"):
            rec = Recorder(http, url, model)
            for i, p in enumerate(prompts):  # one at a time: each alone in its engine's batch on both paths
                await rec.send({"prompt": p, "max_tokens": args.check_tokens}, path="/v1/completions", i=i)
            runs[model] = rec.records
    pairs = list(zip(runs["agg"], runs["pd"], strict=True))
    same = sum(1 for a, b in pairs if a["error"] is None and b["error"] is None and a["text"] == b["text"])
    differ = [{"i": a["i"], "prompt_tokens": a.get("prompt"), "agg": a["text"][:120], "pd": b["text"][:120],
               "errors": [a["error"], b["error"]]} for a, b in pairs if a["text"] != b["text"] or a["error"] or b["error"]]
    pd_ok = [r for r in runs["pd"] if r["error"] is None]
    return {"requests": len(prompts), "identical": same, "max_tokens": args.check_tokens,
            "prompt_tokens": [min(r.get("prompt", 0) for r in runs["agg"]), max(r.get("prompt", 0) for r in runs["agg"])],
            # The decode hop's cached_tokens: the prompt tokens whose KV it did not compute.
            "pd_cached_tokens": sum(r["cached"] for r in pd_ok), "pd_prompt_tokens": sum(r["prompt"] for r in pd_ok),
            "agg_cached_tokens": sum(r.get("cached", 0) for r in runs["agg"] if r["error"] is None),
            "errors": {m: sum(1 for r in rs if r["error"]) for m, rs in runs.items()}, "differing": differ[:4]}


async def load(url: str, model: str, args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    rng = random.Random(f"load-{model}")
    async with httpx.AsyncClient(timeout=600, limits=LIMITS) as http:
        rec = Recorder(http, url, model)
        stop_at = time.perf_counter() + seconds
        n = 0

        async def user() -> None:
            nonlocal n
            while time.perf_counter() < stop_at:
                n += 1
                body = {"prompt": prompt(rng, f"{model}{n}", rng.randint(args.load_min_words, args.load_max_words)),
                        "max_tokens": args.load_tokens, "ignore_eos": True}
                await rec.send(body, path="/v1/completions", keep_times=True)

        started = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(args.streams)))
        wall = time.perf_counter() - started
    ok = [r for r in rec.records if r["error"] is None]
    ttfts = [r["ttft"] for r in ok]
    gaps = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    ms = lambda xs, q: round(quantile(xs, q) * 1000, 1) if xs else None  # noqa: E731
    return {"model": model, "streams": args.streams, "requests": len(rec.records), "ok": len(ok),
            "errors": len(rec.records) - len(ok),
            "error_kinds": sorted({str(r["error"])[:80] for r in rec.records if r["error"]})[:4],
            "prompt_tok_avg": round(sum(r["prompt"] for r in ok) / max(len(ok), 1), 1),
            "ttft_p50_ms": ms(ttfts, 0.5), "ttft_p90_ms": ms(ttfts, 0.9),
            "itl_p50_ms": ms(gaps, 0.5), "itl_p99_ms": ms(gaps, 0.99),
            "out_tok_s": round(sum(r["completion"] for r in ok) / wall, 1), "wall_s": round(wall, 1)}


async def janitor(kv_dir: Path, max_age_s: float) -> None:
    """The file connector never deletes what it wrote (~32 KiB per token of the 1B shape):
    drop entries older than any decode hop waits for, so a minute of load fits the disk."""
    while True:
        await asyncio.sleep(2)
        now = time.time()
        for entry in kv_dir.iterdir() if kv_dir.exists() else ():
            try:
                if now - entry.stat().st_mtime > max_age_s:
                    shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink()
            except FileNotFoundError:
                pass


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    names = [r["model"] for r in rows]
    for ax, (title, cols) in zip(axes, [("TTFT ms", ("ttft_p50_ms", "ttft_p90_ms")),
                                        ("ITL ms", ("itl_p50_ms", "itl_p99_ms")), ("output tok/s", ("out_tok_s",))],
                                 strict=True):
        width = 0.8 / len(cols)
        for k, col in enumerate(cols):
            ax.bar([i + k * width for i in range(len(rows))], [r[col] or 0 for r in rows], width, label=col)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], names)
        ax.set_title(title)
        if len(cols) > 1:
            ax.legend(fontsize=7)
    fig.suptitle("P/D (1 prefill + 1 decode) vs aggregated, all on one GPU: the orchestration's cost", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def measure(fleet: PdFleet, url: str, args: argparse.Namespace, result: dict[str, Any], out: Path) -> None:
    sweeper = asyncio.create_task(janitor(fleet.kv_dir, 10))
    try:
        before, failed_before = fleet.injections(), fleet.transfer_failures()
        result["correctness"] = check = await correctness(url, args)
        check["decode_log_injections"] = fleet.injections() - before
        check["decode_log_transfer_failures"] = fleet.transfer_failures() - failed_before
        log(f"correctness: {check['identical']}/{check['requests']} identical; "
            f"{check['decode_log_injections']} KV injections, {check['decode_log_transfer_failures']} failed "
            f"transfers in the decode log; decode cached {check['pd_cached_tokens']} of {check['pd_prompt_tokens']} "
            f"prompt tokens; errors {check['errors']}")
        dump(result, out)
        for model in ("agg", "pd"):
            seconds = args.load_s
            if args.deadline:  # agg leaves pd its share of what is left
                seconds = min(seconds, (args.deadline - time.time() - 25) / (2 if model == "agg" else 1) - 10)
            if seconds < min(10, args.load_s):
                log(f"deadline: no load run for {model}")
                continue
            failed_before = fleet.transfer_failures()
            row = await load(url, model, args, seconds)
            if model == "pd":
                row["decode_log_transfer_failures"] = fleet.transfer_failures() - failed_before
            result["load"].append(row)
            log(f"load {model}: " + json.dumps({k: v for k, v in row.items() if k != "error_kinds"}))
            dump(result, out)
    finally:
        sweeper.cancel()


def roomy(folder: str) -> bool:
    """A container's /dev/shm may be 64 MiB; the KV files of a minute's load take gigabytes."""
    try:
        return shutil.disk_usage(folder).free > 32 * 2**30
    except OSError:
        return False


def dump(result: dict[str, Any], out: Path) -> None:
    (out / "disagg.json").write_text(json.dumps(result, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["vllm", "sim"], default="vllm")
    p.add_argument("--model", default="/tmp/m_1b")
    p.add_argument("--tokenizer", default="", help="the gateway's tokenizer folder (default: --model; sim: none)")
    p.add_argument("--out", default="/tmp/out")
    p.add_argument("--deadline", type=float, default=0, help="epoch s: everything ends (workers stopped) before it")
    p.add_argument("--kv-dir", default="", help="the connector's folder (default /dev/shm/sluice-kv, else /tmp)")
    p.add_argument("--connector", choices=(*CONNECTORS, NIXL),
                   help="NixlConnector, or skip the file connectors' probe and use this one first")
    p.add_argument("--nixl-tries", default="cuda;cpu:tcp,self",
                   help="NIXL: ';'-separated BUFFER[:UCX_TLS], tried in turn until the pair serves a first request")
    p.add_argument("--first-timeout-s", type=float, default=60, help="a try's first request must be served in this")
    p.add_argument("--gpu-util", type=float, default=0.2)
    p.add_argument("--kv-blocks", type=int, default=10240, help="per worker, 16-token blocks (32 x 4k tokens fit)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--check-requests", type=int, default=16)
    p.add_argument("--check-min-words", type=int, default=200)
    p.add_argument("--check-max-words", type=int, default=2000)
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--load-min-words", type=int, default=2000)
    p.add_argument("--load-max-words", type=int, default=4000)
    p.add_argument("--load-tokens", type=int, default=128)
    p.add_argument("--load-s", type=float, default=60)
    p.add_argument("--sim-transfer-ms", type=float, default=0.002, help="sim decode: KV receive ms per prompt token")
    p.add_argument("--quick", action="store_true", help="rehearsal sizes: 4 checks, 8 streams, 8 s per arm")
    args = p.parse_args()
    stop_on_sigterm()
    if args.quick:
        args.check_requests, args.streams, args.load_s = 4, 8, 8
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    kv_dir = Path(args.kv_dir or ("/dev/shm/sluice-kv" if roomy("/dev/shm") else "/tmp/sluice-kv"))
    shutil.rmtree(kv_dir, ignore_errors=True)
    kv_dir.mkdir(parents=True)
    shape = FleetShape(engine=args.engine, model=args.model, served="agg", workers=3, max_num_seqs=64,
                       max_model_len=8192, max_batched=8192, kv_blocks=args.kv_blocks, gpu_util=args.gpu_util,
                       enforce_eager=args.enforce_eager, gateway_procs=2, sim_prefill_ms=0.02, sim_token_ms=8.0)
    names = list(CONNECTORS)
    if args.connector == NIXL:
        names = [NIXL]
    elif args.connector:
        names = [args.connector] + [c for c in CONNECTORS if c != args.connector]
    elif args.engine == "vllm":
        found = registered_connectors()
        log(f"connectors this vLLM registers: {found}")
        names = found or names
    tries = nixl_tries(args.nixl_tries) if args.connector == NIXL else [Try(n) for n in names]
    result: dict[str, Any] = {
        "engine": args.engine, "model": args.model, "kv_dir": str(kv_dir), "kv_dir_free_gib": round(shutil.disk_usage(kv_dir).free / 2**30, 1),
        "note": "agg: 1 worker --role both; pd: 1 prefill + 1 decode worker joined by a KV connector; "
                "all three share ONE GPU, so the load figures measure the orchestration's cost "
                "(two hops, a KV copy), not disaggregation's benefit (that needs 2 GPUs)",
        "load": []}
    started = time.time()
    tokenizer = args.tokenizer or (args.model if args.engine == "vllm" else "")
    with PdFleet(shape, logs, kv_dir, args.sim_transfer_ms) as fleet:
        try:
            fleet.start_gateways(["least"], tokenizer)  # first: a try's check goes through it
            url = fleet.gateways["least"][1]
            budget = (args.deadline - time.time() - 60) if args.deadline else 600
            result["failed_tries"] = fleet.start_all(
                tries if args.engine == "vllm" else [Try("sim")], timeout_s=budget,
                check=lambda: asyncio.run(first_request(url, fleet, args.first_timeout_s)))
            result["connector"] = str(fleet.attempt)
            result["startup_s"] = round(time.time() - started, 1)
            left = (args.deadline - time.time() - 20) if args.deadline else None  # the workers' stop comes after
            asyncio.run(asyncio.wait_for(measure(fleet, url, args, result, out), left))
        except Exception as exc:  # the figures so far still go out; the lead reads the logs
            result["error"] = f"{type(exc).__name__}: {exc}"
            log(f"FAILED: {result['error']}")
        finally:
            result["kv_dir_mib_at_end"] = round(sum(f.stat().st_size for f in kv_dir.rglob("*") if f.is_file()) / 2**20, 1)
            dump(result, out)
    if result["load"]:
        chart(result["load"], out / "disagg.png")
    print(json.dumps(result, indent=1))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
