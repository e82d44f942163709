"""Taking over a resumable stream whose gateway died.

A resumable stream (``Idempotency-Key``) is journaled event by event, each event
before its client sees it (gateway/journal.py). Next to the SSE bytes, every event
that carries tokens records them: ``[[choice, [token ids], characters, finish, prompt
tokens, cached tokens], ...]`` (the last two once the choice's usage is known, else 0;
entries journaled before cached tokens were recorded have five fields).
With the stream's :class:`Plan` (the request, its ids and deadline, written when it
started), any gateway can continue it once its producer's ``:live`` expired:

1. claim ``:live`` (``SET NX``): one gateway wins, the others' readers wait for it; the
   same script makes it the Idempotency-Key's owner (gateway/idempotency.py), so the
   gateway it took the stream from, if it was only stalled, can no longer settle the key;
2. read plan and journal: per choice, the ids and characters its clients have, and
   whether it finished;
3. migrate each unfinished choice to a worker with ``resume_token_ids`` (as for a worker
   that died, gateway/migration.py) and append the new events after the last one, with
   the same chunk id.

A client re-attached with its ``Last-Event-ID`` gets exactly the rest: nothing repeated,
nothing skipped. The take-over is lazy: it starts when a re-attached reader finds the
producer gone (gateway/journal_readers.py), so a stream nobody follows costs nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

import orjson
from redis.asyncio import Redis

from gateway.journal import DONE, stream_key
from gateway.migration import Progress
from gateway.upstream import Line
from sluice import keys


@dataclass(frozen=True, slots=True)
class Plan:
    """What a gateway needs, besides the journal, to continue someone else's stream."""

    kind: str
    body: str  # the request as the client sent it
    internal_id: str
    request_id: str
    chunk_id: str
    created: int
    priority: int
    tenant: str
    cost: int
    deadline_unix: float
    fingerprint: str
    choices: int

    def dumps(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes) -> Plan:
        return cls(**orjson.loads(raw))


@dataclass(slots=True)
class Recovered:
    """A journal read back: where it ends, and what each choice's clients already have."""

    last: int = 0
    done: bool = False
    progress: dict[int, Progress] = field(default_factory=dict)  # unfinished choices
    offsets: dict[int, int] = field(default_factory=dict)  # characters sent, per started choice
    completion_tokens: int = 0
    #: (prompt, cached) tokens each finished choice's usage reported (the worker counts the
    #: prompt for every choice it generates).
    prompts: dict[int, tuple[int, int]] = field(default_factory=dict)

    def prompt_usage(self, n: int) -> tuple[int, int]:
        """The (prompt, cached) tokens the client is billed for so far: once per prompt, so
        only the first choice of each prompt's ``n`` counts (as in gateway/record.py); a
        prompt whose first choice is still to be continued counts when that choice finishes."""
        firsts = [tokens for index, tokens in self.prompts.items() if index % n == 0]
        return sum(p for p, _ in firsts), sum(c for _, c in firsts)


class LineTap:
    """Passes lines through and remembers them, so the journal entry of the event
    rendered from them can say which token ids it carries (:meth:`take`)."""

    def __init__(self, lines: AsyncIterator[tuple[int, Line]]) -> None:
        self._source = lines
        self._seen: list[tuple[int, Line]] = []

    async def lines(self) -> AsyncIterator[tuple[int, Line]]:
        async for item in self._source:
            self._seen.append(item)
            yield item

    def take(self) -> bytes:
        """The token state of the lines consumed since the last call; b"" for none."""
        if not self._seen:
            return b""
        state = [[i, line.get("ids", []), len(line.get("text", "")), line.get("finish_reason"),
                  int((line.get("usage") or {}).get("prompt_tokens", 0)),
                  int((line.get("usage") or {}).get("cached_tokens", 0))]
                 for i, line in self._seen]
        self._seen.clear()
        return orjson.dumps(state)


async def recover(redis: Redis, scope: str) -> tuple[Plan, Recovered] | None:
    """The plan and the journal's state; None when the stream has no plan (it cannot be
    continued)."""
    pipe = redis.pipeline(transaction=False)
    pipe.get(keys.journal_plan(scope))
    pipe.xrange(stream_key(scope))
    raw, entries = await pipe.execute()
    if raw is None:
        return None
    plan = Plan.loads(raw)
    state = Recovered()
    sent: dict[int, list[int]] = {i: [] for i in range(plan.choices)}
    finished: set[int] = set()
    for entry_id, fields in entries:
        ident = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        state.last = int(ident.split("-", 1)[1])
        state.done |= fields.get(b"d") == DONE
        for index, ids, chars, finish, prompt, *cached in orjson.loads(fields[b"s"]) if fields.get(b"s") else ():
            sent[index].extend(ids)
            if finish is not None:
                state.prompts[index] = (prompt, cached[0] if cached else 0)
            state.offsets[index] = state.offsets.get(index, 0) + chars
            state.completion_tokens += len(ids)
            if finish is not None:
                finished.add(index)
    state.progress = {
        index: Progress(tuple(ids), state.offsets.get(index, 0))
        for index, ids in sent.items() if index not in finished
    }
    return plan, state
