"""A chat template's text tokenized piece by piece, the long pieces remembered.

Why: with the precise prefix index the gateway tokenizes every prompt
(gateway/admission/prompt_tokens.py), and the tokenizer's cost grows with the prompt:
2.8 ms of one core for a 1,500-word prompt on the 2-core CI machine, where the chat
template itself took 0.02 ms; on the H200 fleet the precise gateway spent 11-13 ms of CPU
per request against round robin's 5-6 (README, "The gateway's token ids to the worker").
Most of a prompt is pieces that earlier prompts had too: a system prompt, the earlier
turns of a conversation. A fast tokenizer first splits its input at its added tokens
(``<|im_start|>``, ``<|im_end|>``...) and then tokenizes each piece alone, so where the
pieces cannot act on each other the ids of the whole are the pieces' ids in order, and a
piece seen before costs a dictionary lookup (0.05 ms for that prompt, its system prompt
remembered).

Checked, not assumed, since a worker runs the ids the gateway sends:

- :meth:`PieceEncoder.of` builds one only for a tokenizer whose pieces cannot interact:
  no normalizer, a byte-level pre-tokenizer (alone or after splits), and added tokens
  that strip nothing around them; then a probe of texts built to catch a difference must
  come out the same both ways;
- every :data:`VERIFY_EVERY` th text is also tokenized whole; one difference turns the
  pieces off for the process, logged.

Remembered pieces are bounded by bytes (:data:`CACHE_BYTES`, least recently used out), so
a client sending new long prompts only churns the cache.
"""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections import OrderedDict
from typing import Any

log = logging.getLogger("sluice.gateway.prefix")

#: Bytes of remembered pieces per gateway process (text and ids, roughly).
CACHE_BYTES = 32 << 20
#: Pieces shorter than this are tokenized each time (cheap; they would only churn the cache).
MIN_PIECE_CHARS = 256
#: One text in this many is tokenized whole too, and compared.
VERIFY_EVERY = 64
#: Pre-tokenizers after which a piece's ids do not depend on the pieces beside it.
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation"}
_PIECE_OVERHEAD = 120


def _independent(definition: dict[str, Any]) -> bool:
    """Whether a fast tokenizer's definition (its JSON) tokenizes pieces apart as it would together."""
    if definition.get("normalizer") is not None:
        return False
    pre = definition.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not any(step.get("type") == "ByteLevel" for step in steps) \
            or any(step.get("type") not in _SAFE_PRE_TOKENIZERS for step in steps):
        return False
    return all(not (t.get("lstrip") or t.get("rstrip") or t.get("single_word") or t.get("normalized"))
               for t in definition.get("added_tokens", []))


class PieceEncoder:
    """Tokenizes a chat template's text between its added tokens, remembering long pieces.

    >>> pieces = PieceEncoder.of(tokenizer)  # None when the tokenizer does not allow it
    >>> pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    True
    """

    def __init__(self, backend: Any, added: dict[str, int]) -> None:
        self._backend = backend
        self._added = added
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self._pieces: OrderedDict[str, array[int]] = OrderedDict()
        self._bytes = 0
        self._texts = 0
        self.hits = 0
        self.on = True

    def __repr__(self) -> str:
        return f"PieceEncoder(pieces={len(self._pieces)} bytes={self._bytes} hits={self.hits} on={self.on})"

    @classmethod
    def of(cls, tokenizer: Any) -> PieceEncoder | None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        definition = json.loads(backend.to_str())
        added = {t["content"]: int(t["id"]) for t in definition.get("added_tokens", [])}
        if not added or not _independent(definition):
            log.info("the precise index tokenizes prompts whole (this tokenizer's pieces may act on each other)")
            return None
        pieces = cls(backend, added)
        marks = sorted(added)[:4]
        probes = [f"{a} x{b}\n\n y {a}\n{b}z  " for a in marks for b in marks]
        probes.append("".join(marks) + " é 12345 \t\n" + "".join(reversed(marks)))
        if any(pieces._pieces_of(p) != pieces._whole(p) for p in probes):
            log.warning("the precise index tokenizes prompts whole: tokenizing by pieces differed in a probe")
            return None
        return pieces

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, as the tokenizer gives them without special tokens added."""
        if not self.on:
            return self._whole(text)
        ids = self._pieces_of(text)
        self._texts += 1
        if self._texts % VERIFY_EVERY == 0 and ids != (whole := self._whole(text)):
            self.on = False
            self._pieces.clear()
            self._bytes = 0
            log.error("tokenizing by pieces differed from the whole (%d against %d ids): tokenizing whole from now "
                      "on", len(ids), len(whole))
            return whole
        return ids

    def encode_apart(self, text: str) -> tuple[list[int], list[tuple[str, list[int]]]]:
        """:meth:`encode`'s ids for a thread of its own, while the event loop goes on, and the
        long pieces it tokenized, for the loop to :meth:`remember`: the remembered pieces are
        only read here (the loop's thread changes them), nothing verified, and each piece not
        remembered is tokenized with the GIL released (the tokenizer's ``encode`` holds it: a
        1M-character prompt held a gateway's loop 0.6 s even from a thread; ``encode_batch``
        of one text, the same ids, let it run)."""
        out: list[int] = []
        learned: list[tuple[str, list[int]]] = []
        for piece in self._split.split(text) if self.on else (text,):
            if not piece:
                continue
            added = self._added.get(piece) if self.on else None
            if added is not None:
                out.append(added)
                continue
            ids = self._pieces.get(piece) if self.on else None
            if ids is None:
                ids = self._backend.encode_batch([piece], add_special_tokens=False)[0].ids
                if self.on and len(piece) >= MIN_PIECE_CHARS:
                    learned.append((piece, ids))
            out.extend(ids)
        return out, learned

    def remember(self, learned: list[tuple[str, list[int]]]) -> None:
        """Keep the pieces :meth:`encode_apart` tokenized (on the loop's thread)."""
        for piece, ids in learned:
            if piece not in self._pieces:
                self._keep(piece, array("I", ids))

    def _whole(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def _pieces_of(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            added = self._added.get(piece)
            if added is not None:
                out.append(added)
            elif len(piece) < MIN_PIECE_CHARS:
                out.extend(self._whole(piece))
            else:
                out.extend(self._remembered(piece))
        return out

    def _remembered(self, piece: str) -> array[int]:
        ids = self._pieces.get(piece)
        if ids is not None:
            self._pieces.move_to_end(piece)
            self.hits += 1
            return ids
        ids = array("I", self._whole(piece))
        self._keep(piece, ids)
        return ids

    def _keep(self, piece: str, ids: array[int]) -> None:
        size = len(piece) + 4 * len(ids) + _PIECE_OVERHEAD
        if size <= CACHE_BYTES:
            self._pieces[piece] = ids
            self._bytes += size
            while self._bytes > CACHE_BYTES:
                old, old_ids = self._pieces.popitem(last=False)
                self._bytes -= len(old) + 4 * len(old_ids) + _PIECE_OVERHEAD
