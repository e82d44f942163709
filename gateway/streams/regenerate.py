"""Generating a resumable stream again when its client is the only one left that holds it.

A resumable stream survives its producer's death (another gateway takes it over from the
journal, gateway/streams/takeover.py) and Redis losing its data (the producer writes the
journal back, gateway/streams/journal.py). Both at once, within the few seconds before a
take-over, leave the stream nowhere but in its client: the nemesis's one-Redis run ended
all of its last 10 inexact resumable streams so (a producing gateway killed, then Redis
restarted empty or flushed before ``:live`` expired), with ``stream_history_lost``.

So a stream of one choice that another engine could continue from its tokens alone (no
grammar, no tool-call parser, no logprobs, the chat and completions surfaces) carries, in
every event id, what the client holds: ``id: N.tag.K.C.H``, the number ``K`` of completion
tokens it has, the characters ``C`` of text they make, and ``H`` a hash of their ids
(:func:`gateway.streams.event_ids.digest`). When the client re-sends its POST with that
``Last-Event-ID`` and Redis knows nothing of the key (after waiting, as any such POST does,
for a producer that may still write it back), the gateway runs the request again as a new
producer and, before the first event it sends, checks that the new generation's first ``K``
tokens hash to ``H``. If they do, the client gets the rest, numbered from ``N + 1``, with
the stream's own chunk id (a resumable stream's id comes from its key) and usage for the
whole completion; if they do not (a sampled stream without a seed, a changed model), the
in-band ``stream_history_lost`` error, never a splice. The regenerated journal starts at
``N + 1``: a client holding fewer events, or a later take-over, finds it short and is told
its history is lost (then re-sends its POST in turn).

Left as it was: streams of several choices (each choice's account would go in every id),
logprobs (the tokens before the client's last one cannot be split off a line's logprobs),
and the Responses and Messages surfaces (their typed events keep their own counters).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway.relay.upstream import Line
from gateway.streams.event_ids import ids_hasher
from gateway.streams.migration import resumable
from gateway.streams.takeover import HistoryLost


def digestible(payloads: list[dict[str, Any]], shaped: bool) -> bool:
    """Whether a resumable stream of these worker payloads can be generated again, and so
    carries the account of its client's text in its event ids."""
    return not shaped and len(payloads) == 1 and resumable(payloads[0]) and payloads[0].get("logprobs") is None


def chunk_id(kind: str, key: str) -> str:
    """A resumable stream's chunk id, from its (scoped) Idempotency-Key: the same for a
    stream generated again, whose first generation's id only its client knows."""
    return ("cmpl-" if kind == "text" else "chatcmpl-") + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class Held:
    """What a client re-sending its POST holds of a stream nobody else has: events 1..``after``
    of the history ``tag``, ``tokens`` completion tokens whose ids hash to ``ids_hash``,
    ``chars`` characters of text."""

    after: int
    tag: bytes | None
    tokens: int
    chars: int
    ids_hash: bytes

    async def rest(self, lines: AsyncIterator[tuple[int, Line]]) -> AsyncIterator[tuple[int, Line]]:
        """The new generation's lines, those the client has emptied of their text (their ids
        stay: usage counts them), once their ids are checked against the client's."""
        hasher = ids_hasher()
        seen_ids = seen_chars = 0
        if self.tokens == 0:
            self._check(hasher)
        async for index, line in lines:
            if seen_ids >= self.tokens:
                yield index, line
                continue
            ids = line.get("ids", ())
            text = line.get("echo", "") + line.get("text", "")
            take = min(len(ids), self.tokens - seen_ids)
            for token in ids[:take]:
                hasher.update(b"%d," % token)
            seen_ids += take
            bare = {k: v for k, v in line.items() if k not in ("echo", "lp")}
            if seen_ids < self.tokens:
                if line.get("finish_reason") is not None:
                    raise self._lost(f"the new generation ended after {seen_ids} tokens")
                seen_chars += len(text)
                yield index, {**bare, "text": ""}
                continue
            self._check(hasher)
            cut = self.chars - seen_chars
            if not 0 <= cut <= len(text):
                raise self._lost("its text does not match the client's")
            yield index, {**bare, "text": text[cut:]}
        if seen_ids < self.tokens:
            raise self._lost(f"the new generation ended after {seen_ids} tokens")

    def _check(self, hasher: Any) -> None:
        if hasher.hexdigest().encode() != self.ids_hash:
            raise self._lost(f"its first {self.tokens} tokens differ from the client's")

    def _lost(self, why: str) -> HistoryLost:
        return HistoryLost(f"the stream this Last-Event-ID ({self.after}) belongs to was lost (Redis and its "
                           f"gateway), and running it again did not give the same tokens ({why}): it cannot be "
                           "resumed; send the request without Last-Event-ID to run it again")
