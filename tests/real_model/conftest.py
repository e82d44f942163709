"""Real-model modules each start their own vLLM processes (a worker holds about 3 GB:
engine core, model runner, KV cache). Stopped when their module ends, not with the
session, so the suite never holds more than one module's engines on a 24 GB machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import Proc


@pytest.fixture(scope="module", autouse=True)
def _engines_stop_with_their_module(procs: list[Proc]) -> Iterator[None]:
    before = len(procs)
    yield
    for proc in procs[before:]:
        proc.stop(timeout_s=15)
