"""Bytes as they arrive, cut into whole lines.

A line that arrives in many pieces is joined once, when its end comes: the readers this
replaced appended every piece to what they held (``buffer += piece``, a copy of all of it)
and split the whole again, so a line of N bytes in pieces of P cost about N²/2P bytes
copied. Lines come whole in one piece from Sluice's workers and from servers behind the
lean HTTP/1.1 client (a chunk each); they come in socket-sized pieces through httpx (a
worker or server behind TLS): a 10 MB line in 64 KiB pieces was ~800 MB of copying on the
event loop (97-122 ms; 16 ms now), a 50 MB one 10.6-14.7 s (77 ms now).

>>> cut = LineCutter()
>>> cut.feed(b'{"a": 1}\\n{"b"'), cut.feed(b': 2}\\n')
([b'{"a": 1}'], [b'{"b": 2}'])

A worker's lines may carry bytes for the line after them instead of JSON (:data:`RAW_MARK`):
an embeddings answer's vectors, made by the worker, which the gateway puts in its client's body
without parsing them (engine_worker/pooling.py, gateway/surfaces/pooling.py).
"""

from __future__ import annotations

#: A line that begins with this byte (``=``, never JSON's first) holds bytes for the next JSON
#: line, which says what they are; readers give that line the bytes of the raw lines before it,
#: in order, as its :data:`RAW_KEY`.
RAW_MARK = 0x3D
RAW_KEY = "raw"


class LineCutter:
    """Whole ``\\n``-ended lines out of the pieces fed (the ``\\n`` dropped); the part of a
    line still arriving is kept until its end comes."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def feed(self, piece: bytes) -> list[bytes]:
        parts = self._parts
        first = None
        if parts:  # a line is still arriving: its end, if this piece has it, joined to its parts once
            end = piece.find(b"\n")
            if end < 0:
                parts.append(piece)
                return []
            parts.append(piece[:end])
            first = b"".join(parts)
            parts.clear()
            piece = piece[end + 1:]
        lines = piece.split(b"\n")  # (a piece that ends its lines, as most do, leaves ``b""`` last)
        rest = lines.pop()
        if rest:
            parts.append(rest)
        if first is not None:
            lines.insert(0, first)
        return lines

    def pending(self) -> int:
        """Bytes of the line still arriving."""
        return sum(map(len, self._parts))
