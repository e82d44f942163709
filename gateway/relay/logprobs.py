"""Rendering the worker's per-token log-probabilities in OpenAI's two shapes.

A worker line carries ``"lp": [[token, logprob, [[alt, alt_logprob], ...]], ...]``
(one entry per token id, only when the request asked for logprobs).
"""

from __future__ import annotations

from typing import Any, Literal

import orjson

Entry = list[Any]


def _token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def render(kind: Literal["chat", "text"], entries: list[Entry], text_offset: int = 0) -> dict[str, Any]:
    """Chat: ``{"content": [...]}``; completions: tokens / token_logprobs / top_logprobs / text_offset."""
    if kind == "chat":
        return {
            "content": [
                {**_token(tok, lp), "top_logprobs": [_token(a, alp) for a, alp in top]}
                for tok, lp, top in entries
            ]
        }
    offsets = []
    for tok, _, _ in entries:
        offsets.append(text_offset)
        text_offset += len(tok)
    return {
        "tokens": [tok for tok, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{a: alp for a, alp in top} for _, _, top in entries],
        "text_offset": offsets,
    }


class RenderedLogprobs:
    """A choice's logprobs in a whole answer, rendered to JSON bytes line by line as its lines
    arrive (the same bytes as :func:`render` of all its entries at the end): held as Python
    lists until the end, a top-20 token entry took ~550 bytes, against ~64 of JSON
    (gateway/relay/whole_answers.py)."""

    __slots__ = ("_fields", "_kind", "_offset")

    def __init__(self, kind: Literal["chat", "text"]) -> None:
        self._kind = kind
        #: Per field of the rendering (chat: content; text: its four), each line's items, comma-joined.
        self._fields: dict[str, list[bytes]] = {}
        self._offset = 0

    def add(self, entries: list[Entry]) -> int:
        """One line's entries; the bytes they added."""
        rendered = render(self._kind, entries, self._offset)
        if self._kind == "text":
            self._offset += sum(len(tok) for tok, _, _ in entries)
        added = 0
        for name, items in rendered.items():
            part = orjson.dumps(items)[1:-1]  # the items without the list's brackets
            if part:
                self._fields.setdefault(name, []).append(part)
                added += len(part)
        return added

    def value(self) -> dict[str, orjson.Fragment]:
        """The rendering, each field's parts joined once (and let go)."""
        names = ("content",) if self._kind == "chat" else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {name: orjson.Fragment(b"[" + b",".join(self._fields.pop(name, ())) + b"]") for name in names}
