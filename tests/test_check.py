"""``sluice check URL``, the containers' healthcheck: its exit code, and what it loads."""

from __future__ import annotations

import subprocess
import sys

from sluice.embedded_redis import free_port
from tests.conftest import ROOT


def check(*args: str) -> int:
    return subprocess.run([sys.executable, "-m", "sluice", "check", *args], cwd=ROOT, timeout=30).returncode


def test_check_is_0_for_a_200_and_1_for_anything_else(start_worker) -> None:
    worker = start_worker("checked")
    assert check(worker.url + "/health") == 0
    assert check(worker.url + "/no-such-page") == 1  # 404
    assert check(f"http://127.0.0.1:{free_port()}/health", "--timeout-s", "1") == 1  # refused
    assert check("not a url") == 1


def test_check_loads_nothing_but_the_standard_library() -> None:
    """Regression: compose runs it every 2 s per container; through the whole command line
    (httpx, the bench's modules) one check took 0.84 s of CPU."""
    probe = ("import sys; from sluice.commands.main import main\n"
             "try: main(['check', 'http://127.0.0.1:1/'])\n"
             "except SystemExit: pass\n"
             "print(sorted(m for m in ('httpx', 'redis', 'gateway', 'sluice.commands.bench') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
