"""Which NIXL transfer works between two processes on this machine, before vLLM relies on it.

vLLM's NixlConnector has the decode engine READ the prefill engine's KV blocks through a
NIXL agent (UCX backend). Two engines sharing one GPU in a sandbox may lack what UCX picks
by default (CUDA IPC between processes, say), and vLLM then recomputes the prompt (its
``kv_load_failure_policy``), which a correctness check cannot see. So, per configuration
(the KV buffer on the GPU or in host memory, UCX's transports left to UCX or named), two
fresh processes do what the connector does: the target registers a buffer holding a
pattern and publishes its agent metadata and descriptors; the initiator registers its own,
READs the target's, checks every byte, and notifies the target. One JSON line per
configuration; ``--out`` gets them all and the first that worked.

    python -m loadtest.gpu.nixl_probe --out /tmp/nixl_probe.json             (device: cuda, then cpu)
    python -m loadtest.gpu.nixl_probe --configs cpu --out /tmp/p.json         (CPU rehearsal)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: buffer device, UCX_TLS ("" leaves UCX's choice): the order vLLM would be tried in.
DEFAULT_CONFIGS = "cuda;cuda:tcp,cuda_copy,self;cpu;cpu:tcp,self"


def wait_for(path: Path, timeout_s: float) -> bytes:
    until = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > until:
            raise TimeoutError(f"no {path.name} after {timeout_s} s")
        time.sleep(0.05)
    time.sleep(0.05)  # written by the other process just before it was renamed into place
    return path.read_bytes()


def publish(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def side(role: str, folder: Path, device: str, size: int, timeout_s: float) -> dict[str, Any]:
    """One process of the pair: ``target`` (holds the pattern) or ``initiator`` (reads it)."""
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(role, nixl_agent_config(backends=["UCX"]))
    if role == "target":
        buf = torch.arange(size // 4, dtype=torch.int32, device=device)
    else:
        buf = torch.zeros(size // 4, dtype=torch.int32, device=device)
    agent.register_memory(buf)
    descs = agent.get_xfer_descs(buf)
    if role == "target":
        publish(folder / "target.descs", agent.get_serialized_descs(descs))
        publish(folder / "target.meta", agent.get_agent_metadata())
        peer = agent.add_remote_agent(wait_for(folder / "initiator.meta", timeout_s))
        publish(folder / "target.ready", b"")  # knows the initiator now: its notification will be taken
        until = time.monotonic() + timeout_s
        name = peer.decode() if isinstance(peer, bytes) else peer  # notifications are keyed by str
        while not agent.check_remote_xfer_done(name, b"read"):
            if time.monotonic() > until:
                return {"error": "the initiator's notification never came", "notifs": str(agent.notifs)[:200]}
            time.sleep(0.01)
        publish(folder / "target.done", b"")  # the initiator may go now (its agent delivers the notification)
        return {"notified": True}
    publish(folder / "initiator.meta", agent.get_agent_metadata())
    peer = agent.add_remote_agent(wait_for(folder / "target.meta", timeout_s))
    remote = agent.deserialize_descs(wait_for(folder / "target.descs", timeout_s))
    wait_for(folder / "target.ready", timeout_s)
    started = time.perf_counter()
    handle = agent.initialize_xfer("READ", descs, remote, peer, b"read")
    state = agent.transfer(handle)
    until = time.monotonic() + timeout_s
    while state == "PROC" and time.monotonic() < until:
        state = agent.check_xfer_state(handle)
    seconds = time.perf_counter() - started
    if state != "DONE":
        return {"error": f"transfer state {state}"}
    expected = torch.arange(size // 4, dtype=torch.int32, device=device)
    same = bool(torch.equal(buf, expected))
    try:
        wait_for(folder / "target.done", timeout_s)
    except TimeoutError:
        pass  # the target says so
    return {"backend": agent.query_xfer_backend(handle), "bytes": size, "seconds": round(seconds, 4),
            "gb_s": round(size / seconds / 1e9, 2), "identical": same, **({} if same else {"error": "data differ"})}


def probe(device: str, tls: str, size: int, timeout_s: float) -> dict[str, Any]:
    """Both sides in fresh processes (UCX reads its environment once)."""
    env = {**os.environ}
    if tls:
        env["UCX_TLS"] = tls
    row: dict[str, Any] = {"buffer": device, "ucx_tls": tls or "(UCX's choice)"}
    with tempfile.TemporaryDirectory(prefix="nixl-probe-") as folder:
        argv = [sys.executable, "-m", "loadtest.gpu.nixl_probe", "--side", "", "--folder", folder, "--device", device,
                "--size", str(size), "--timeout-s", str(timeout_s)]
        procs = {}
        for role in ("target", "initiator"):
            argv[argv.index("--side") + 1] = role
            procs[role] = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for role, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=timeout_s + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
                row[role] = {"error": "timed out"}
                continue
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            row[role] = json.loads(lines[-1]) if lines else {"error": f"exit {proc.returncode}: {stderr.strip()[-300:]}"}
    row["ok"] = not row["initiator"].get("error") and not row["target"].get("error")
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="';'-separated BUFFER[:UCX_TLS]")
    p.add_argument("--size", type=int, default=64 * 2**20, help="bytes read")
    p.add_argument("--timeout-s", type=float, default=30)
    p.add_argument("--all", action="store_true", help="probe every configuration, not only up to the first that works")
    p.add_argument("--out", default="")
    p.add_argument("--side", default="", help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        try:
            result = side(args.side, Path(args.folder), args.device, args.size, args.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the parent reports it
            result = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(json.dumps(result), flush=True)
        return 0
    rows = []
    for config in args.configs.split(";"):
        device, _, tls = config.partition(":")
        row = probe(device, tls, args.size, args.timeout_s)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if row["ok"] and not args.all:
            break
    good = next((r for r in rows if r["ok"]), None)
    if args.out:
        Path(args.out).write_text(json.dumps({"first_ok": good, "probes": rows}, indent=1))
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
