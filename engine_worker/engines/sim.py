"""A deterministic simulator with a vLLM-style step loop, for tests and load tests.

The text of token ``i`` depends only on (prompt, seed, i), so a request resumed
with ``resume_token_ids`` on another worker continues exactly where the first
one stopped, and a run can be checked token for token against a reference.

Timing: a sequence admitted to the running batch waits at least ``ttft_ms``, and
its uncached prompt tokens are prefilled, ``prefill_chunk`` tokens per step shared
by the sequences in prefill (oldest first), each costing ``prefill_ms_per_token``
on top of the step's ``token_ms`` -- so prefill slows every running sequence's
decode, as chunked prefill does in vLLM. Then it gets one token per step. At most
``max_seqs`` sequences run at once; the rest wait.

Prefix cache: a prompt's words are its tokens, in blocks of 64 named by
:func:`sluice.prefix.block_hashes`; the leading blocks found in the worker's LRU
(``cache_blocks`` of them at most) are ``cached_tokens`` and skip prefill. A prefilled
prompt's blocks are stored, and every store and eviction is a KV event
(:meth:`SimEngine.take_kv_events`) that the worker reports to the gateways' index.

Structured output (``response_format`` JSON, a forced tool call) is one schema-valid
JSON value streamed a few characters per token (engines/sim_structured.py), turned
into tool calls as a real engine's would be; ``tool_choice: "auto"`` is answered in
text (the simulator has no tool-call syntax). Token-id prompts use the simulator's
vocabulary (``VOCAB``); ``echo`` sends the prompt back first. A ``prefill`` or ``decode``
simulator models prefill/decode disaggregation's KV transfer (engines/sim_kv.py).
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
from engine_worker.engines.prefix_cache import PrefixCache
from engine_worker.engines.prompts import checked_bias, checked_ids
from engine_worker.engines.sim_kv import NONE as NO_TRANSFER
from engine_worker.engines.sim_kv import SimConnector, Transfer
from engine_worker.engines.sim_structured import MAX_CHARS, PIECE_CHARS, structured_pieces
from engine_worker.engines.tool_calls import ForcedCalls, decoding_constraint
from engine_worker.protocol import Delta, GenerateRequest, KVEvent, Usage
from sluice.prefix import BLOCK_TOKENS, block_hashes_of_words, chat_text
from sluice.roles import BOTH, Role

_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwxz" for v in "aeiou"]
VOCAB = [_SYLLABLES[i % len(_SYLLABLES)] + _SYLLABLES[(i // len(_SYLLABLES) * 7) % len(_SYLLABLES)] for i in range(1024)]
#: Natural lengths (the simulated end-of-sequence) lie in this range.
MIN_NATURAL, NATURAL_SPAN = 32, 224


def render_chat(messages: list[dict[str, object]]) -> str:
    """The simulator's chat template (the gateway's canonical prompt text)."""
    return chat_text(messages)


def prompt_text(request: GenerateRequest) -> str:
    if request.messages is not None:
        return render_chat(request.messages)
    if request.prompt_token_ids is not None:
        # The simulator's vocabulary is VOCAB: ids outside it are refused as a model would.
        return "".join(SimSequence.text(i) for i in checked_ids(request.prompt_token_ids, len(VOCAB)))
    return request.prompt or ""


class SimSequence:
    """One request's deterministic token stream."""

    __slots__ = ("_base", "natural_length")

    def __init__(self, prompt: str, seed: int | None, adapter: str | None = None) -> None:
        # A LoRA adapter changes the output as a real one would: the same prompt, another stream.
        salt = f"{seed or 0}\x00lora:{adapter}" if adapter else f"{seed or 0}"
        digest = hashlib.blake2b(f"{salt}\x00{prompt}".encode(), digest_size=16).digest()
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
    blocks: list[str] = field(default_factory=list)
    #: Structured output: the JSON text's pieces, one per simulated token.
    pieces: list[str] | None = None
    #: A forced tool call turns the JSON into tool-call deltas (no "auto": the simulator
    #: has no tool-call syntax of its own, so with "auto" it answers in text).
    tools: ForcedCalls | None = None
    echo: str | None = None
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    ready_at: float = 0.0
    #: Prefill/decode disaggregation (engines/sim_kv.py).
    transfer: Transfer = NO_TRANSFER
    cached_tokens: int = 0
    prefill_left: int = 0
    text: str = ""
    generated: int = 0
    done: bool = False


