"""Helpers for child processes that must never outlive their parent."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def child_preexec() -> None:
    """Run in the child before exec: die with SIGTERM when the parent dies (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
