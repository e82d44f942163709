"""Event ids that name the history they belong to.

A resumable stream's event N can exist in two histories. Its producer, cut off from a Redis
that the other gateways still reached (a failover, a cut link), went on generating while
another gateway took the stream over after the last event Redis had and continued it under
the same numbers, chunked differently; when Redis then lost its data, the first producer's
copy came back. A client that held events up to 278 of one history and read 279 of the other
got duplicated and missing tokens (the nemesis, Sentinel: nem-4573), and nothing in
``id: 279`` could tell the two apart.

So every journal entry carries a *mark* in front of its token state: ``~tag`` names the
producer that wrote it (its gateway process's name, 6 hex digits, gateway/streams/producers.py,
then a hash of its claim token, 8), and the first event a
take-over writes names the producer of the event before it too (``~tag<prev``). An event
continues the history a reader holds when its tag is that of the reader's last event, or
its ``prev`` is. Clients get the tag in the event id, ``id: 279.3fa9c2d1``, and send it
back as ``Last-Event-ID``; a reader (a re-attached client, or the first client catching up
from the journal) that finds the next event in another history ends with the in-band
``stream_history_lost`` error instead of a splice. Ids without a tag (plain ``N``) and
entries without a mark (older gateways) are not checked.

A stream that can be generated again (gateway/streams/regenerate.py) also carries a
*digest* of what its client has: ``id: 279.3fa9c2d1.275.1042.5be0a7c1``, the completion
tokens so far, the characters of their text, and a hash of their ids (with several choices,
``K0:K1`` tokens and ``C0:C1`` characters per choice, and one hash of them all). When Redis
lost the stream and its producer died too, the client alone holds it; its re-sent POST with
that ``Last-Event-ID`` runs the request again, checks the new tokens against the digest,
and goes on after them.

>>> frame(3, b"data: x\\n\\n", b"3fa9c2d1")
b'id: 3.3fa9c2d1\\ndata: x\\n\\n'
>>> parse("3.3fa9c2d1")
(3, b'3fa9c2d1')
>>> held("3.3fa9c2d1.4.12.5be0a7c1")
((4,), (12,), b'5be0a7c1')
>>> held("9.3fa9c2d1.4:3.12:9.0c1d2e3f")
((4, 3), (12, 9), b'0c1d2e3f')
>>> follows(b"3fa9c2d1", *marks(b"~77aa01bc<3fa9c2d1;0|17|5"))
True
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

DONE = b"data: [DONE]\n\n"


def tag_of(owner: str) -> bytes:
    """The tag of the producer whose claim token is ``owner``."""
    return hashlib.blake2b(owner.encode(), digest_size=4).hexdigest().encode()


def mark(state: bytes, tag: bytes, prev: bytes | None = None, digest: bytes = b"") -> bytes:
    """``state`` (an entry's token state) with the mark of the producer ``tag`` in front;
    ``prev``: the producer of the event before, when it was another (a take-over);
    ``digest``: the text the client has once it has this event (:func:`digest`), if kept."""
    head = b"~" + tag + (b"." + digest if digest else b"") + (b"<" + prev if prev else b"")
    return head + b";" + state if state else head


def marks(state: bytes) -> tuple[bytes | None, bytes | None]:
    """(tag, prev) of an entry's state; (None, None) when it has no mark."""
    tail, prev = _mark(state)
    return (None, None) if tail is None else (tail.partition(b".")[0], prev)


def id_tail(state: bytes) -> bytes | None:
    """What follows the event number in the id of an entry marked so: its tag, and its
    digest if it has one."""
    return _mark(state)[0]


def _mark(state: bytes) -> tuple[bytes | None, bytes | None]:
    if not state.startswith(b"~"):
        return None, None
    tail, _, prev = state.split(b";", 1)[0][1:].partition(b"<")
    return tail, prev or None


def ids_hasher() -> Any:
    """The running hash of one choice's token ids: updated with ``b"%d," % id`` per token."""
    return hashlib.blake2b(digest_size=4)


#: The most choices whose account an id carries (``n`` times the prompts of one request).
MAX_DIGEST_CHOICES = 128


class Account:
    """What a client has of a stream that can be generated again, per choice: its completion
    tokens, the characters of their text, and a running hash of their ids (:func:`ids_hasher`).
    :meth:`digest` is what the event ids carry: ``K.C.H`` for one choice; for several,
    ``K0:K1:...`` and ``C0:C1:...``, and ``H`` hashes the choices' hashes in order."""

    __slots__ = ("_hashes", "tokens", "chars")

    def __init__(self, choices: int) -> None:
        self._hashes = [ids_hasher() for _ in range(choices)]
        self.tokens = [0] * choices
        self.chars = [0] * choices

    def add(self, index: int, ids: Sequence[int], chars: int = 0) -> None:
        hasher = self._hashes[index]
        for token in ids:
            hasher.update(b"%d," % token)
        self.tokens[index] += len(ids)
        self.chars[index] += chars

    def ids_hash(self) -> bytes:
        if len(self._hashes) == 1:
            return self._hashes[0].hexdigest().encode()
        whole = ids_hasher()
        for hasher in self._hashes:
            whole.update(hasher.digest())
        return whole.hexdigest().encode()

    def digest(self) -> bytes:
        if len(self.tokens) == 1:  # every event of a resumable stream of one choice: kept short
            return b"%d.%d.%b" % (self.tokens[0], self.chars[0], self.ids_hash())
        return b"%b.%b.%b" % (_numbers(self.tokens), _numbers(self.chars), self.ids_hash())


def _numbers(values: Sequence[int]) -> bytes:
    return b":".join(b"%d" % value for value in values)


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


def frame(number: int, event: bytes, tail: bytes | None = None) -> bytes:
    """Event ``number`` as a client gets it: with its ``id:`` (``tail``: :func:`id_tail`),
    except the final ``[DONE]``."""
    if event == DONE:
        return DONE
    return b"id: %d.%b\n%b" % (number, tail, event) if tail else b"id: %d\n%b" % (number, event)


def parse(header: str | None) -> tuple[int, bytes | None]:
    """A ``Last-Event-ID``: (the event number, its tag or None); (0, None) when absent or
    not one of ours."""
    if header is None:
        return 0, None
    number, _, rest = header.strip().partition(".")
    try:
        after = max(0, int(number))
    except ValueError:
        return 0, None
    tag = rest.partition(".")[0]
    return after, tag.encode() if after and _hex(tag) else None


def held(header: str | None) -> tuple[tuple[int, ...], tuple[int, ...], bytes] | None:
    """The account a ``Last-Event-ID`` carries (:class:`Account`): (tokens per choice,
    characters per choice, the hash of the ids), or None."""
    parts = (header or "").strip().split(".")
    if len(parts) != 5 or not _hex(parts[4]):
        return None
    tokens, chars = parts[2].split(":"), parts[3].split(":")
    if len(tokens) != len(chars) or len(tokens) > MAX_DIGEST_CHOICES \
            or not all(p.isdigit() and len(p) <= 12 for p in tokens + chars):
        return None
    return tuple(map(int, tokens)), tuple(map(int, chars)), parts[4].encode()


def usage_id(key: str, digest: bytes) -> str | None:
    """The name of one generation of a resumable stream, for its bill: the stream's key
    (scoped by tenant) and the account of everything its client has at its end. A stream
    generated again for its client after Redis and its producer both lost it (the re-sent
    POST goes on after the tokens it holds) ends with the same account, so both gateways'
    bills carry one name, and a meter that counts each name once charges it once
    (gateway/record.py). None for a stream that keeps no account."""
    if not digest:
        return None
    return hashlib.blake2b(key.encode() + b"\x00" + digest, digest_size=8).hexdigest()


def _hex(text: str) -> bool:
    return 0 < len(text) <= 16 and all(c in "0123456789abcdef" for c in text)
