"""Random ids as ``uuid.uuid4().hex`` writes them, without building a ``UUID``.

Three per request (its request id, its internal id, its completion id): ``uuid4()`` builds
an object from an integer to print it, about 5 µs each here; this is the same 122 random
bits and the same version and variant digits for a fifth of that. The bits come from the
system's random source a page at a time (one ``getrandom`` call per 256 ids, not one per
id: three system calls a request fewer); a forked child starts a page of its own, so no two
processes hand out the same ids.

>>> len(random_hex()), random_hex()[12]
(32, '4')
"""

from __future__ import annotations

import os

_PAGE = 4096
_page = b""
_at = _PAGE


def _forget_page() -> None:
    global _page, _at
    _page, _at = b"", _PAGE


os.register_at_fork(after_in_child=_forget_page)


def random_hex() -> str:
    """32 hex digits, a version-4 UUID's (``uuid.uuid4().hex``)."""
    global _page, _at
    if _at >= len(_page):
        _page, _at = os.urandom(_PAGE), 0
    raw = bytearray(_page[_at:_at + 16])
    _at += 16
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    return raw.hex()
