"""A deterministic simulator with a vLLM-style step loop, for tests and load tests.

The text of token ``i`` depends only on (prompt, seed, i), so a request resumed
with ``resume_token_ids`` on another worker continues exactly where the first
one stopped, and a run can be checked token for token against a reference.

Timing: a sequence admitted to the running batch waits ``ttft_ms`` (prefill),
then gets one token per step; a step takes ``token_ms``. At most ``max_seqs``
sequences run at once; the rest wait, as in a real continuous-batching engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine_worker.engines.base import EngineStats
from engine_worker.engines.prompts import chat_messages
from engine_worker.protocol import Delta, GenerateRequest, Usage

_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwxz" for v in "aeiou"]
VOCAB = [_SYLLABLES[i % len(_SYLLABLES)] + _SYLLABLES[(i // len(_SYLLABLES) * 7) % len(_SYLLABLES)] for i in range(1024)]
#: Natural lengths (the simulated end-of-sequence) lie in this range.
MIN_NATURAL, NATURAL_SPAN = 32, 224


def render_chat(messages: list[dict[str, object]]) -> str:
    """The simulator's chat template."""
    parts = [f"<|{m['role']}|> {m['content']}" for m in chat_messages(messages)]
    return "\n".join(parts) + "\n<|assistant|>"


def prompt_text(request: GenerateRequest) -> str:
    if request.messages is not None:
        return render_chat(request.messages)
    return request.prompt or ""


class SimSequence:
    """One request's deterministic token stream."""

    __slots__ = ("_base", "natural_length")

    def __init__(self, prompt: str, seed: int | None) -> None:
        digest = hashlib.blake2b(f"{seed or 0}\x00{prompt}".encode(), digest_size=16).digest()
        self._base = digest
        self.natural_length = MIN_NATURAL + int.from_bytes(digest[:4], "little") % NATURAL_SPAN

    def token(self, index: int) -> int:
        h = hashlib.blake2b(index.to_bytes(4, "little"), key=self._base, digest_size=4).digest()
        return int.from_bytes(h, "little") % len(VOCAB)

    @staticmethod
    def text(token_id: int) -> str:
        return " " + VOCAB[token_id]


def sim_logprobs(token_id: int, top: int) -> list[object]:
    """Made-up but consistent log-probabilities: the sampled token ranks first."""
    sampled = -0.05 - (token_id % 7) / 10
    alternatives = [[SimSequence.text(token_id), sampled]] + [
        [SimSequence.text((token_id + k) % len(VOCAB)), sampled - k] for k in range(1, top)
    ]
    return [SimSequence.text(token_id), sampled, alternatives[:top]]


@dataclass(eq=False)
class _Seq:
    request: GenerateRequest
    tokens: SimSequence
    prompt_tokens: int
    next_index: int
    limit: int
    end_reason: str
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    ready_at: float = 0.0
    text: str = ""
    generated: int = 0
    done: bool = False


class SimEngine:
    name = "sim"
    healthy = True

    def __init__(
        self, *, ttft_ms: float = 20.0, token_ms: float = 5.0, max_seqs: int = 64, fail_first: int = 0,
        crash_on: str | None = None,
    ) -> None:
        self.capacity = max_seqs
        #: Fault injection: this many requests fail before their first token.
        self._fail_left = fail_first
        #: Fault injection: a prompt containing this text kills the whole worker process
        #: (as an engine crash would): a "query of death".
        self._crash_on = crash_on
        self._ttft_s = ttft_ms / 1000
        self._token_s = token_ms / 1000
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.aborted = 0

    def __repr__(self) -> str:
        return f"SimEngine(running={len(self._running)} waiting={len(self._waiting)} aborted={self.aborted})"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="sim-step-loop")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_usage=len(self._running) / self.capacity,
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        if self._crash_on and self._crash_on in prompt_text(request):
            os._exit(70)
        if self._fail_left > 0:
            self._fail_left -= 1
            raise RuntimeError("simulated engine failure before the first token")
        prompt = prompt_text(request)
        tokens = SimSequence(prompt, request.seed)
        resumed = len(request.resume_token_ids)
        # The simulated end-of-sequence, unless ignored; never before min_tokens.
        end = tokens.natural_length
        if request.ignore_eos and request.max_tokens is not None:
            end = resumed + request.max_tokens
        end = max(end, resumed + request.min_tokens)
        limit, end_reason = end, "stop"
        if request.max_tokens is not None and resumed + request.max_tokens <= end:
            limit, end_reason = resumed + request.max_tokens, "length"
        seq = _Seq(
            request=request,
            tokens=tokens,
            prompt_tokens=len(prompt.split()) + resumed,
            next_index=resumed,
            limit=limit,
            end_reason=end_reason,
        )
        self._waiting.append(seq)
        self._wake.set()
        try:
            while True:
                delta = await seq.queue.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not seq.done:
                seq.done = True
                self.aborted += 1
                if seq in self._waiting:
                    self._waiting.remove(seq)
                if seq in self._running:
                    self._running.remove(seq)

    async def _loop(self) -> None:
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
            now = time.monotonic()
            while self._waiting and len(self._running) < self.capacity:
                seq = self._waiting.popleft()
                seq.ready_at = now + self._ttft_s
                self._running.append(seq)
            earliest = None
            for seq in self._running:
                if seq.ready_at <= now:
                    self._step(seq)
                elif earliest is None or seq.ready_at < earliest:
                    earliest = seq.ready_at
            self._running = [s for s in self._running if not s.done]
            delay = self._token_s
            if earliest is not None and not any(s.ready_at <= now for s in self._running):
                delay = max(delay, earliest - now)
            await asyncio.sleep(delay)

    def _step(self, seq: _Seq) -> None:
        token_id = seq.tokens.token(seq.next_index)
        seq.next_index += 1
        seq.generated += 1
        piece = SimSequence.text(token_id)
        finish: str | None = None
        before = len(seq.text)
        seq.text += piece
        for stop in seq.request.stop:
            idx = seq.text.find(stop, max(0, before - len(stop) + 1))
            if idx >= 0:
                piece = seq.text[before:idx] if idx >= before else ""
                finish = "stop"
                break
        if finish is None and seq.next_index >= seq.limit:
            finish = seq.end_reason
        usage = None
        if finish is not None:
            seq.done = True
            usage = Usage(prompt_tokens=seq.prompt_tokens, completion_tokens=seq.generated)
        lps = None
        if seq.request.logprobs is not None:
            lps = [sim_logprobs(token_id, seq.request.logprobs)]
        seq.queue.put_nowait(Delta([token_id], piece, finish, usage, lps))
