"""CPU seconds of processes and everything under them, from /proc (Linux): the peers
benchmark's per-path CPU columns and the GPU kit's per-load CPU (gpu/peers_cpu.py)."""

from __future__ import annotations

import os

TICK = os.sysconf("SC_CLK_TCK")


def process_table() -> dict[int, tuple[int, int, float]]:
    """pid -> (parent pid, process group, user + system CPU seconds) of every live process."""
    table: dict[int, tuple[int, int, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # after the name: state, ppid, pgrp, ..., utime (11), stime (12)
        table[int(entry.name)] = (int(fields[1]), int(fields[2]), (int(fields[11]) + int(fields[12])) / TICK)
    return table


def tree(roots: set[int], table: dict[int, tuple[int, int, float]]) -> set[int]:
    """``roots`` and every live process under them (children in sessions of their own too,
    as ``sluice gateway --procs N`` starts them)."""
    inside = roots & table.keys()
    while more := {pid for pid, (ppid, _, _) in table.items() if ppid in inside} - inside:
        inside |= more
    return inside


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy (not idle, not waiting on I/O) since
    boot: what all processes, the kernel's own work on their behalf included, took."""
    with open("/proc/stat", "rb") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK  # user..steal, less idle and iowait
