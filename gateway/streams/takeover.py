"""Taking over a resumable stream whose gateway died.

A resumable stream (``Idempotency-Key``) is journaled event by event, each event
before its client sees it (gateway/streams/journal.py). Next to the SSE bytes, every event
that carries tokens records them, one line per upstream line, lines joined by ``;``:
``choice|token ids,comma,separated|characters[|finish|prompt tokens|cached tokens]``
(the last three only once a choice finishes or its usage is known; ~8 bytes for one
token where the JSON list it replaced took ~22; JSON lists of 5 or 6 fields, as older
gateways wrote them, still read).
With the stream's :class:`Plan` (the request, its ids and deadline, written when it
started), any gateway can continue it once its producer's ``:live`` expired:

1. claim ``:live`` (``SET NX``): one gateway wins, the others' readers wait for it; the
   same script makes it the Idempotency-Key's owner (gateway/streams/idempotency.py), so the
   gateway it took the stream from, if it was only stalled, can no longer settle the key.
   It lets go of ``:live`` only by compare-and-delete, so it can never free the stream
   for a third gateway while a second one produces it;
2. read plan and journal: per choice, the ids and characters its clients have, and
   whether it finished. The journal must hold events 1..N, every one: a journal Redis
   lost part of (gateway/streams/journal.py) is refused with :class:`HistoryLost`, never
   continued from a partial token history. One exception: a stream generated again
   (gateway/streams/regenerate.py) journals events ``base + 1``..N only, its first ``base``
   being its client's alone; its last event's id says what its clients have in all
   (``Recovered.account``), so the gateway taking it over generates it once more, checked
   against that, as the re-sent POST did (was: :class:`HistoryLost`, and its client had to
   re-send its POST again: the nemesis, seed 11, nem-1246). A journal shorter than what
   the reader holding the most holds is not continued from either: the stream is generated
   again, checked against the account in that reader's id (gateway/relay/serving.py);
3. migrate each unfinished choice to a worker with ``resume_token_ids`` (as for a worker
   that died, gateway/streams/migration.py) and append the new events after the last one, with
   the same chunk id.

A client re-attached with its ``Last-Event-ID`` gets exactly the rest: nothing repeated,
nothing skipped. The take-over is lazy: it starts when a re-attached reader finds the
producer gone (gateway/streams/journal_readers.py), so a stream nobody follows costs nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import orjson
from redis.asyncio import Redis

from gateway.relay.upstream import Line, close_lines
from gateway.streams.event_ids import Account, id_tail, marks, unmarked
from gateway.streams.journal import DONE, ENTRY_OVERHEAD, entry_number, stream_key
from gateway.streams.journal_history import JournalHistory
from gateway.streams.migration import Progress
from sluice import keys
from sluice.errors import UpstreamFailed


class HistoryLost(UpstreamFailed):
    """The journal lacks some of the stream's events: it cannot be continued from it."""

    code = "stream_history_lost"


