"""Lines cut out of pieces as they arrive (sluice/lines.py): the worker's NDJSON and an
engine server's SSE, whatever the pieces' sizes."""

from __future__ import annotations

import random

import orjson

from sluice.lines import LineCutter


def _cut(pieces: list[bytes]) -> tuple[list[bytes], int]:
    cut = LineCutter()
    lines = [line for piece in pieces for line in cut.feed(piece)]
    return lines, cut.pending()


def test_lines_come_out_whole_however_the_bytes_were_cut() -> None:
    lines = [orjson.dumps({"i": i, "text": "x" * random.Random(i).randrange(0, 300)}) for i in range(200)]
    data = b"".join(line + b"\n" for line in lines)
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randrange(1, 400)))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        assert _cut(pieces) == (lines, 0)
    assert _cut([data[i:i + 1] for i in range(len(data))]) == (lines, 0)  # a byte at a time
    assert _cut([data]) == (lines, 0)  # all at once


def test_a_long_line_in_many_pieces_is_one_line_and_empty_pieces_and_lines_pass() -> None:
    line = b'{"embeddings": [' + b"0.125, " * 200_000 + b"1.0]}"
    pieces = [line[i:i + 4096] for i in range(0, len(line), 4096)]
    assert _cut([b"", *pieces, b"", b"\n\n", b"tail"]) == ([line, b""], 4)
