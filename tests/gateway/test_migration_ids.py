"""A choice's relayed token ids (gateway/streams/migration.py keeps them as 32-bit integers,
4 bytes a token): ids no 32-bit integer holds (no vocabulary's: a broken engine's) are relayed
as they come, and only the choice's migration, which could not be token-exact, is refused.
No process: the migrator reads stand-in upstreams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.streams.migration import Migrator
from sluice.errors import UpstreamFailed


class _Upstream:
    worker_id = "w1"

    def __init__(self, lines: list[dict[str, Any]], breaks: bool = False) -> None:
        self._lines = lines
        self._breaks = breaks

    async def lines(self, stall_s: float, deadline: float) -> AsyncIterator[dict[str, Any]]:
        for line in self._lines:
            yield line
        if self._breaks:
            raise UpstreamFailed("the worker broke off", code="worker_lost")

    async def aclose(self) -> None:
        pass


class _Context(SimpleNamespace):
    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def lost_a_worker(self, worker_id: str) -> bool:
        return True  # another worker died too: not a query of death

    def first_to_say(self, *what: str) -> bool:
        return True


def _relay(upstream: _Upstream) -> list[str]:
    migrator = Migrator(SimpleNamespace(stall_timeout_s=5, max_migrations=2), None)  # type: ignore[arg-type]
    ctx = _Context(deadline=time.monotonic() + 10, request_id="r1", internal_id="i1")

    async def relayed() -> list[str]:
        return [line["text"] async for _, line in migrator.lines("m", [upstream], [{}], ctx)]  # type: ignore[list-item]

    return asyncio.run(relayed())


@pytest.mark.parametrize("ids", [[2**31], [1.0], [-1]])
def test_ids_no_32_bit_integer_holds_are_relayed_as_they_come(ids: list[Any]) -> None:
    """Regression: an id of 2**31 or more, or a float, failed the stream before its first
    line (OverflowError, TypeError), where a list of them had relayed it whole."""
    lines = [{"ids": ids, "text": "a"}, {"ids": [5], "text": "b", "finish_reason": "stop"}]
    assert _relay(_Upstream(lines)) == ["a", "b"]


def test_a_choice_with_such_ids_is_not_migrated_when_its_worker_breaks_off() -> None:
    lines = [{"ids": [2**31 + n], "text": "x"} for n in range(8)]
    with pytest.raises(UpstreamFailed, match="no 32-bit integers"):
        _relay(_Upstream(lines, breaks=True))