#: What a client holding events of a stream nobody can continue does next, said wherever
#: the key is left free for it: its POST runs the stream again, checked against what the
#: client holds (gateway/streams/regenerate.py).
RESEND_POST = ("re-send its POST with the same Idempotency-Key and Last-Event-ID (the stream is run again and "
               "checked against what you hold), or without Last-Event-ID to run it anew")


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
    sent: dict[int, list[int]] = field(default_factory=dict)  # the token ids of every choice so far
    offsets: dict[int, int] = field(default_factory=dict)  # characters sent, per started choice
    completion_tokens: int = 0
    stored_bytes: int = 0  # what the journal takes in Redis (as JournalWriter counts it)
    plan: bytes = b""
    #: The tag of event ``last``'s producer (gateway/streams/event_ids.py): the first event
    #: of the take-over names it.
    tag: bytes | None = None
    #: Events 1..last as the journal holds them: the new producer writes them again should
    #: Redis lose them (gateway/streams/journal_history.py).
    history: JournalHistory = field(default_factory=JournalHistory)
    #: Events 1..base are not in the journal: a stream generated again, whose first events
    #: only its client had (gateway/streams/regenerate.py); 0 for any other.
    base: int = 0
    #: The last event's id after its number (its tag, and the account of what a client
    #: holding it has, if the stream keeps one: gateway/streams/event_ids.py).
    account: bytes | None = None
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
    rendered from them can say which token ids it carries (:meth:`take`). With
    ``digest`` (its number of choices), a stream that can be generated again, it also keeps
    the account of what its client has (:meth:`digest`, gateway/streams/event_ids.py),
    starting from the token ``ids`` and ``chars`` characters each choice had before these
    lines (a take-over, a stream generated again)."""

    def __init__(self, lines: AsyncIterator[tuple[int, Line]], *, digest: int = 0,
                 ids: Mapping[int, Sequence[int]] | None = None, chars: Mapping[int, int] | None = None) -> None:
        self._source = lines
        self._seen: list[tuple[int, Line]] = []
        self._account = Account(digest) if digest else None
        if self._account is not None:
            for index, before in (ids or {}).items():
                self._account.add(index, before)
            for index, count in (chars or {}).items():
                self._account.add(index, (), count)

    async def lines(self) -> AsyncIterator[tuple[int, Line]]:
        account = self._account
        try:
            async for item in self._source:
                self._seen.append(item)
                if account is not None:
                    index, line = item
                    account.add(index, line.get("ids", ()), len(line.get("echo", "")) + len(line.get("text", "")))
                yield item
        finally:
            await close_lines(self._source)

    def digest(self) -> bytes:
        """What the client has once it has the lines consumed so far (b"": not kept)."""
        return b"" if self._account is None else self._account.digest()

    def take(self) -> bytes:
        """The token state of the lines consumed since the last call; b"" for none."""
        if not self._seen:
            return b""
        state = b";".join(_state_line(i, line) for i, line in self._seen)
        self._seen.clear()
        return state


def _state_line(index: int, line: Line) -> bytes:
    parts = [str(index), ",".join(map(str, line.get("ids", ()))), str(len(line.get("text", "")))]
    usage = line.get("usage") or {}
    finish, prompt, cached = line.get("finish_reason"), int(usage.get("prompt_tokens", 0)), \
        int(usage.get("cached_tokens", 0))
    if finish is not None or prompt or cached:
        parts += [finish or "", str(prompt), str(cached)]
    return "|".join(parts).encode()


def _state_lines(state: bytes) -> list[tuple[int, list[int], int, str | None, int, int]]:
    """``take``'s state read back; also the JSON lists older gateways wrote (5 fields
    before cached tokens were recorded, then 6)."""
    if not state:
        return []
    if state.startswith(b"["):
        return [(i, ids, chars, finish, prompt, cached[0] if cached else 0)
                for i, ids, chars, finish, prompt, *cached in orjson.loads(state)]
    lines = []
    for raw in state.decode().split(";"):
        index, ids, chars, *rest = raw.split("|")
        finish, prompt, cached = (rest[0] or None, int(rest[1]), int(rest[2]) if len(rest) > 2 else 0) if rest \
            else (None, 0, 0)
        lines.append((int(index), [int(t) for t in ids.split(",")] if ids else [], int(chars), finish, prompt, cached))
    return lines


async def recover(redis: Redis, scope: str) -> tuple[Plan, Recovered] | None:
    """The plan and the journal's state; None when the stream has no plan (it cannot be
    continued). Raises :class:`HistoryLost` when the journal lacks some of its events."""
    pipe = redis.pipeline(transaction=False)
    pipe.get(keys.journal_plan(scope))
    pipe.xrange(stream_key(scope))
    raw, entries = await pipe.execute()
    if raw is None:
        return None
    plan = Plan.loads(raw)
    state = Recovered(plan=raw)
    sent: dict[int, list[int]] = {i: [] for i in range(plan.choices)}
    finished: set[int] = set()
    if entries and entry_number(entries[0][0]) > 1:  # a stream generated again (see the module)
        state.base = state.last = entry_number(entries[0][0]) - 1
        state.history = JournalHistory(base=state.base)
    for entry_id, fields in entries:
        number = entry_number(entry_id)
        if number != state.last + 1:
            raise HistoryLost(f"the stream's journal lacks events {state.last + 1}..{number - 1} (Redis lost "
                              f"data): it cannot be continued; {RESEND_POST}")
        state.last = number
        state.done |= fields.get(b"d") == DONE
        state.stored_bytes += len(fields.get(b"d", b"")) + len(fields.get(b"s", b"")) + ENTRY_OVERHEAD
        state.history.add(fields.get(b"d", b""), fields.get(b"s", b""))
        state.tag = marks(fields.get(b"s", b""))[0]
        state.account = id_tail(fields.get(b"s", b""))
        for index, ids, chars, finish, prompt, cached in _state_lines(unmarked(fields.get(b"s", b""))):
            sent[index].extend(ids)
            if finish is not None:
                state.prompts[index] = (prompt, cached)
            state.offsets[index] = state.offsets.get(index, 0) + chars
            state.completion_tokens += len(ids)
            if finish is not None:
                finished.add(index)
    state.progress = {
        index: Progress(tuple(ids), state.offsets.get(index, 0))
        for index, ids in sent.items() if index not in finished
    }
    state.sent = sent
    return plan, state
