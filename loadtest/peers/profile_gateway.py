"""Where a relaying gateway spends its time: the mock, a direct-relay worker registration and
one gateway process, a closed-loop load at each concurrency first straight at the mock and
then through the gateway, with the gateway's CPU per chunk and per request, py-spy's
profile of the gateway (optional), its event loop's lag (sluice/stalls.py, read from its
/metrics), and Redis's time per admission script.

    flock /tmp/sluice-heavy.lock .venv/bin/python loadtest/peers/profile_gateway.py --levels 16,64
    ... --max-tokens 1             # request-bound: what one request costs
    ... --py-spy /tmp/gw           # also /tmp/gw-<level>.txt, py-spy's collapsed stacks (needs py-spy)
    ... --cprofile /tmp/gw.prof    # the gateway under cProfile (its stats written when it stops)
    ... --strace                   # the gateway's system calls per request, by call (strace -c; slows it)
    ... --perf                     # the gateway's CPU by shared object and symbol (perf record; needs perf)
    ... --keep-alive --think-ms 4  # as bench_peers.py's issue-22 runs: kept-alive loops out of step
    ... --access                   # the gateway's access lines: where its added TTFT is spent (logging costs it)
    ... --api-key                  # every request with an API key (the gateway enforces keys)

Timing model of the mock as in bench_peers.py (first token 20 ms, one token per 5 ms).
The figures are for finding the next hot spot, not for comparing with peers: py-spy
sampling costs the gateway a little.
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE)]

import bench_peers as bp
import httpx
import load
import redis
from prometheus_client.parser import text_string_to_metric_families

from gateway.admission import scripts
from sluice.embedded_redis import EmbeddedRedis


def script_names() -> dict[bytes, str]:
    """Admission script SHA1 prefixes by their names in gateway/admission/scripts.py."""
    return {hashlib.sha1(value.encode()).hexdigest()[:8].encode(): name
            for name, value in vars(scripts).items() if isinstance(value, str) and "redis.call" in value}


def measured_window(command: str) -> subprocess.Popen[bytes]:
    """``command`` (a shell line) started once the load's 2 s of warm-up are over: it must
    end with the measured window."""
    return subprocess.Popen(["bash", "-c", f"sleep 2; exec {command}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


#: A row of ``perf report --stdio``: its share, then what it counts.
_PERF_ROW = re.compile(r"^\s*([\d.]+)%\s+(\S.*)$", re.MULTILINE)


def perf_split(data: str, cpu_s: float, requests: int, top: int = 12) -> str:
    """perf's samples of the gateway by shared object, then its top symbols, each as a share
    and as µs of CPU a request (the window's CPU, read from /proc, split by the shares)."""
    lines = []
    for sort, limit in (("dso", 0), ("dso,sym", top)):
        report = subprocess.run(["perf", "report", "-i", data, "--sort", sort, "--stdio", "--no-children", "-g",
                                 "none"], capture_output=True, text=True).stdout
        rows = [(m[1], m[2]) for m in _PERF_ROW.finditer(report)]
        rows = rows[:limit] if limit else rows
        lines.append(f"  perf, by {'shared object' if sort == 'dso' else 'symbol'}:")
        for share, what in rows:
            pct = float(share)
            lines.append(f"    {pct:5.1f} %  {1e6 * cpu_s * pct / 100 / requests:6.1f} µs/request  {' '.join(what.split())}")
    return "\n".join(lines)


def script_times(client: redis.Redis) -> dict[str, list[int]]:
    """µs per EVALSHA by script, from the slow log (every command is logged: threshold 0)."""
    names = script_names()
    times: dict[str, list[int]] = defaultdict(list)
    for entry in client.slowlog_get(100_000):
        words = entry["command"].split()
        if words and words[0].upper() == b"EVALSHA":
            times[names.get(words[1][:8], words[1][:8].decode())].append(entry["duration"])
    return times


def syscalls_per_request(summary: str, requests: float) -> str:
    """strace -c's table as calls per request, the most frequent first."""
    counts: dict[str, int] = {}
    for line in summary.splitlines():
        words = line.split()
        if len(words) >= 5 and words[0].replace(".", "").isdigit() and words[-1] != "total":
            counts[words[-1]] = int(words[3])
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    total = sum(counts.values())
    return (f"system calls per request: {total / requests:.1f} in all; "
            + ", ".join(f"{name} {count / requests:.2f}" for name, count in ranked[:8]))


def access_split(log: Path, offset: int, since: float, client_p50: float | None,
                 direct_p50: float | None) -> str:
    """The window's access lines (the gateway's own clock, from the app's first step): the
    median admission (``queue_wait_ms``) and first token (``ttft_ms``), against the client's
    and direct's medians. Client - app = outside the app (server, sockets, the loop's backlog
    before the app runs and before its first write is read); app - direct - admission = the
    rest of the app's way to the engine and back."""
    queue, ttft = [], []
    with open(log, "rb") as f:
        f.seek(offset)
        for raw in f:
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if not str(entry.get("msg", "")).startswith("access ") or entry.get("ttft_ms") is None:
                continue
            at = calendar.timegm(time.strptime(entry["ts"][:19], "%Y-%m-%dT%H:%M:%S")) + float(entry["ts"][19:-1] or 0)
            if at >= since:
                queue.append(float(entry["queue_wait_ms"]))
                ttft.append(float(entry["ttft_ms"]))
    if not ttft or client_p50 is None or direct_p50 is None:
        return "access lines: none in the window"
    queue.sort()
    ttft.sort()
    q50, t50, c50, d50 = queue[len(queue) // 2], ttft[len(ttft) // 2], 1000 * client_p50, 1000 * direct_p50
    return (f"access lines {len(ttft)}: TTFT p50 client {c50:.1f} ms = app {t50:.1f} (admission {q50:.1f}, the "
            f"rest {t50 - q50:.1f}; direct {d50:.1f}) + outside the app {c50 - t50:.1f} ms; added "
            f"{c50 - d50:+.1f} ms = admission {q50:+.1f}, the app's other steps {t50 - q50 - d50:+.1f}, "
            f"outside {c50 - t50:+.1f}")


#: /metrics's key, for a gateway that enforces API keys (``--api-key``).
ADMIN_KEY = "profile-gateway-admin"


def lag_buckets(gateway: str) -> dict[float, float]:
    """The gateway's event-loop lag histogram (sluice/stalls.py): cumulative count by bound."""
    text = httpx.get(gateway + "/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=5).text
    return {float(s.labels["le"]): s.value for family in text_string_to_metric_families(text)
            if family.name == "sluice_gateway_event_loop_lag_seconds"
            for s in family.samples if s.name.endswith("_bucket")}


def lag_summary(before: dict[float, float], after: dict[float, float]) -> str:
    """The window's samples of the loop's lag: its median and p99, each as the bucket's bound."""
    counts = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    total = counts[-1][1] if counts else 0
    if not total:
        return "event loop lag: no samples"

    def at(q: float) -> str:
        bound = next(b for b, c in counts if c >= q * total)
        return "> 10 s" if bound == float("inf") else f"<= {1000 * bound:g} ms"

    return (f"event loop lag during the load, warm-up included (the gateway's /metrics, {total:.0f} samples): "
            f"p50 {at(0.5)}, p99 {at(0.99)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="16", help="concurrent streams, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--measure-s", type=float, default=10.0)
    parser.add_argument("--keep-alive", action="store_true", help="each client loop keeps its connection")
    parser.add_argument("--access", action="store_true",
                        help="log the gateway's access lines (INFO) and split its added TTFT: admission, the rest of "
                             "the app until the first token, and outside the app (the server, the sockets, the loop's "
                             "backlog); logging each request costs the gateway some CPU")
    parser.add_argument("--think-ms", type=float, default=0.0,
                        help="each loop pauses a random 0..N ms between requests (as bench_peers.py's)")
    parser.add_argument("--resumable", action="store_true",
                        help="each request to the gateway has an Idempotency-Key of its own (a resumable stream)")
    parser.add_argument("--api-key", action="store_true",
                        help="the gateway enforces API keys and every request sends one (limits no load reaches): "
                             "what a key's verification and rate limits cost")
    parser.add_argument("--base-port", type=int, default=18620)
    parser.add_argument("--py-spy", help="output prefix for py-spy's collapsed stacks of the gateway")
    parser.add_argument("--cprofile", help="run the gateway under cProfile, its stats to this file (calls per "
                                           "request and per chunk; it slows the gateway about twofold)")
    parser.add_argument("--strace", action="store_true",
                        help="count the gateway's system calls per request with strace -c (exact counts; strace slows "
                             "the gateway, so its other figures are not comparable)")
    parser.add_argument("--perf", action="store_true",
                        help="sample the gateway's CPU with perf (cpu-clock, 2 kHz) over the measured window and print "
                             "its split by shared object (the interpreter, the kernel, uvloop, pydantic, ...) and its "
                             "top symbols: CPU time, where py-spy and cProfile count wall time (a write that wakes "
                             "another process, a preemption)")
    args = parser.parse_args()
    base, py = args.base_port, sys.executable
    procs = bp.Procs(Path(tempfile.mkdtemp(prefix="sluice-profile-")))
    try:
        with EmbeddedRedis() as embedded:
            procs.start("mock", [py, str(HERE / "mock_openai.py"), "--port", str(base), "--vllm", "--no-eos"])
            mock = f"http://127.0.0.1:{base}"
            bp.wait_ready(mock + "/health")
            env = {"PYTHONPATH": str(bp.ROOT), "SLUICE_LOG_FORMAT": "json",
                   "SLUICE_GATEWAY_AUTH": "keys" if args.api_key else "open", "SLUICE_GATEWAY_ADMIN_KEY": ADMIN_KEY}
            api_key = bp.create_key(embedded.url) if args.api_key else None
            common = ["--log-level", "WARNING"]
            procs.start("worker", [py, "-m", "sluice", *common, "worker", "--engine", "openai", "--upstream-url", mock,
                                   "--served-model-name", "m", "--port", str(base + 1), "--redis-url", embedded.url,
                                   "--upstream-capacity", "256", "--relay", "direct"], env=env)
            profiled = ["-m", "cProfile", "-o", args.cprofile] if args.cprofile else []
            logged = ["--log-level", "INFO"] if args.access else common
            procs.start("gateway", [py, *profiled, "-m", "sluice", *logged, "gateway", "--port", str(base + 2),
                                    "--redis-url", embedded.url, "--procs", "1"], env=env)
            gateway_log = procs.logs / "gateway.log"
            gateway = f"http://127.0.0.1:{base + 2}"
            probe = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
            bp.wait_ready(gateway + "/v1/chat/completions", 120, probe, api_key)
            client = redis.Redis.from_url(embedded.url)
            client.config_set("slowlog-log-slower-than", 0)
            client.config_set("slowlog-max-len", 100_000)
            pid = procs.groups["gateway"]
            direct_p50: float | None = None
            for level in [int(x) for x in args.levels.split(",")]:
                for name, url, model, key in (("direct", mock, "mock", None), ("gateway", gateway, "m", api_key)):
                    spy = None
                    if args.py_spy and name == "gateway":
                        spy = subprocess.Popen([shutil.which("py-spy") or str(Path(py).parent / "py-spy"), "record", "-r", "200", "-d", str(int(args.measure_s)), "-f",
                                                "raw", "-o", f"{args.py_spy}-{level}.txt", "-p", str(pid),
                                                "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    traced = None
                    if args.strace and name == "gateway":
                        traced = tempfile.NamedTemporaryFile(prefix="sluice-strace-", suffix=".txt", delete=False).name
                        spy = measured_window(f"timeout -s INT {args.measure_s} strace -c -f -o {traced} -p {pid}")
                    perf_data = None
                    if args.perf and name == "gateway":
                        perf_data = tempfile.NamedTemporaryFile(prefix="sluice-perf-", suffix=".data", delete=False).name
                        spy = measured_window(f"perf record -q -e cpu-clock -F 2000 -p {pid} -o {perf_data} "
                                              f"-- sleep {args.measure_s}")
                    client.slowlog_reset()
                    opened = client.info("stats")["total_connections_received"]
                    logged_from, window_from = gateway_log.stat().st_size, time.time() + 2.0  # past the warm-up

                    async def measure(url: str = url, model: str = model, level: int = level,
                                      key: str | None = key) -> tuple[load.Window, float]:
                        win, cpu = await asyncio.gather(load.run(url, model, level, 2.0, args.measure_s, args.max_tokens,
                                                                    api_key=key, keep_alive=args.keep_alive,
                                                                    think_ms=args.think_ms,
                                                                    resumable=args.resumable and name == "gateway"),
                                                        bp.window_cpu({"gateway": pid}, 2.0, args.measure_s))
                        return win, cpu["gateway"]

                    lag_before = lag_buckets(url) if name == "gateway" else {}
                    win, cpu = asyncio.run(measure())
                    p50, p99 = load.percentile(win.ttfts, 0.5), load.percentile(win.ttfts, 0.99)
                    served = max(1, win.chunks)
                    kinds = f" {win.error_kinds}" if win.errors else ""
                    print(f"{name:8s} {level:4d} streams: {win.chunks / args.measure_s:8,.0f} chunks/s  "
                          f"{win.requests / args.measure_s:6,.0f} req/s  TTFT p50 {1000 * (p50 or 0):6.1f} "
                          f"p99 {1000 * (p99 or 0):6.1f} ms  errors {win.errors}{kinds}  gateway CPU {cpu:5.2f} s "
                          f"({1e6 * cpu / served:,.0f} µs/chunk, {1e3 * cpu / max(1, win.requests):.2f} ms/request)",
                          flush=True)
                    print(f"  redis connections opened meanwhile: "
                          f"{client.info('stats')['total_connections_received'] - opened - 1}", flush=True)
                    if name == "gateway":
                        print("  " + lag_summary(lag_before, lag_buckets(url)), flush=True)
                    if args.access and name == "gateway":
                        print("  " + access_split(gateway_log, logged_from, window_from, p50, direct_p50), flush=True)
                    if name == "direct":
                        direct_p50 = p50
                    if spy is not None:
                        spy.wait()
                    if traced is not None:
                        print("  " + syscalls_per_request(Path(traced).read_text(), max(1, win.requests)), flush=True)
                    if perf_data is not None:
                        print(perf_split(perf_data, cpu, max(1, win.requests)), flush=True)
                for script, times in sorted(script_times(client).items()):
                    times.sort()
                    print(f"  redis {script:10s} {len(times):6d} calls  p50 {times[len(times) // 2]} µs  "
                          f"mean {sum(times) / len(times):.0f} µs")
    finally:
        procs.stop()


if __name__ == "__main__":
    main()
