"""Child processes that must never outlive their parent, and their supervision."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger("sluice.processes")

_PR_SET_PDEATHSIG = 1


def default_procs(cores: int | None = None, share: int = 2) -> int:
    """Gateway processes for this machine: one per ``share`` cores, 1 to 8."""
    return max(1, min(8, (cores or os.cpu_count() or 1) // share))


def child_preexec() -> None:
    """Run in the child before exec: die with SIGTERM when the parent dies (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Child:
    """One supervised process; ``restart()`` brings it back with backoff."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._next_start = 0.0
        self._signalled = False

    def start(self) -> None:
        # Own session: a terminal's Ctrl-C reaches only the supervisor, which then
        # stops the children in order (each gets exactly one signal and drains).
        self.process = subprocess.Popen(
            self.argv, preexec_fn=child_preexec, start_new_session=True, env=self.env
        )
        self._signalled = False
        log.info("started %s (pid %d)", self.name, self.process.pid)

    def kill_group(self) -> None:
        """Kill what the child left behind (vLLM's engine processes survive a SIGKILLed worker)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def restart_if_due(self) -> None:
        now = time.monotonic()
        if self._next_start == 0.0:
            self.kill_group()
            code = self.process.returncode if self.process else None
            delay = min(30.0, 0.5 * 2**self.restarts)
            log.warning("%s exited with code %s; restarting in %.1fs", self.name, code, delay)
            self._next_start = now + delay
        elif now >= self._next_start:
            self.restarts += 1
            self._next_start = 0.0
            self.start()

    def signal_stop(self) -> None:
        """SIGTERM, once: a second one is the child's force-exit (Ctrl-C twice), which cuts
        the streams its first one lets drain (a supervisor that signalled every child and then
        stopped each one in turn signalled twice: `docker stop` cut the gateway's streams)."""
        if self.alive() and not self._signalled:
            assert self.process is not None
            self._signalled = True
            self.process.terminate()

    def stop(self, timeout_s: float) -> None:
        """Signal (unless already signalled), wait up to ``timeout_s``, then kill."""
        if self.alive():
            assert self.process is not None
            self.signal_stop()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", self.name, timeout_s)
                self.process.kill()
                self.process.wait()
        self.kill_group()
