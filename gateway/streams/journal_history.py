"""What a producing gateway keeps of its stream's journal, so it can write it again whole.

Redis can lose a journal while its producer runs (a restart without persistence, FLUSHALL,
a failover that lost the latest writes). The producer still has its generation; with
this copy of every event it wrote, it puts events 1..N back, with the same ids, in the
same script call that appends its next events (gateway/streams/journal.py, ``APPEND``), so a
client re-attaching with a ``Last-Event-ID`` from before the loss gets exactly the rest.

The copy is what the journal stores of each event (the compacted SSE bytes and the token
state), packed in one ``bytearray`` with two offsets per event: ``len(stored) +
len(state) + 16`` bytes per event, which is what the journal's byte quota
(gateway/streams/journal_quota.py) already counts for the entry (``ENTRY_OVERHEAD``). So a
gateway process holds at most what its running streams have reserved in Redis: at most
``journal_tenant_max_bytes`` for one API key's streams, ``journal_max_bytes`` for all
(plus the bytearray's slack, under an eighth). It goes with the producer, but for a
finished stream's, which the process's keeper holds a minute more to write it back should
Redis lose it (journal_keeper.py: at most ``journal_keep_max_bytes`` of them a process).

>>> history = JournalHistory()
>>> history.add(b",{...}", b"0|17|5")
>>> list(history.since(1))
[(b',{...}', b'0|17|5')]
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator


class JournalHistory:
    """Events ``base + 1``..N of one stream as the journal stores them, packed. ``base`` is 0
    but for a stream generated again after Redis and its producer lost it (its client holds
    events 1..base, nobody else: gateway/streams/regenerate.py)."""

    __slots__ = ("_data", "_ends", "base")

    def __init__(self, base: int = 0) -> None:
        self._data = bytearray()
        #: Per event, where its stored bytes end, then where its state ends.
        self._ends = array("Q")
        self.base = base

    def __len__(self) -> int:
        return len(self._ends) // 2

    @property
    def last(self) -> int:
        """The number of the last event held (``base`` when none is)."""
        return self.base + len(self)

    def __repr__(self) -> str:
        return f"<JournalHistory events={len(self)} bytes={len(self._data)}>"

    @property
    def nbytes(self) -> int:
        """Bytes held: the events' own and their offsets."""
        return len(self._data) + self._ends.itemsize * len(self._ends)

    def add(self, stored: bytes, state: bytes) -> None:
        self._data += stored
        self._ends.append(len(self._data))
        self._data += state
        self._ends.append(len(self._data))

    def since(self, first: int) -> Iterator[tuple[bytes, bytes]]:
        """(stored, state) of events ``first``..N (numbered from 1; from ``base + 1`` at the earliest)."""
        first = max(1, first - self.base)
        start = self._ends[2 * first - 3] if first > 1 else 0
        for i in range(2 * (first - 1), len(self._ends), 2):
            middle, end = self._ends[i], self._ends[i + 1]
            yield bytes(self._data[start:middle]), bytes(self._data[middle:end])
            start = end
