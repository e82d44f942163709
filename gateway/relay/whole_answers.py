"""The bytes of non-streaming answers a gateway process builds at once, bounded.

A non-streaming completion is held in the gateway until its last token, then sent as one
JSON body. What a client may ask for makes that body large: ``n`` choices (16 by default),
up to the model's context in tokens each, and with ``top_logprobs: 20`` twenty-one token
entries per token (~64 bytes of JSON each). Measured before this bound (`sluice up --engine
sim`, one request of ``n=16``, 8,000 tokens, ``ignore_eos``, top-20 logprobs): a 172 MB body,
the gateway process at 1.59 GB at its peak, 958 MB after; at the context's 32,768 tokens one
such request alone would take several GB, and a few at once the machine. Two changes:

- Each line's logprobs are rendered to their JSON bytes as the line arrives
  (:class:`gateway.relay.logprobs.RenderedLogprobs`), not kept as Python lists until the end: a token
  entry costs its JSON's ~64 bytes, not ~550 bytes of objects.
- This module counts what each answer being built holds (its text and its rendered logprobs,
  in bytes) against one bound per process (``SLUICE_GATEWAY_MAX_ANSWER_BYTES``, 128 MiB by
  default). An answer that alone passes it ends at once with ``400 answer_too_large`` (it could
  never fit: stream it instead); when all of them together pass it, the largest ends with
  ``503 answers_full`` and ``Retry-After`` (the others go on). Either way its generation stops,
  which frees its engine slots, and nothing of it is billed (as for any failed answer).

An embeddings answer counts too (gateway/relay/pooling.py): inputs x width floats, weighed
by the length its worker's response announces before a byte of it is held (4 x 2,048 inputs
of a 4,096-wide model at once took a gateway to 1.83 GB; now each is a 400 that asks for
fewer inputs, the process at 83 MB). An answer that holds nothing yet is never ended for
the others (it would free nothing).

Streams hold nothing of this kind: each chunk leaves as it is made (what a slow reader leaves
unread is sluice/connection_bounds.py's bound).

>>> answers = WholeAnswers(128 * 2**20)
>>> answer = answers.open()        # in the request's task
>>> answer.add(len(part))          # raises when this answer must end
>>> answer.close()                 # always, when it is sent or failed
"""

from __future__ import annotations

import asyncio
import logging
import time

from sluice.errors import InvalidRequest, Unavailable

log = logging.getLogger("sluice.gateway")

#: Bytes of non-streaming answers one gateway process builds at once, by default.
MAX_ANSWER_BYTES = 128 * 2**20
#: At most one log line per this many seconds per kind of end.
_LOG_EVERY_S = 10.0


class AnswerTooLarge(InvalidRequest):
    code = "answer_too_large"


class WholeAnswers:
    """The answers one process builds, and what each holds."""

    def __init__(self, limit_bytes: int = MAX_ANSWER_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self.total = 0
        self._building: set[Answer] = set()
        self._logged: dict[str, float] = {}

    def open(self, streamable: bool = True) -> Answer:
        """An answer built by the current task (the one its end interrupts); ``streamable``: its
        client could ask for it as a stream (a completion), else (an embeddings answer) for
        fewer inputs."""
        answer = Answer(self, asyncio.current_task(), streamable)
        self._building.add(answer)
        return answer

    def _grew(self, answer: Answer) -> None:
        if answer.size > self.limit_bytes:
            smaller = ("ask for it as a stream (\"stream\": true), or for fewer tokens, choices or logprobs"
                       if answer.streamable else "ask for fewer inputs a request")
            self._end(answer, AnswerTooLarge(
                f"this answer ({_mib(answer.size)} so far) passed the gateway's bound of {_mib(self.limit_bytes)} "
                f"for answers being built; {smaller}", param="stream" if answer.streamable else "input"))
        while self.total > self.limit_bytes:
            gathering = [a for a in self._building if a.task is not None and a.size]
            if not gathering:  # (only answers being rendered and sent, over in a moment, or empty ones)
                return
            self._end(max(gathering, key=lambda a: a.size), Unavailable(
                f"this gateway is building {_mib(self.total)} of non-streaming answers, past its bound of "
                f"{_mib(self.limit_bytes)}, and this one was the largest; send it again"
                + (", or ask for it as a stream" if answer.streamable else ""),
                code="answers_full", retry_after_s=1))

    def _end(self, answer: Answer, error: InvalidRequest | Unavailable) -> None:
        """Stop counting ``answer`` and make its task raise ``error``: at once if it is the
        task adding (its ``add`` raises), else by cancelling that task where it waits."""
        self._forget(answer)
        answer.ended = error
        if answer.task is not None and answer.task is not asyncio.current_task():
            answer.task.cancel()  # where it waits for its next line (it raises ``ended`` then)
        now = time.monotonic()
        if now - self._logged.get(error.code or "", -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[error.code or ""] = now
            log.warning("non-streaming answer of %s ended (%s): answers being built %s, bound %s "
                        "(SLUICE_GATEWAY_MAX_ANSWER_BYTES; said at most once in %gs)", _mib(answer.size), error.code,
                        _mib(self.total + answer.size), _mib(self.limit_bytes), _LOG_EVERY_S)

    def _forget(self, answer: Answer) -> None:
        if answer in self._building:
            self._building.discard(answer)
            self.total -= answer.size


class Answer:
    """One answer being built: what it holds so far."""

    __slots__ = ("_answers", "ended", "size", "streamable", "task")

    def __init__(self, answers: WholeAnswers, task: asyncio.Task[object] | None, streamable: bool) -> None:
        self._answers = answers
        self.task = task
        self.streamable = streamable
        self.size = 0
        #: Why it had to end (raised in its task), once it had to.
        self.ended: InvalidRequest | Unavailable | None = None

    def add(self, size: int) -> None:
        """``size`` bytes more; raises the answer's end if they made it one to end."""
        if self.ended is None:
            self.size += size
            self._answers.total += size
            if self._answers.total > self._answers.limit_bytes:
                self._answers._grew(self)
        if self.ended is not None:
            raise self.ended

    def holds(self, size: int) -> None:
        """It holds ``size`` bytes now, in place of what it held (a retried attempt's answer
        replaces the failed one's); raises as :meth:`add`."""
        self.add(size - self.size)

    def gathered(self) -> None:
        """Its lines are all in: it is rendered and sent now, no longer ended for others (its
        bytes count until :meth:`close`)."""
        self.task = None

    def close(self) -> None:
        self._answers._forget(self)


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"
