"""An OpenAI-compatible mock engine with a fixed timing model, for the peers benchmark and
the ``--engine openai`` tests.

    python loadtest/peers/mock_openai.py --port 18501 [--ttft-ms 20 --token-ms 5] [--vllm]

Timing (streamed, or one body at the end with ``stream: false``): the first token ``ttft_ms`` after the request arrives, then one token every
``token_ms``, for every stream at once (one ticker serves them all, so 64 streams cost
what one batched engine step would). Tokens are words; token ``k+1`` is a hash of the
seed and the two tokens before it, so a stream continued from prompt + the tokens it
already gave goes on exactly as it would have (what token-exact migration needs), and
a token whose hash falls in 1/64 of the range ends the sequence (unless ``ignore_eos``).

``--vllm`` makes it look like vLLM where Sluice looks: ``/version``, ``/metrics`` with
vLLM's names, ``return_token_ids``, token-id prompts, ``/tokenize`` and ``/detokenize``.
``GET /mock/requests`` lists the request bodies received (tests read what was passed on),
``POST /health {"ok": false}`` makes it fail its health check until ``{"ok": true}``;
a body whose prompt contains ``MOCK_FAIL_MIDWAY`` breaks its stream after 3 tokens. A chat
request with ``tools`` whose ``tool_choice`` names a function (or is "required") calls it:
the tokens become its arguments, ``{"words": "<the tokens' words>"}`` (:func:`tool_arguments`).

``--usage`` says where ``usage`` goes when the client asks for it (``include_usage``), as
servers differ: ``own`` (OpenAI's shape: a chunk of its own, ``choices: []``, after the
finishing one), ``finish`` (in the finishing chunk, beside ``finish_reason``), ``every``
(running totals in every chunk, as vLLM's ``continuous_usage_stats``).

``kv_transfer_params`` as vLLM's KV connectors take them (prefill/decode disaggregation):
asked ``{"do_remote_decode": true}``, a whole (``stream: false``) answer returns parameters
naming this server as the KV's holder (``remote_host``, ``remote_port``), as vLLM returns
them in whole answers only; given ``{"do_remote_prefill": true}``, the answer's usage
counts the prompt as cached (its KV arrived instead of being computed).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwxz" for v in "aeiou"]
VOCAB = [_SYLLABLES[i % 95] + _SYLLABLES[(i // 95 * 7 + i) % 95] for i in range(1024)]
_WORD_ID = {w: i for i, w in enumerate(VOCAB)}
MODEL = "mock"
#: The request bodies ``/mock/requests`` shows (the latest). All of them were kept: a bench run
#: of 100,000 requests grew the heap, each full collection took longer, and the mock's own TTFT
#: p99 grew from window to window (loadtest/peers/README.md, "The floor under issue 22").
RECEIVED_KEPT = 10_000


def _hash(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=4).digest(), "little")


def tokenize(text: str) -> list[int]:
    return [_WORD_ID.get(w, _hash(w) % len(VOCAB)) for w in text.split()]


def detokenize(ids: list[int]) -> str:
    return "".join(" " + VOCAB[i % len(VOCAB)] for i in ids)


def chat_template(messages: list[dict[str, Any]]) -> str:
    return "".join(f"<|{m.get('role')}|> {m.get('content')} " for m in messages) + "<|assistant|>"


def embedding(text: str) -> list[float]:
    """The mock's embedding of ``text``: 8 numbers from its tokens' hashes."""
    ids = tokenize(text)
    return [(_hash(k, ids) % 2001 - 1000) / 1000 for k in range(8)]


def score(text_1: str, text_2: str) -> float:
    """The mock's relevance score (a cross-encoder's, not a cosine): shared words over all words."""
    a, b = set(text_1.split()), set(text_2.split())
    return len(a & b) / max(1, len(a | b))


def next_token(seed: int, ids: list[int]) -> tuple[int, bool]:
    h = _hash(seed, ids[-2] if len(ids) > 1 else -1, ids[-1] if ids else -1)
    return h % len(VOCAB), (h >> 16) % 64 == 0


class _Stream:
    __slots__ = ("done", "fail_at", "generated", "ids", "ignore_eos", "limit", "queue", "ready_at", "seed")

    def __init__(self, ids: list[int], body: dict[str, Any], ttft_s: float) -> None:
        self.queue: asyncio.Queue[tuple[int, str | None] | None] = asyncio.Queue()
        self.ready_at = time.monotonic() + ttft_s
        self.ids = ids
        self.generated = 0
        self.limit = int(body.get("max_tokens") or 256)
        self.seed = int(body.get("seed") or 0)
        self.ignore_eos = bool(body.get("ignore_eos"))
        self.fail_at = 3 if "MOCK_FAIL_MIDWAY" in f"{body.get('prompt')}{body.get('messages')}" else -1
        self.done = False


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class MockEngine:
    def __init__(self, ttft_ms: float, token_ms: float, vllm: bool, eos: bool = True, usage: str = "own",
                 address: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        #: Where a decode server would fetch the KV this one keeps (``kv_transfer_params``).
        self.address = address
        self.eos = eos
        self.usage = usage
        self.healthy = True
        self.ttft_s = ttft_ms / 1000
        self.token_s = token_ms / 1000
        self.vllm = vllm
        self.streams: set[_Stream] = set()
        self.received: deque[dict[str, Any]] = deque(maxlen=RECEIVED_KEPT)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def ticker(self) -> None:
        while True:
            if not self.streams:
                self._wake.clear()
                await self._wake.wait()
            now = time.monotonic()
            for s in list(self.streams):
                if s.ready_at > now:
                    continue
                if s.generated == s.fail_at:
                    s.queue.put_nowait(None)
                    self.streams.discard(s)
                    continue
                token, eos = next_token(s.seed, s.ids)
                s.ids.append(token)
                s.generated += 1
                finish = "stop" if eos and self.eos and not s.ignore_eos else "length" if s.generated >= s.limit else None
                s.queue.put_nowait((token, finish))
                if finish is not None:
                    self.streams.discard(s)
            await asyncio.sleep(self.token_s)

    def add(self, stream: _Stream) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.ticker())
        self.streams.add(stream)
        self._wake.set()


def tool_called(body: dict[str, Any]) -> str | None:
    """The function a chat request makes the mock call (``tool_choice`` naming one, or
    "required": the first tool), else None (it answers in text)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        return None
    if isinstance(choice, dict):
        return str((choice.get("function") or {}).get("name"))
    return str(tools[0]["function"]["name"]) if choice == "required" else None


