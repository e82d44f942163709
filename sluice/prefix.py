"""Prompt prefixes as chained block hashes: the vocabulary of cache-aware routing.

A prompt's canonical text (chat messages rendered as ``<|role|> content`` lines, or the
completion prompt) is cut into blocks of :data:`BLOCK_TOKENS` whitespace-separated
words (64: four of vLLM's 16-token KV blocks; coarser blocks keep the routing script's
work small -- at 16, a 2,300-token prompt cost the admission script ~1 ms in Redis); block ``i``'s hash covers block ``i`` and, through its parent's hash, every
block before it, so two prompts share block ``i``'s hash exactly when they share their
first ``i + 1`` blocks. Only full blocks are hashed (an engine caches full blocks only).

The gateway computes these hashes without a tokenizer: words stand in for tokens, so
the index is *approximate* for a real engine (a block of 64 words is about 80 tokens)
and the router's expectation is scaled to the engine's token count when it is compared
with the engine's ``cached_tokens`` (see :func:`expected_cached_tokens`). The simulator
tokenizes by words and keys its cache by these very hashes, so its KV events name
blocks the gateway's index knows: for the simulator, the index is *precise*.

>>> hashes = block_hashes(("w " * 160).strip())
>>> len(hashes)  # 160 words: two full blocks of 64
2
"""

from __future__ import annotations

import hashlib
from typing import Any

#: Words (the simulator's tokens) per block.
BLOCK_TOKENS = 64
#: Blocks hashed per prompt at most (prefixes longer than this match as this long).
MAX_BLOCKS = 256


def text_content(content: object) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def chat_text(messages: list[dict[str, Any]]) -> str:
    """Chat messages as one canonical text (the simulator's chat template)."""
    parts = [f"<|{m.get('role', 'user')}|> {text_content(m.get('content'))}" for m in messages]
    return "\n".join(parts) + "\n<|assistant|>"


def payload_text(payload: dict[str, Any]) -> str:
    """The canonical prompt text of a worker payload (``messages`` or ``prompt``)."""
    messages = payload.get("messages")
    if messages is not None:
        return chat_text(messages)
    return str(payload.get("prompt") or "")


def block_hashes_of_words(words: list[str], limit: int = MAX_BLOCKS) -> list[str]:
    """Chained hashes (16 hex digits) of the full blocks of ``words``."""
    out: list[str] = []
    parent = b""
    for start in range(0, min(len(words) // BLOCK_TOKENS, limit) * BLOCK_TOKENS, BLOCK_TOKENS):
        block = " ".join(words[start:start + BLOCK_TOKENS]).encode()
        parent = hashlib.blake2b(parent + b"\x00" + block, digest_size=8).digest()
        out.append(parent.hex())
    return out


def block_hashes(text: str, limit: int = MAX_BLOCKS) -> list[str]:
    return block_hashes_of_words(text.split(), limit)


def expected_cached_tokens(matched_blocks: int, prompt_words: int, prompt_tokens: int) -> int:
    """Tokens the router expected the engine to find cached: its matched blocks of words,
    scaled from words to the engine's tokens (exact for the simulator, whose tokens are words)."""
    if prompt_words <= 0 or matched_blocks <= 0:
        return 0
    return min(prompt_tokens, round(matched_blocks * BLOCK_TOKENS * prompt_tokens / prompt_words))
