"""Drive docker-compose.yml for real: the Docker engine, the images, the project's containers.

The engine comes from ``shared/docker/base-images.sh`` (Debian's dockerd and local stand-ins
for the public base images, since no registry is reachable where Sluice is developed and
tested). The script sits in a ``shared`` folder beside the checkout (CI: ``../shared``) or
beside one of its parents (a worktree); ``SLUICE_DOCKER_SETUP`` names it explicitly.
Nothing here skips: without an engine the tests fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.conftest import pid_alive

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
SETUP_SCRIPT = Path("shared/docker/base-images.sh")
# What a killed engine leaves behind: dockerd refuses to start while its pid file names a process
# that runs, and a machine that kills every process of a session (as CI's does) reuses the pid.
ENGINE_PID_FILES = {Path("/var/run/docker.pid"): "dockerd",
                    Path("/var/run/docker/containerd/containerd.pid"): "containerd"}


def setup_script() -> Path:
    explicit = os.environ.get("SLUICE_DOCKER_SETUP")
    if explicit:
        return Path(explicit)
    for parent in ROOT.parents:
        if (parent / SETUP_SCRIPT).is_file():
            return parent / SETUP_SCRIPT
    raise AssertionError(f"no {SETUP_SCRIPT} beside {ROOT} or its parents (set SLUICE_DOCKER_SETUP)")


def run(argv: list[str], timeout_s: float = 300, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False,
                          env={**os.environ, **(env or {})})
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def remove_stale_engine_pid_files() -> list[Path]:
    """Remove the pid files of an engine that no longer runs; return those removed."""
    if run(["docker", "info"], timeout_s=60, check=False).returncode == 0:
        return []
    removed = []
    for path, program in ENGINE_PID_FILES.items():
        try:
            pid = int(path.read_text().strip())
        except (OSError, ValueError):
            continue
        try:
            running = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            running = ""
        if running != program or not pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def start_engine() -> None:
    """Start dockerd and build the base-image stand-ins (idempotent; seconds once done)."""
    script = setup_script()
    prometheus = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["prometheus"]["image"]
    assert os.geteuid() == 0, f"{script} must run as root (CI runs as root)"
    if shutil.which("docker"):
        remove_stale_engine_pid_files()
    run(["bash", str(script)], timeout_s=900, env={"PROMETHEUS_TAGS": prometheus})
    assert shutil.which("docker-compose"), "docker-compose is not installed"


def build(dockerfile: str, tag: str) -> None:
    # --network host: inside builds, PyPI is reachable only through the host's network here.
    # --force-rm: a failed step leaves no stopped container behind.
    run(["docker", "build", "--network", "host", "--force-rm", "-q", "-f", str(ROOT / dockerfile), "-t", tag,
         str(ROOT)], timeout_s=900)


def poll(predicate: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.5) -> None:
    """Poll something outside this process (containers, Prometheus) until true."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(every_s)


@dataclass
class Project:
    """One compose project, named so that parallel runs on one engine never meet."""

    name: str
    env: dict[str, str] = field(default_factory=dict)

    def compose(self, *args: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(["docker-compose", "-p", self.name, "-f", str(COMPOSE_FILE),
                    "--project-directory", str(ROOT), *args], timeout_s=timeout_s, env=self.env, check=check)

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).stdout.split()

    def inspect(self, container: str) -> dict:
        return json.loads(run(["docker", "inspect", container]).stdout)[0]

    def healthy(self, service: str, count: int) -> bool:
        states = [self.inspect(c)["State"] for c in self.containers(service)]
        return len(states) == count and all(s.get("Health", {}).get("Status") == "healthy" for s in states)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes that still carry this project's label."""
        label = f"label=com.docker.compose.project={self.name}"
        return {kind: run(["docker", *cmd, "--filter", label, "-q"]).stdout.split()
                for kind, cmd in (("containers", ["ps", "-a"]), ("networks", ["network", "ls"]),
                                  ("volumes", ["volume", "ls"]))}

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", check=False).stdout


def remove_abandoned_projects() -> list[str]:
    """Remove the stacks of test runs that were killed before their clean-up (their pytest
    process is gone): with ``restart: unless-stopped`` their containers restart for ever
    without their Redis and take the CPU the next run's timings need (one such stack
    restarted 124 times in two hours under a nemesis run)."""
    labels = run(["docker", "ps", "-a", "--format", '{{.Label "com.docker.compose.project"}}']).stdout.split()
    gone = sorted({name for name in labels if name.startswith("sluicetest") and name[10:].isdigit()
                   and not pid_alive(int(name[10:]))})
    for name in gone:
        Project(name).compose("down", "-v", "--remove-orphans", "-t", "1", check=False)
    return gone

