"""The simulator's non-generating tasks: embeddings, tokenizing, detokenizing.

Exact references for tests: an embedding is a function of the text alone, the sum of one
pseudo-random unit vector per word (a bag of words), normalised, so texts sharing words
are similar and a text is most similar to itself. Tokens are the simulator's: one per
word, a word of ``VOCAB`` its index there, any other word a hash of it into ``VOCAB``, as
the simulator counts prompt tokens when it generates.

>>> len(sim_embedding("the cat sat"))
64
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator

from engine_worker.engines.sim import VOCAB, SimSequence
from engine_worker.engines.prompts import checked_ids
from engine_worker.pooling import Pooled, PoolRequest, Tokenized
from sluice.errors import InvalidRequest
from sluice.prefix import chat_text

#: The simulator's embedding size (no Matryoshka: ``dimensions`` is refused).
SIM_EMBED_DIM = 64
#: The context the simulator claims (tokenize's ``max_model_len``).
SIM_MAX_MODEL_LEN = 32768
_INDEX = {word: i for i, word in enumerate(VOCAB)}


@functools.lru_cache(maxsize=4096)
def _word_vector(word: str, dim: int) -> tuple[float, ...]:
    raw = hashlib.blake2b(word.encode(), digest_size=min(dim, 64)).digest()
    for part in range(1, -(-dim // 64)):  # wider: more digests of the word, each salted by its place
        raw += hashlib.blake2b(word.encode(), digest_size=64, salt=part.to_bytes(16, "little")).digest()
    return tuple(b / 127.5 - 1.0 for b in raw[:dim])


def sim_embedding(text: str, dim: int = SIM_EMBED_DIM) -> list[float]:
    """The simulator's embedding of ``text`` (unit length, ``dim`` wide)."""
    words = text.split() or [""]
    total = _word_vector(words[0], dim)
    for word in words[1:]:
        total = tuple(map(operator.add, total, _word_vector(word, dim)))
    norm = math.hypot(*total) or 1.0
    return [x / norm for x in total]


def sim_token_ids(text: str) -> list[int]:
    """The simulator's tokens of ``text``: one per word."""
    out = []
    for word in text.split():
        index = _INDEX.get(word)
        if index is None:
            index = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little") % len(VOCAB)
        out.append(index)
    return out


def sim_detokenize(ids: list[int], param: str = "tokens") -> str:
    return "".join(SimSequence.text(i) for i in checked_ids(ids, len(VOCAB), param)).lstrip(" ")


class SimPooling:
    """The :class:`~engine_worker.pooling.PoolingEngine` half of the simulator; its embeddings
    ``dim`` wide."""

    def __init__(self, dim: int = SIM_EMBED_DIM) -> None:
        self.dim = dim

    async def embed(self, request: PoolRequest, inputs: list[str | list[int]]) -> Pooled:
        if request.dimensions is not None:
            raise InvalidRequest(f"model {request.model!r} does not support Matryoshka embeddings: "
                                 "'dimensions' must be unset", param="dimensions")
        vectors, used = [], 0
        for item in inputs:
            if isinstance(item, str):
                vectors.append(sim_embedding(item, self.dim))
                used += max(1, len(item.split()))
            else:
                vectors.append(sim_embedding(sim_detokenize(item, "input"), self.dim))
                used += len(item)
        return Pooled(vectors, used)

    async def tokenize(self, request: PoolRequest) -> Tokenized:
        text = request.prompt if request.messages is None else chat_text(request.messages)
        ids = sim_token_ids(text or "")
        strs = [VOCAB[i] for i in ids] if request.return_token_strs else None
        return Tokenized(ids, strs, SIM_MAX_MODEL_LEN)

    async def detokenize(self, request: PoolRequest) -> str:
        return sim_detokenize(request.tokens or [])