def tool_arguments(words: list[str]) -> str:
    """The arguments the mock's call passes: its tokens' words, as JSON."""
    return '{"words": "' + " ".join(words) + '"}'


def _chunk(rid: str, chat: bool, created: int, token: int | None, finish: str | None,
           want_ids: bool, usage: dict[str, Any] | None = None, call: tuple[str, bool] | None = None) -> bytes:
    """``call``: the token is a piece of a call's arguments: (the function, whether it is the first)."""
    text = "" if token is None else " " + VOCAB[token]
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat and call is not None:
        name, first = call
        piece = ('{"words": "' + text[1:] if first else text) + ('"}' if finish else "")
        head = {"id": f"call_{rid}", "type": "function", "function": {"name": name, "arguments": piece}}
        choice["delta"] = {"tool_calls": [{"index": 0, **(head if first else {"function": {"arguments": piece}})}]}
        choice["finish_reason"] = finish and "tool_calls"
    elif chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    if want_ids:
        choice["token_ids"] = [] if token is None else [token]
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": MODEL, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def _whole(stream: _Stream, rid: str, chat: bool, created: int, prompt_len: int, want_ids: bool,
                 cached: int, call: str | None = None) -> dict[str, Any]:
    """A non-streaming answer: the same tokens at the same pace, in one body at the end."""
    tokens: list[int] = []
    finish = None
    while finish is None:
        item = await stream.queue.get()
        if item is None:
            raise ConnectionResetError("MOCK_FAIL_MIDWAY")
        token, finish = item
        tokens.append(token)
    text = "".join(" " + VOCAB[t] for t in tokens)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat and call is not None:
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{rid}", "type": "function",
             "function": {"name": call, "arguments": tool_arguments([VOCAB[t] for t in tokens])}}]}
        choice["finish_reason"] = "tool_calls"
    elif chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if want_ids:
        choice["token_ids"] = tokens
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": MODEL, "choices": [choice], "usage": _usage(prompt_len, len(tokens), cached)}


