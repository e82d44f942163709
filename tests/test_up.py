"""``sluice up`` as a user runs it: ready, serves, and leaves nothing behind on SIGTERM."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import redis

from sluice import keys
from sluice.embedded_redis import free_port
from tests.conftest import pid_alive

ROOT = Path(__file__).resolve().parent.parent


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@contextlib.contextmanager
def _up(tmp_path: Path, port: int, *flags: str) -> Iterator[tuple[subprocess.Popen[bytes], bytes]]:
    """``sluice up --engine sim`` with ``flags``, once it printed its banner; killed at the end
    if it still runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115
    up = subprocess.Popen([sys.executable, "-m", "sluice", "up", "--engine", "sim", "--port", str(port), *flags],
                          stdout=subprocess.PIPE, stderr=log, cwd=ROOT, env=env)
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + 60
        banner = b""
        while b"Ctrl-C stops everything" not in banner:
            assert time.monotonic() < deadline and up.poll() is None, (tmp_path / "up.log").read_text()
            banner += up.stdout.readline()
        yield up, banner
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        if up.stdout:
            up.stdout.close()
        log.close()


def test_up_serves_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    with _up(tmp_path, port, "--workers", "2", "--gateway-procs", "2") as (up, banner):
        assert f"http://127.0.0.1:{port}".encode() in banner and b"curl -N" in banner
        children = _descendants(up.pid)
        assert len(children) >= 6  # redis, two workers, the gateway supervisor and its two processes

        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as c:
            resp = c.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        assert resp.choices[0].message.content

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        deadline = time.monotonic() + 5
        while any(pid_alive(p) for p in children):
            assert time.monotonic() < deadline, [p for p in children if pid_alive(p)]
            time.sleep(0.05)


def test_up_bad_flag_is_a_clear_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sluice", "up", "--engine", "nonsense"],
        capture_output=True, text=True, cwd=ROOT, timeout=30,
    )
    assert result.returncode == 2
    assert "invalid choice" in result.stderr and "Traceback" not in result.stderr


def test_help_explains_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sluice", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=30
    )
    assert result.returncode == 0
    for word in ("up", "gateway", "worker", "check"):
        assert word in result.stdout


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_up_restarts_a_dead_worker(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115
    up = subprocess.Popen(
        [sys.executable, "-m", "sluice", "up", "--engine", "sim", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT, env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline and up.poll() is None
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        workers = [p for p in _descendants(up.pid) if " worker " in _cmdline(p)]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()[-2000:]
            fresh = [p for p in _descendants(up.pid) if " worker " in _cmdline(p) and p != workers[0]]
            try:  # a slow answer right after the restart is a reason to ask again, not a failure
                if fresh and httpx.get(url + "/ready", timeout=5).status_code == 200:
                    resp = httpx.post(url + "/v1/completions", json={"model": "sim", "prompt": "x", "max_tokens": 2},
                                      timeout=10)
                    if resp.status_code == 200:
                        break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert "restarting" in (tmp_path / "up.log").read_text()
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        log.close()


def test_up_pd_serves_through_a_prefill_and_a_decode_worker(tmp_path: Path) -> None:
    """``sluice up --pd``: a prefill and a decode worker, and a request takes both hops (the
    decode simulator counts the prompt whose KV it received as cached)."""
    port = free_port()
    with _up(tmp_path, port, "--pd", "--gateway-procs", "1") as (up, banner):
        assert b"1 prefill + 1 decode sim worker(s)" in banner
        workers = [_cmdline(p) for p in _descendants(up.pid) if " worker " in _cmdline(p)]
        assert sorted(re.search(r"--role (\w+)", w).group(1) for w in workers) == ["decode", "prefill"]
        match = re.search(rb"Redis: (\S+)", banner)
        assert match is not None
        with redis.Redis.from_url(match.group(1).decode()) as registry:
            # Ready means both registered (it meant the first one: its requests found no decode worker).
            assert registry.hlen(keys.workers("sim")) == 2
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                          json={"model": "sim", "prompt": "through two workers", "max_tokens": 3})
        usage = resp.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] > 0, usage
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0


def test_gpu_groups_one_worker_per_device_or_tensor_parallel_group() -> None:
    import pytest

    from sluice.commands.up import gpu_groups

    assert gpu_groups(None, 1) is None
    assert gpu_groups("0,1,2,3", 1) == [["0"], ["1"], ["2"], ["3"]]
    assert gpu_groups("0,1,2,3", 2) == [["0", "1"], ["2", "3"]]
    with pytest.raises(ValueError, match="multiple"):
        gpu_groups("0,1,2", 2)


def test_pd_splits_the_workers_into_prefill_then_decode() -> None:
    import json

    import pytest

    from sluice.commands.up import example_connector, worker_roles

    assert worker_roles(2, False) == ["both", "both"]
    assert worker_roles(2, True) == ["prefill", "decode"]
    assert worker_roles(3, True) == ["prefill", "decode", "decode"]
    with pytest.raises(ValueError, match="a prefill and a decode worker"):
        worker_roles(1, True)
    assert json.loads(example_connector("decode", "/tmp/kv")) == {
        "kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}


def test_up_gpus_flag_is_explained() -> None:
    result = subprocess.run([sys.executable, "-m", "sluice", "up", "--help"], capture_output=True, text=True,
                            cwd=ROOT, timeout=30, check=False)
    assert "--gpus" in result.stdout and "--tensor-parallel" in result.stdout and "--gateway-procs" in result.stdout
    assert "--pd" in result.stdout


def test_each_vllm_worker_gets_its_own_nixl_side_channel_port(monkeypatch) -> None:
    """Regression: every worker of `sluice up --pd` got vLLM's default NIXL side-channel
    port, so a second NixlConnector worker on the host could not listen."""
    from sluice.commands.up import _worker_env

    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    envs = [_worker_env("vllm", i, [str(i)]) for i in range(4)]
    ports = [int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for env in envs if env]
    assert len(set(ports)) == 4 and min(b - a for a, b in zip(ports, ports[1:])) >= 8
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs if env] == ["0", "1", "2", "3"]
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "7000")
    env = _worker_env("vllm", 1, None)
    assert env is not None and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "7016"
    assert _worker_env("trtllm", 0, ["3"])["CUDA_VISIBLE_DEVICES"] == "3"  # type: ignore[index]
    assert _worker_env("sim", 0, None) is None


def test_the_gateway_tokenizes_for_vllm_workers_unless_told_otherwise(monkeypatch) -> None:
    """`sluice up` with vLLM workers gives its gateway the model's folder
    (SLUICE_GATEWAY_TOKENIZER): the gateway's processes tokenize, and a vLLM worker's one
    frontend process no longer bounds one-token requests (H100: 771-911 -> 1,415 req/s at 256
    streams). Other engines have no such folder; a setting of the operator's wins."""
    from sluice.commands.up import _gateway_env

    monkeypatch.delenv("SLUICE_GATEWAY_TOKENIZER", raising=False)
    env = _gateway_env("vllm", "/models/m")
    assert env is not None and env["SLUICE_GATEWAY_TOKENIZER"] == "/models/m"
    assert env["PATH"] == os.environ["PATH"]  # the rest of the environment goes along
    assert _gateway_env("sim", None) is None and _gateway_env("trtllm", "/models/m") is None
    monkeypatch.setenv("SLUICE_GATEWAY_TOKENIZER", "")  # off, as the operator said
    assert _gateway_env("vllm", "/models/m") is None
