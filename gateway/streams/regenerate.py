"""Generating a resumable stream again when its client is the only one left that holds it.

A resumable stream survives its producer's death (another gateway takes it over from the
journal, gateway/streams/takeover.py) and Redis losing its data (the producer writes the
journal back, gateway/streams/journal.py). Both at once, within the few seconds before a
take-over, leave the stream nowhere but in its client: the nemesis's one-Redis run ended
all of its last 10 inexact resumable streams so (a producing gateway killed, then Redis
restarted empty or flushed before ``:live`` expired), with ``stream_history_lost``.

So a stream that another engine could continue from its tokens alone (no
grammar, no tool-call parser, no logprobs, the chat and completions surfaces) carries, in
every event id, what the client holds: ``id: N.tag.K.C.H``, the number ``K`` of completion
tokens it has, the characters ``C`` of text they make, and ``H`` a hash of their ids
(:class:`gateway.streams.event_ids.Account`). When the client re-sends its POST with that
``Last-Event-ID`` and Redis knows nothing of the key (after waiting, as any such POST does,
for a producer that may still write it back), the gateway runs the request again as a new
producer and, before the first event it sends, checks that the new generation's first ``K``
tokens hash to ``H``. If they do, the client gets the rest, numbered from ``N + 1``, with
the stream's own chunk id (a resumable stream's id comes from its key) and usage for the
whole completion; if they do not (a sampled stream without a seed, a changed model), the
in-band ``stream_history_lost`` error, never a splice. The regenerated journal starts at
``N + 1``: a client holding fewer events finds it short and is told its history is lost
(then re-sends its POST in turn); a gateway taking the stream over (its producer died too)
generates it once more, checked against the account in the journal's last event
(gateway/streams/takeover.py).

A stream of several choices carries each choice's tokens and characters in its ids, and
one hash of every choice's ids: its new generation's lines wait until every choice has
given the client's tokens and the hash is checked (streams of up to 128 choices).

Left as it was: logprobs (the tokens before the client's last one cannot be split off a
line's logprobs), and the Responses and Messages surfaces (their typed events keep their
own counters).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.relay.upstream import Line, close_lines
from gateway.streams import event_ids
from gateway.streams.event_ids import MAX_DIGEST_CHOICES, Account
from gateway.streams.migration import resumable
from gateway.streams.takeover import HistoryLost


def digestible(payloads: list[dict[str, Any]], shaped: bool) -> int:
    """How many choices a resumable stream of these worker payloads has, if it can be
    generated again (its event ids then carry the account of what its client has); else 0."""
    if shaped or not all(resumable(p) and p.get("logprobs") is None for p in payloads):
        return 0
    return len(payloads) if len(payloads) <= MAX_DIGEST_CHOICES else 0


def chunk_id(kind: str, key: str) -> str:
    """A resumable stream's chunk id, from its (scoped) Idempotency-Key: the same for a
    stream generated again, whose first generation's id only its client knows."""
    return ("cmpl-" if kind == "text" else "chatcmpl-") + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class Held:
    """What a client re-sending its POST holds of a stream nobody else has: events 1..``after``
    of the history ``tag``; per choice, ``tokens`` completion tokens and ``chars`` characters
    of text; ``ids_hash``, the hash of their ids (:class:`gateway.streams.event_ids.Account`)."""

    after: int
    tag: bytes | None
    tokens: tuple[int, ...]
    chars: tuple[int, ...]
    ids_hash: bytes

    @classmethod
    def of(cls, event_id: str | None) -> Held | None:
        """What a client whose last event has this id holds, if the id carries its account
        (a ``Last-Event-ID``, a journal's last event, a reader's); else None.

        >>> Held.of("3.3fa9c2d1.4.12.5be0a7c1")
        Held(after=3, tag=b'3fa9c2d1', tokens=(4,), chars=(12,), ids_hash=b'5be0a7c1')
        >>> Held.of("3.3fa9c2d1") is None
        True
        """
        after, tag = event_ids.parse(event_id)
        account = event_ids.held(event_id) if after else None
        return None if account is None else cls(after, tag, *account)

    def offsets(self) -> dict[int, int]:
        """The characters of each choice the client has, for choices it has any event of
        (those got their first chunk: no second role chunk)."""
        return {index: chars for index, (tokens, chars) in enumerate(zip(self.tokens, self.chars, strict=True))
                if tokens or chars or len(self.tokens) == 1}

    async def rest(self, lines: AsyncIterator[tuple[int, Line]],
                   limits: Sequence[int | None]) -> AsyncIterator[tuple[int, Line]]:
        """The new generation's lines, those the client has emptied of their text (their ids
        stay: usage counts them), once the ids of every choice's first tokens are checked
        against the client's. Lines past what the client has wait for that check (at most
        the generation itself: no choice's account may exceed its ``limits``, max_tokens)."""
        if len(limits) != len(self.tokens):
            raise self._lost(f"it has {len(limits)} choice(s), the client's account {len(self.tokens)}")
        if any(limit is not None and held > limit for held, limit in zip(self.tokens, limits, strict=True)):
            # An id we never gave: no generation could reach it, and waiting for it would hold
            # every other choice's lines until the end.
            raise self._lost("the client's account has more tokens than the request allows")
        try:
            choices = len(limits)
            account = Account(choices)
            chars = [0] * choices  # the text of the lines before each choice's last held token
            pending = sum(1 for tokens in self.tokens if tokens)  # choices short of what the client has
            waiting: list[tuple[int, Line]] | None = []  # None once checked
            if not pending:
                waiting = self._check(account, waiting)
            async for index, line in lines:
                held = self.tokens[index]
                if account.tokens[index] < held:
                    ids = line.get("ids", ())
                    text = line.get("echo", "") + line.get("text", "")
                    take = min(len(ids), held - account.tokens[index])
                    account.add(index, ids[:take])
                    bare = {k: v for k, v in line.items() if k not in ("echo", "lp")}
                    if account.tokens[index] < held:
                        if line.get("finish_reason") is not None:
                            raise self._lost(f"choice {index} of the new generation ended after "
                                             f"{account.tokens[index]} tokens")
                        chars[index] += len(text)
                        yield index, {**bare, "text": ""}
                        continue
                    cut = self.chars[index] - chars[index]
                    if not 0 <= cut <= len(text):
                        raise self._lost(f"the text of choice {index} does not match the client's")
                    line = {**bare, "text": text[cut:]}
                    pending -= 1
                if waiting is None:
                    yield index, line
                    continue
                waiting.append((index, line))
                if not pending:
                    for item in self._check(account, waiting):
                        yield item
                    waiting = None
            if pending:
                raise self._lost("the new generation ended before it gave the client's tokens")
            for item in waiting or ():
                yield item
        finally:
            await close_lines(lines)  # a failed check, or closed at a yield: the choices stop

    def _check(self, account: Account, waiting: list[tuple[int, Line]]) -> list[tuple[int, Line]]:
        """The lines that waited for the check, once the ids match the client's."""
        if account.ids_hash() != self.ids_hash:
            raise self._lost(f"its first {':'.join(map(str, self.tokens))} tokens differ from the client's")
        return waiting

    def _lost(self, why: str) -> HistoryLost:
        return HistoryLost(f"the stream this Last-Event-ID ({self.after}) belongs to was lost (Redis and its "
                           f"gateway), and running it again did not give the same tokens ({why}): it cannot be "
                           "resumed; send the request without Last-Event-ID to run it again")
