"""The text of a migrated generation, exact at any break.

A worker that resumes a generation (``resume_token_ids``: what an earlier worker
already relayed) cannot use its engine's own text: the engine's detokenizer and
stop-string check start fresh after the resumed ids, and so

- a break inside a multi-byte UTF-8 character gives U+FFFD and a re-emitted
  character (the earlier worker sent the ids of the first bytes but not their text);
- a stop string that began before the break is never seen (the earlier worker held
  its first characters back, as every engine holds back a possible stop string);
- character offsets disagree where special tokens are decoded differently.

:class:`ResumedText` decodes the completion from its first token (resumed ids and new
ids alike) the way an engine's incremental detokenizer does, skips the characters the
client already has (``resume_text_chars``), holds back a possible stop string and a
partial character, and finds stop strings across the break. The engine runs without
stop strings then; when one matches here, the caller ends the generation.

>>> text = ResumedText.start(tokenizer, request)   # None when not resuming
>>> ids, piece, stopped = text.step(new_ids, engine_finished)
"""

from __future__ import annotations

import os
from typing import Any

from engine_worker.protocol import GenerateRequest

#: Tokens decoded again before the new one, so a tokenizer that drops a leading space
#: at the start of a slice (SentencePiece) still gives the right text at the join.
_CONTEXT_TOKENS = 6
_PARTIAL = "\ufffd"
#: Sampled tokens an engine reads before a token to label a completed character.
_LABEL_CONTEXT = 4


class ResumedText:
    def __init__(self, tokenizer: Any, ids: list[int], sent_chars: int, stop: list[str], min_tokens: int) -> None:
        self._tokenizer = tokenizer
        self._ids = list(ids)
        # Read offset: the longest prefix of ids that decodes to whole characters.
        read = len(self._ids)
        decoded = self._decode(self._ids)
        while read > 0 and decoded.endswith(_PARTIAL) and len(self._ids) - read < 4:
            read -= 1
            decoded = self._decode(self._ids[:read])
        self._read = read
        self._prefix = max(0, read - _CONTEXT_TOKENS)
        self._stop = [s for s in stop if s]
        #: The stop string that ended the generation, once one did.
        self.stopped_by: str | None = None
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._min_tokens = min_tokens
        self._new_tokens = 0
        #: Text the client does not have yet: held back by the earlier worker, or here.
        self._unsent = decoded[sent_chars:]

    @classmethod
    def start(cls, tokenizer: Any, request: GenerateRequest) -> ResumedText | None:
        if not request.resume_token_ids:
            return None
        return cls(tokenizer, list(request.resume_token_ids), request.resume_text_chars or 0,
                   list(request.stop), request.min_tokens)

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def feed(self, token_id: int) -> tuple[str, bool]:
        """Text the client may have now that ``token_id`` was generated; True once a stop
        string matched (the text then ends before it, and the generation is over)."""
        self._ids.append(token_id)
        self._new_tokens += 1
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(_PARTIAL):
            checked_from = max(0, len(self._unsent) - self._hold)
            self._unsent += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
            if self._stop and self._new_tokens > self._min_tokens:
                hit = self._find_stop(checked_from)
                if hit is not None:
                    text, self._unsent = self._unsent[:hit], ""
                    return text, True
        ready = len(self._unsent) - self._hold if self._stop else len(self._unsent)
        if ready <= 0:
            return "", False
        text, self._unsent = self._unsent[:ready], self._unsent[ready:]
        return text, False

    def _find_stop(self, start: int) -> int | None:
        """Where the first stop string begins in the unsent text, looking from ``start``."""
        found = [(i, s) for s in self._stop if (i := self._unsent.find(s, start)) >= 0]
        if not found:
            return None
        at, self.stopped_by = min(found, key=lambda hit: hit[0])
        return at

    def step(self, ids: list[int], finished: bool) -> tuple[list[int], str, bool]:
        """One engine step: the ids kept (none after the token that completed a stop
        string), their text, and whether a stop string ended the generation."""
        pieces = []
        for kept, token_id in enumerate(ids, start=1):
            piece, stopped = self.feed(token_id)
            pieces.append(piece)
            if stopped:
                return ids[:kept], "".join(pieces), True
        if finished:
            pieces.append(self.flush())
        return ids, "".join(pieces), False

    def token_label(self, position: int, token_id: int, label: str) -> str:
        """The logprob label of ``token_id`` as candidate for new token ``position``
        (0-based), as the uninterrupted generation gives it.

        An engine labels a token that completes a multi-byte character with the
        characters it completes, read from up to 4 sampled tokens before it; after a break
        those are resumed ids the new engine counts as prompt, so it labels the first new
        tokens "". Past the 4th new token its own context suffices."""
        if position >= _LABEL_CONTEXT or not label.endswith(_PARTIAL) and label:
            return label
        at = len(self._ids) - self._new_tokens + position
        context = self._ids[max(0, at - _LABEL_CONTEXT):at]
        if not str(self._tokenizer.decode([token_id])).endswith(_PARTIAL):
            return label
        for n in range(1, len(context) + 1):
            tail = context[-n:]
            full = str(self._tokenizer.decode(tail + [token_id]))
            if full.endswith(_PARTIAL):
                continue
            clean = n
            while clean and str(self._tokenizer.decode([tail[clean - 1]])).endswith(_PARTIAL):
                clean -= 1
            before = str(self._tokenizer.decode(tail[:clean])) if clean else ""
            return full[len(os.path.commonprefix([before, full])):]
        return ""

    def flush(self) -> str:
        """The engine finished (end of sequence or length): the rest of the text."""
        text, self._unsent = self._unsent, ""
        return text