class SimEngine:
    name = "sim"
    healthy = True

    def __init__(
        self, *, ttft_ms: float = 20.0, token_ms: float = 5.0, max_seqs: int = 64, fail_first: int = 0,
        crash_on: str | None = None, prefill_ms_per_token: float = 0.0, prefill_chunk: int = 512,
        cache_blocks: int = 1024, role: Role = BOTH, kv_transfer_ms_per_token: float = 0.0,
    ) -> None:
        self.capacity = max_seqs
        #: Its part in prefill/decode disaggregation: KV parameters handed out or taken.
        self.connector = SimConnector(role, kv_transfer_ms_per_token)
        self.cache = PrefixCache(cache_blocks)
        self._prefill_s = prefill_ms_per_token / 1000
        self._prefill_chunk = prefill_chunk
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
        #: LoRA adapters loaded: name -> path (the simulator reads no weights).
        self.adapters: dict[str, str] = {}

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
            prefix_queries=self.cache.queried,
            prefix_hits=self.cache.hit,
        )

    def take_kv_events(self) -> list[KVEvent]:
        return self.cache.take_events()

    async def load_adapter(self, name: str, path: str) -> None:
        self.adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)

    async def prompt_tokens(self, request: GenerateRequest) -> int:
        return len(prompt_text(request).split())  # a prompt's words are its tokens, as in generate

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        if self._crash_on and self._crash_on in prompt_text(request):
            os._exit(70)
        if self._fail_left > 0:
            self._fail_left -= 1
            raise RuntimeError("simulated engine failure before the first token")
        prompt = prompt_text(request)
        checked_bias(request.logit_bias, len(VOCAB))  # the simulator samples nothing, but checks as vLLM does
        if request.adapter and request.adapter not in self.adapters:
            raise RuntimeError(f"adapter {request.adapter!r} is not loaded")
        tokens = SimSequence(prompt, request.seed, request.adapter)
        resumed = len(request.resume_token_ids)
        # The simulated end-of-sequence, unless ignored; never before min_tokens.
        end = tokens.natural_length
        if request.ignore_eos and request.max_tokens is not None:
            end = resumed + request.max_tokens
        end = max(end, resumed + request.min_tokens)
        constraint = decoding_constraint(request)
        pieces, end_reason = None, "stop"
        if constraint is not None:
            # The grammar ends the output: EOS once the JSON is complete. Built only as far as
            # the token limit (and one piece) lets it out.
            # (A resumed generation's budget is its first's: the same text.)
            room = MAX_CHARS if request.max_tokens is None else PIECE_CHARS * (resumed + request.max_tokens + 1)
            pieces, whole = structured_pieces(constraint, f"{request.seed or 0}:{prompt}", min(room, MAX_CHARS))
            end, end_reason = len(pieces), "stop" if whole else "length"
        limit = end
        if request.max_tokens is not None and resumed + request.max_tokens <= end:
            limit, end_reason = resumed + request.max_tokens, "length"
        words = prompt.split()
        transfer = self.connector.transfer(request.kv_transfer_params, prompt, request.resume_token_ids,
                                           len(words) + resumed)
        seq = _Seq(
            request=request,
            tokens=tokens,
            blocks=block_hashes_of_words(words),
            prompt_tokens=len(words) + resumed,
            next_index=resumed,
            limit=limit,
            end_reason=end_reason,
            pieces=pieces,
            tools=None if request.tool_mode in (None, "none", "auto") else ForcedCalls(request.tool_mode),
            echo=prompt if request.echo and not resumed else None,
            transfer=transfer,
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

    def _admit(self, seq: _Seq, now: float) -> None:
        if seq.transfer.receive_s is not None:
            # A decode hop: its prompt's KV arrives from the prefill worker instead of being
            # computed; usage counts it as cached (none of it computed here).
            seq.ready_at = now + seq.transfer.receive_s
            seq.cached_tokens = seq.prompt_tokens
            self._prefilled(seq)
            self._running.append(seq)
            return
        seq.ready_at = now + self._ttft_s
        seq.prefill_left = -1  # the cache is looked up when its prefill starts
        if self._prefill_s <= 0:
            self._start_prefill(seq)
            self._prefilled(seq)
        self._running.append(seq)

    def _start_prefill(self, seq: _Seq) -> None:
        # Looked up now, not on arrival: a sequence that waited for the prefill budget
        # finds what the ones before it stored (as in vLLM, where it waits to be scheduled).
        seq.cached_tokens = self.cache.match(seq.blocks) * BLOCK_TOKENS
        seq.prefill_left = seq.prompt_tokens - seq.cached_tokens

    def _prefilled(self, seq: _Seq) -> None:
        seq.prefill_left = 0
        self.cache.store(seq.blocks)

    def _prefill(self) -> int:
        """One step's chunk of prefill, oldest sequences first; returns the tokens prefilled."""
        budget = self._prefill_chunk
        for seq in self._running:
            if budget <= 0:
                break
            if seq.prefill_left < 0:
                self._start_prefill(seq)
                if seq.prefill_left == 0:
                    self._prefilled(seq)
            if seq.prefill_left > 0:
                take = min(budget, seq.prefill_left)
                budget -= take
                seq.prefill_left -= take
                if seq.prefill_left == 0:
                    self._prefilled(seq)
        return self._prefill_chunk - budget

    async def _loop(self) -> None:
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
            now = time.monotonic()
            while self._waiting and len(self._running) < self.capacity:
                self._admit(self._waiting.popleft(), now)
            # Sequences prefilled before this step decode in it; the step lasts longer by
            # the prefill it also does.
            decoding = [s for s in self._running if s.prefill_left == 0 and s.ready_at <= now]
            prefilled = self._prefill()
            if decoding or prefilled:
                await asyncio.sleep(self._token_s + prefilled * self._prefill_s)
                for seq in decoding:
                    if not seq.done:
                        self._step(seq)
            else:
                earliest = min((s.ready_at for s in self._running if s.ready_at > now), default=now)
                await asyncio.sleep(max(self._token_s, earliest - now))
            self._running = [s for s in self._running if not s.done]

    def _step(self, seq: _Seq) -> None:
        token_id = seq.tokens.token(seq.next_index)
        seq.next_index += 1
        seq.generated += 1
        piece = SimSequence.text(token_id) if seq.pieces is None else seq.pieces[seq.next_index - 1]
        finish: str | None = None
        before = len(seq.text)
        seq.text += piece
        stopped_by: str | None = None
        for stop in seq.request.stop:
            idx = seq.text.find(stop, max(0, before - len(stop) + 1))
            if idx >= 0:
                piece = seq.text[before:idx] if idx >= before else ""
                finish, stopped_by = "stop", stop
                break
        if finish is None and seq.next_index >= seq.limit:
            finish = seq.end_reason
        usage = None
        kv = None
        if finish is not None:
            seq.done = True
            usage = Usage(prompt_tokens=seq.prompt_tokens, completion_tokens=seq.generated,
                          cached_tokens=seq.cached_tokens)
            if seq.transfer.produce:
                kv = self.connector.produced(prompt_text(seq.request), seq.request.resume_token_ids,
                                             seq.prompt_tokens)
        lps = None
        if seq.request.logprobs is not None:
            lps = [sim_logprobs(token_id, seq.request.logprobs)]
        calls = None
        if seq.tools is not None:
            piece, calls, finish = seq.tools.step(piece, [token_id], finish)
        seq.queue.put_nowait(Delta([token_id], piece, finish, usage, lps, calls, seq.echo,
                                   stopped_by if finish == "stop" else None, kv))
        seq.echo = None
