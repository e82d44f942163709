"""Event ids that name the history they belong to.

A resumable stream's event N can exist in two histories. Its producer, cut off from a Redis
that the other gateways still reached (a failover, a cut link), went on generating while
another gateway took the stream over after the last event Redis had and continued it under
the same numbers, chunked differently; when Redis then lost its data, the first producer's
copy came back. A client that held events up to 278 of one history and read 279 of the other
got duplicated and missing tokens (the nemesis, Sentinel: nem-4573), and nothing in
``id: 279`` could tell the two apart.

So every journal entry carries a *mark* in front of its token state: ``~tag`` names the
producer that wrote it (a hash of its claim token, 8 hex digits), and the first event a
take-over writes names the producer of the event before it too (``~tag<prev``). An event
continues the history a reader holds when its tag is that of the reader's last event, or
its ``prev`` is. Clients get the tag in the event id, ``id: 279.3fa9c2d1``, and send it
back as ``Last-Event-ID``; a reader (a re-attached client, or the first client catching up
from the journal) that finds the next event in another history ends with the in-band
``stream_history_lost`` error instead of a splice. Ids without a tag (plain ``N``) and
entries without a mark (older gateways) are not checked.

>>> frame(3, b"data: x\\n\\n", b"3fa9c2d1")
b'id: 3.3fa9c2d1\\ndata: x\\n\\n'
>>> parse("3.3fa9c2d1")
(3, b'3fa9c2d1')
>>> follows(b"3fa9c2d1", *marks(b"~77aa01bc<3fa9c2d1;0|17|5"))
True
"""

from __future__ import annotations

import hashlib

DONE = b"data: [DONE]\n\n"


def tag_of(owner: str) -> bytes:
    """The tag of the producer whose claim token is ``owner``."""
    return hashlib.blake2b(owner.encode(), digest_size=4).hexdigest().encode()


def mark(state: bytes, tag: bytes, prev: bytes | None = None) -> bytes:
    """``state`` (an entry's token state) with the mark of the producer ``tag`` in front;
    ``prev``: the producer of the event before, when it was another (a take-over)."""
    head = b"~" + tag + (b"<" + prev if prev else b"")
    return head + b";" + state if state else head


def marks(state: bytes) -> tuple[bytes | None, bytes | None]:
    """(tag, prev) of an entry's state; (None, None) when it has no mark."""
    if not state.startswith(b"~"):
        return None, None
    tag, _, prev = state.split(b";", 1)[0][1:].partition(b"<")
    return tag, prev or None


def unmarked(state: bytes) -> bytes:
    """The token state without its mark."""
    if not state.startswith(b"~"):
        return state
    _, _, rest = state.partition(b";")
    return rest


def follows(chain: bytes | None, tag: bytes | None, prev: bytes | None) -> bool:
    """Whether an entry marked (``tag``, ``prev``) continues a history whose last event's tag
    is ``chain`` (None: unknown, anything goes)."""
    return chain is None or tag is None or tag == chain or prev == chain


def frame(number: int, event: bytes, tag: bytes | None = None) -> bytes:
    """Event ``number`` as a client gets it: with its ``id:``, except the final ``[DONE]``."""
    if event == DONE:
        return DONE
    return b"id: %d.%b\n%b" % (number, tag, event) if tag else b"id: %d\n%b" % (number, event)


def parse(header: str | None) -> tuple[int, bytes | None]:
    """A ``Last-Event-ID``: (the event number, its tag or None); (0, None) when absent or
    not one of ours."""
    if header is None:
        return 0, None
    number, _, tag = header.strip().partition(".")
    try:
        after = max(0, int(number))
    except ValueError:
        return 0, None
    clean = tag.encode() if tag and len(tag) <= 16 and all(c in "0123456789abcdef" for c in tag) else None
    return after, clean if after else None
