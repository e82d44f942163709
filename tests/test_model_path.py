"""A bad --model path is a clear message and exit code, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["worker", "--engine", "vllm"], ["up", "--engine", "vllm"]])
@pytest.mark.parametrize(
    ("path", "message"),
    [("/no/such/model", "does not exist"), ("/etc", "no config.json"), ("/etc/hostname", "not a folder")],
)
def test_bad_model_path(command: list[str], path: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sluice", *command, "--model", path],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
