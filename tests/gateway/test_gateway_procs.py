"""``sluice gateway --procs N``: N processes on one port, sharing nothing but Redis."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from tests.conftest import wait_for


def _gateway_names(redis_client) -> set[str]:
    return {c["name"] for c in redis_client.client_list() if c.get("name", "").startswith("sluice-gateway-")}


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def test_procs_share_the_port_and_a_dead_one_comes_back(start_worker, start_gateway, redis_client) -> None:
    start_worker("procs")
    before = _gateway_names(redis_client)
    gateway = start_gateway(processes=3)
    body = {"model": "procs", "prompt": "x", "max_tokens": 2}
    for _ in range(40):  # a new connection each time: the kernel spreads them over the processes
        resp = httpx.post(gateway.url + "/v1/completions", json=body, headers={"connection": "close"})
        assert resp.status_code == 200
    wait_for(lambda: len(_gateway_names(redis_client) - before) == 3, 10, "three gateway processes in Redis")
    children = _children(gateway.pid)
    assert len(children) == 3
    os.kill(children[0], signal.SIGKILL)
    wait_for(lambda: len(_children(gateway.pid)) == 3 and children[0] not in _children(gateway.pid), 15,
             "the dead gateway process to be replaced")
    deadline = time.monotonic() + 10
    while httpx.post(gateway.url + "/v1/completions", json=body).status_code != 200:
        assert time.monotonic() < deadline
    assert gateway.stop(timeout_s=40) == 0
    assert not any(_running(pid) for pid in children[1:])


def _served(metrics_text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith("sluice_gateway_requests_total{") and 'status="ok"' in line)


def test_every_scrape_counts_every_process(start_worker, start_gateway) -> None:
    """A scrape lands on one of the N processes; it must still count what all of them served
    (was: each scrape showed one process's counters, so the series jumped between scrapes)."""
    start_worker("procs-metrics")
    gateway = start_gateway(processes=3)
    body = {"model": "procs-metrics", "prompt": "x", "max_tokens": 2}
    for _ in range(30):
        assert httpx.post(gateway.url + "/v1/completions", json=body, headers={"connection": "close"}).status_code == 200
    for _ in range(12):  # new connections: the kernel spreads the scrapes over the processes too
        text = httpx.get(gateway.url + "/metrics", headers={"connection": "close"}).text
        assert _served(text) == 30
        assert "sluice_gateway_in_flight_requests 0.0" in text
    assert gateway.stop(timeout_s=40) == 0


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
