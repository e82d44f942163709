"""Rendering the worker's per-token log-probabilities in OpenAI's two shapes.

A worker line carries ``"lp": [[token, logprob, [[alt, alt_logprob], ...]], ...]``
(one entry per token id, only when the request asked for logprobs).
"""

from __future__ import annotations

from typing import Any, Literal

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
