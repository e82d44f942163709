"""Cache routing at the gateway: a prompt's prefix blocks, and the check of the router's guess.

The admission scripts choose the worker (gateway/admission/scripts.py); this module gives them
the prompt's block hashes (:class:`PromptPrefix`: blocks of words for the approximate index,
blocks of the model's token ids for the precise one), and when the engine answers, it
compares what the index expected the worker to hold with the ``cached_tokens`` the
engine reported (:class:`RouteCheck`): the difference is the routing accuracy metric,
and blocks the worker turned out not to hold leave the index (:class:`PrefixIndex`).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from sluice import prefix_tokens
from sluice.prefix import (
    BLOCK_TOKENS,
    block_hashes_of_words,
    expected_cached_tokens,
    payload_text,
)
from sluice.prefix_index import PrefixIndex


@dataclass(frozen=True, slots=True)
class PromptPrefix:
    """A prompt's block hashes and its length: in words (the approximate index's stand-in
    for tokens), or, when ``precise``, in the model's tokens (blocks of
    :data:`sluice.prefix_tokens.TOKEN_BLOCK` token ids)."""

    blocks: tuple[str, ...]
    words: int
    precise: bool = False

    @classmethod
    def of(cls, payload: dict[str, Any]) -> PromptPrefix:
        words = payload_text(payload).split()
        return cls(tuple(block_hashes_of_words(words)), len(words))

    @classmethod
    def of_tokens(cls, ids: list[int]) -> PromptPrefix:
        return cls(tuple(prefix_tokens.token_block_hashes(ids)), len(ids), precise=True)


@dataclass(frozen=True, slots=True)
class RouteCheck:
    """The router's expectation for one attempt against the engine's report.

    ``expected``: tokens the index said were cached on the worker; ``reported``: the
    engine's ``cached_tokens``; ``held_blocks``: blocks the worker really had (reported
    tokens converted back to the gateway's blocks of words).
    """

    expected: int
    reported: int
    held_blocks: int

    @classmethod
    def of(cls, prefix: PromptPrefix, matched_blocks: int, usage: dict[str, Any], resumed: int) -> RouteCheck:
        # A resumed request's prompt holds the tokens already generated; the prefix does not.
        prompt_tokens = max(0, int(usage.get("prompt_tokens", 0)) - resumed)
        reported = min(int(usage.get("cached_tokens", 0)), prompt_tokens)
        if prefix.precise:  # blocks of the engine's own tokens: nothing to scale
            expected = prefix_tokens.expected_cached_tokens(matched_blocks, prompt_tokens)
            # Short of the expectation by less than a block: the engine rounds its hit down to
            # its own (smaller) blocks, the last one of a prompt it holds whole included.
            held = matched_blocks if expected - reported < prefix_tokens.TOKEN_BLOCK \
                else reported // prefix_tokens.TOKEN_BLOCK
            return cls(expected=expected, reported=reported, held_blocks=held)
        expected = expected_cached_tokens(matched_blocks, prefix.words, prompt_tokens)
        held = math.floor(reported * prefix.words / prompt_tokens / BLOCK_TOKENS) if prompt_tokens else 0
        return cls(expected=expected, reported=reported, held_blocks=held)

    @property
    def error(self) -> int:
        return abs(self.expected - self.reported)


class IndexCorrections:
    """Fire-and-forget corrections of the index, off the response path."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        self._tasks: set[asyncio.Task[None]] = set()

    def worker_lacks(self, model: str, worker_id: str, prefix: PromptPrefix, held: int, matched: int) -> None:
        """The worker held only ``held`` leading blocks, not the ``matched`` the index said."""
        if held >= matched:
            return
        task = asyncio.create_task(self._index.correct(model, worker_id, list(prefix.blocks[held:matched])))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