def _kept_kv(engine: MockEngine, prompt_len: int) -> dict[str, Any]:
    """What a prefill server returns for its decode server: where the prompt's KV is kept."""
    host, port = engine.address
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"mock-{port}",
            "remote_block_ids": list(range((prompt_len + 15) // 16)), "remote_host": host, "remote_port": port}


def create_app(engine: MockEngine) -> Starlette:
    def json(obj: Any, status: int = 200) -> Response:
        return Response(orjson.dumps(obj), status_code=status, media_type="application/json")

    def error(message: str, status: int = 400) -> Response:
        return json({"error": {"message": message, "type": "BadRequestError", "code": status}}, status)

    async def generate(request: Request) -> Response:
        chat = request.url.path.endswith("chat/completions")
        body = orjson.loads(await request.body())
        engine.received.append(body)
        if body.get("model") not in (None, MODEL):
            return error(f"The model `{body.get('model')}` does not exist.", 404)
        if "priority" in body and not engine.vllm:
            return error("priority is not supported by this server")
        prompt = body.get("prompt")
        if chat:
            ids = tokenize(chat_template(body.get("messages") or []))
        elif isinstance(prompt, list) and engine.vllm:
            ids = [int(i) for i in prompt]
        elif isinstance(prompt, str):
            ids = tokenize(prompt)
        else:
            return error("prompt must be a string")
        if len(ids) > 4096:
            return error("This model's maximum context length is 4096 tokens.")
        prompt_len = len(ids)
        stream = _Stream(ids, body, engine.ttft_s)
        want_ids = bool(body.get("return_token_ids")) and engine.vllm
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        kv = body.get("kv_transfer_params") or {}
        cached = prompt_len if kv.get("do_remote_prefill") else 0
        engine.add(stream)
        call = tool_called(body) if chat else None
        if not body.get("stream"):
            answer = await _whole(stream, rid, chat, created, prompt_len, want_ids, cached, call)
            if kv.get("do_remote_decode"):
                answer["kv_transfer_params"] = _kept_kv(engine, prompt_len)
            return json(answer)
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> AsyncIterator[bytes]:
            try:
                if chat:
                    yield (b"data: " + orjson.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": MODEL, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                        "finish_reason": None}]}) + b"\n\n")
                while True:
                    item = await stream.queue.get()
                    if item is None:
                        raise ConnectionResetError("MOCK_FAIL_MIDWAY")  # the server "dies" mid-stream
                    token, finish = item
                    inline = wants_usage and (engine.usage == "every" or (engine.usage == "finish" and finish is not None))
                    usage = _usage(prompt_len, stream.generated, cached) if inline else None
                    yield _chunk(rid, chat, created, token, finish, want_ids, usage,
                                 None if call is None else (call, stream.generated == 1))
                    if finish is not None:
                        break
                if wants_usage and engine.usage == "own":
                    usage = _usage(prompt_len, stream.generated, cached)
                    yield b"data: " + orjson.dumps({"id": rid, "choices": [], "usage": usage}) + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                engine.streams.discard(stream)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return json({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "mock"}]})

    async def health(request: Request) -> Response:
        if request.method == "POST":  # tests turn the server's health off and on
            engine.healthy = bool(orjson.loads(await request.body())["ok"])
        return Response(b"", status_code=200 if engine.healthy else 503)

    async def version(request: Request) -> Response:
        return json({"version": "0.0.0-mock"}) if engine.vllm else error("not found", 404)

    async def metrics(request: Request) -> Response:
        if not engine.vllm:
            return error("not found", 404)
        running = sum(1 for s in engine.streams if s.ready_at <= time.monotonic())
        text = (f'vllm:num_requests_running{{model_name="{MODEL}"}} {running}.0\n'
                f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {len(engine.streams) - running}.0\n'
                f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {len(engine.streams) / 256}\n')
        return Response(text.encode(), media_type="text/plain")

    async def tokenize_route(request: Request) -> Response:
        body = orjson.loads(await request.body())
        if not engine.vllm:
            return error("not found", 404)
        text = chat_template(body["messages"]) if "messages" in body else str(body.get("prompt", ""))
        ids = tokenize(text)
        return json({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    async def detokenize_route(request: Request) -> Response:
        body = orjson.loads(await request.body())
        return json({"prompt": detokenize(body["tokens"])})

    async def embeddings(request: Request) -> Response:
        body = orjson.loads(await request.body())
        engine.received.append(body)
        inputs = [body["input"]] if isinstance(body["input"], str) else body["input"]
        if body.get("dimensions") is not None:
            return error("this model does not support Matryoshka embeddings")
        used = sum(len(tokenize(t)) for t in inputs)
        return json({"object": "list", "model": MODEL, "usage": {"prompt_tokens": used, "total_tokens": used},
                     "data": [{"object": "embedding", "index": i, "embedding": embedding(t)}
                              for i, t in enumerate(inputs)]})

    async def score_route(request: Request) -> Response:
        if not engine.vllm:
            return error("not found", 404)
        body = orjson.loads(await request.body())
        engine.received.append(body)
        pairs = list(zip(body["text_1"], body["text_2"], strict=True))
        used = sum(len(tokenize(a)) + len(tokenize(b)) for a, b in pairs)
        return json({"object": "list", "model": MODEL, "usage": {"prompt_tokens": used, "total_tokens": used},
                     "data": [{"index": i, "object": "score", "score": score(a, b)} for i, (a, b) in enumerate(pairs)]})

    async def received(request: Request) -> Response:
        return json(list(engine.received))

    return Starlette(routes=[
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/models", models), Route("/health", health, methods=["GET", "POST"]), Route("/version", version),
        Route("/metrics", metrics), Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/detokenize", detokenize_route, methods=["POST"]), Route("/mock/requests", received),
        Route("/v1/embeddings", embeddings, methods=["POST"]), Route("/score", score_route, methods=["POST"]),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--token-ms", type=float, default=5.0)
    parser.add_argument("--vllm", action="store_true", help="answer like vLLM (token ids, /version, /metrics)")
    parser.add_argument("--no-eos", action="store_true", help="every stream runs to max_tokens")
    parser.add_argument("--usage", choices=["own", "finish", "every"], default="own",
                        help="where usage goes: a chunk of its own, the finishing chunk, every chunk")
    args = parser.parse_args()
    engine = MockEngine(args.ttft_ms, args.token_ms, args.vllm, eos=not args.no_eos, usage=args.usage,
                        address=(args.host, args.port))
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="warning",
                loop="uvloop", http="httptools", access_log=False)


if __name__ == "__main__":
    main()
