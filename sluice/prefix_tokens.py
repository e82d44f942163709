"""Prompt prefixes as chained hashes of *token ids*: the precise index's vocabulary.

The approximate index (:mod:`sluice.prefix`) names blocks of words; an engine caches
blocks of tokens, so for vLLM and TensorRT-LLM it can only be corrected after the fact
(``cached_tokens``). The precise index names blocks of :data:`TOKEN_BLOCK` token ids,
hashed the same way on both sides:

- the gateway tokenizes the prompt as the worker will (the model's tokenizer and chat
  template, gateway/admission/prompt_tokens.py) and hashes its full blocks;
- the worker turns its engine's KV-cache events (vLLM: ``BlockStored`` carries each
  block's token ids and its parent's hash) into the same chained hashes
  (engine_worker/engines/vllm_kv_events.py), so the index learns exactly which blocks an
  engine stored and evicted.

A block is :data:`TOKEN_BLOCK` tokens (a multiple of vLLM's 16 on a GPU and of the
worker's 32 on CPU): coarser than the engine's own blocks so that the admission script's
work stays small (it walks the prompt's blocks; see :mod:`sluice.prefix`).

>>> len(token_block_hashes(list(range(150))))  # two full blocks of 64
2
>>> token_block_hashes(list(range(128)))[1] == chain(chain(ROOT, range(64)), range(64, 128)).hex()
True
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable

#: Token ids per block of the precise index.
TOKEN_BLOCK = 64
#: Blocks hashed per prompt at most (16,384 tokens).
MAX_TOKEN_BLOCKS = 256
#: The parent of a prompt's first block.
ROOT = b""


def chain(parent: bytes, tokens: Iterable[int]) -> bytes:
    """The hash of one block of token ids whose predecessors hash to ``parent``."""
    return hashlib.blake2b(parent + b"\x01" + array("I", tokens).tobytes(), digest_size=8).digest()


def token_block_hashes(ids: list[int], limit: int = MAX_TOKEN_BLOCKS) -> list[str]:
    """Chained hashes (16 hex digits) of the full blocks of ``ids``."""
    out: list[str] = []
    parent = ROOT
    for start in range(0, min(len(ids) // TOKEN_BLOCK, limit) * TOKEN_BLOCK, TOKEN_BLOCK):
        parent = chain(parent, ids[start:start + TOKEN_BLOCK])
        out.append(parent.hex())
    return out


def expected_cached_tokens(matched_blocks: int, prompt_tokens: int) -> int:
    """Tokens an engine holding ``matched_blocks`` of the prompt reports cached: the blocks,
    less the prompt's last token, which an engine always computes (vLLM caps its prefix hit
    at ``prompt_tokens - 1``) -- rounded to what the engine caches is the worker's business,
    and shows as the index's error."""
    return max(0, min(matched_blocks * TOKEN_BLOCK, prompt_tokens - 1))
