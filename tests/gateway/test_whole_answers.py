"""What a gateway process holds of the non-streaming answers it builds is bounded
(gateway/relay/whole_answers.py): one answer past the bound ends with 400 answer_too_large,
answers together past it lose the largest (503 answers_full + Retry-After), and either frees
its engine at once; logprobs are held as their JSON, rendered as before."""

from __future__ import annotations

import asyncio
import base64
import random
import struct
import threading
import time
import tracemalloc

import httpx
import openai
import orjson
import pytest
import redis

from engine_worker.engines.sim_pooling import sim_embedding
from gateway.relay.logprobs import RenderedLogprobs, render
from gateway.relay.whole_answers import AnswerTooLarge, WholeAnswers
from gateway.surfaces.openai import PiecedText, ToolCallAssembler
from sluice.embedded_redis import EmbeddedRedis
from sluice.errors import Unavailable
from tests.conftest import Proc, streaming, wait_for

BOUND = 2 * 2**20  # the smallest the setting takes; a top-20 token is ~1.3 KB of JSON here
KEPT_BOUND = 2**20  # what Redis keeps for one API key's Idempotency-Keys (the smallest it takes)


@pytest.fixture(scope="module")
def worker(private_redis: EmbeddedRedis, start_worker) -> Proc:
    return start_worker("sim", redis_at=private_redis.url, sim_token_ms=1, sim_ttft_ms=0)


@pytest.fixture(scope="module")
def gateway(private_redis: EmbeddedRedis, worker: Proc, start_gateway) -> Proc:
    return start_gateway(redis_at=private_redis.url, env={"SLUICE_GATEWAY_MAX_ANSWER_BYTES": str(BOUND),
                                                          "SLUICE_GATEWAY_JOURNAL_TENANT_MAX_BYTES": str(KEPT_BOUND)})


@pytest.fixture(scope="module")
def wide(private_redis: EmbeddedRedis, start_worker) -> Proc:
    """Embeddings 4,096 wide, as a large embedding model's."""
    return start_worker("wide", redis_at=private_redis.url, task="embed", sim_embed_dim=4096)


def _chat(tokens: int, n: int = 1, prompt: str = "tell me everything") -> dict:
    return {"model": "sim", "messages": [{"role": "user", "content": prompt}], "n": n, "max_tokens": tokens,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 20}


def _sdk(body: dict) -> dict:
    """``body`` as the SDK's arguments (``ignore_eos`` is vLLM's, an extra field)."""
    return {**{k: v for k, v in body.items() if k != "ignore_eos"}, "extra_body": {"ignore_eos": True}}


def test_an_answer_past_the_bound_is_a_400_and_frees_its_engine(gateway: Proc, worker: Proc) -> None:
    """Regression: one request (n=16, 8,000 tokens, top-20 logprobs) took a gateway process to
    1.59 GB while its 172 MB answer was built, and nothing bounded it short of the model's
    context. Now an answer ends where it passes the bound: at 1 ms a token this one would
    generate for 20 s."""
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**_sdk(_chat(20_000, n=2)))
        assert refused.value.code == "answer_too_large"
        assert "stream" in refused.value.message
        assert time.monotonic() - started < 10
        wait_for(lambda: streaming(worker) == 0, 5, "the worker's streams of the ended answer closed")
        # The gateway goes on: an answer within the bound is whole.
        answer = client.chat.completions.create(**_sdk(_chat(300)))
    assert answer.usage.completion_tokens == 300
    assert len(answer.choices[0].logprobs.content) == 300


def test_answers_together_past_the_bound_lose_the_largest(gateway: Proc, worker: Proc) -> None:
    """Four answers of ~1.6 MB each at once, against a 2 MiB bound: each would fit alone, all
    together do not. Those ended get 503 answers_full with Retry-After; the rest are whole."""
    results: list[httpx.Response] = []

    def ask(i: int) -> None:
        results.append(httpx.post(gateway.url + "/v1/chat/completions", json=_chat(1_200, prompt=f"user {i}"),
                                  timeout=60))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ended = [r for r in results if r.status_code == 503]
    whole = [r for r in results if r.status_code == 200]
    assert len(ended) + len(whole) == 4, [r.status_code for r in results]
    assert ended and whole
    for r in ended:
        assert r.json()["error"]["code"] == "answers_full"
        assert r.headers["retry-after"] == "1"
    for r in whole:
        body = r.json()
        assert body["usage"]["completion_tokens"] == 1_200
        assert len(body["choices"][0]["logprobs"]["content"]) == 1_200
    wait_for(lambda: streaming(worker) == 0, 5, "the worker's streams closed")


def test_an_embeddings_answer_counts_in_the_bound_before_it_is_parsed(gateway: Proc, wide: Proc) -> None:
    """Regression: embeddings answers (inputs x width floats) were outside the bound: 2,048
    inputs of a 4,096-wide model are a 170 MB line, parsed into ~270 MB more and rendered
    into ~170 MB again, and a few at once took a gateway by GBs. Here 64 inputs as floats (a
    ~5 MB line) pass the 2 MiB bound alone: a 400 that says what to ask for instead. As
    base64 (the SDK's default) the worker makes the strings, a quarter of the bytes: they fit."""
    text = "the quick brown fox"
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model="wide", input=[text] * 64, encoding_format="float")
        assert refused.value.code == "answer_too_large"
        assert refused.value.param == "input" and "fewer inputs" in refused.value.message
        # Nothing of it stays counted: answers within the bound are whole, one after another.
        for encoding in ("float", "base64", "float"):
            got = client.embeddings.create(model="wide", input=[text] * 4, encoding_format=encoding)
            vectors = [d.embedding for d in got.data]
            if encoding == "base64":  # the SDK hands a base64 it was asked for explicitly on as it came
                vectors = [list(struct.unpack("<4096f", base64.b64decode(v))) for v in vectors]
            assert vectors == [pytest.approx(sim_embedding(text, 4096), abs=1e-6)] * 4
        wide_base64 = client.embeddings.create(model="wide", input=[text] * 64)  # the SDK's default
    assert len(wide_base64.data) == 64 and len(wide_base64.data[0].embedding) == 4096


def test_keyed_answers_past_the_journal_bound_are_sent_but_not_kept(gateway: Proc,
                                                                   private_redis: EmbeddedRedis) -> None:
    """Regression: a non-streaming answer with an Idempotency-Key was kept in Redis for an hour
    whatever its size, outside the journal quota: one client's keyed answers could fill Redis
    (and with it every tenant's admission). Now they count in the key's journal memory: within
    it an answer is kept and replayed; past it, sent but not kept (a retry runs it again)."""
    sizes, replayed = [], []
    for i in range(4):  # ~400 KB each against a 1 MiB bound: two are kept
        body = _chat(300, prompt=f"keyed {i}")
        first = httpx.post(gateway.url + "/v1/chat/completions", json=body,
                           headers={"Idempotency-Key": f"kept-{i}"}, timeout=30)
        assert first.status_code == 200
        sizes.append(len(first.content))
        again = httpx.post(gateway.url + "/v1/chat/completions", json=body,
                           headers={"Idempotency-Key": f"kept-{i}"}, timeout=30)
        assert again.status_code == 200
        assert again.json()["choices"] == first.json()["choices"]
        replayed.append(again.headers.get("idempotent-replayed") == "true")
    assert replayed[:2] == [True, True] and not any(replayed[2:]), (sizes, replayed)
    client = redis.Redis.from_url(private_redis.url)
    try:
        held = sum(len(client.hget(k, "body") or b"") for k in client.scan_iter("sl:idem:*"))
    finally:
        client.close()
    assert held <= KEPT_BOUND


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_whole_answers_logprobs_are_the_streams(gateway: Proc, kind: str) -> None:
    """The same request whole and streamed: the same tokens, logprobs and offsets (the whole
    answer's are rendered line by line as they arrive now, the stream's chunk by chunk)."""
    body = _chat(50, n=2)
    if kind == "text":
        body = {**{k: v for k, v in body.items() if k not in ("messages", "top_logprobs", "logprobs")},
                "prompt": "tell me everything", "logprobs": 5}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    whole = httpx.post(gateway.url + path, json=body, timeout=30).json()
    streamed: dict[int, list] = {0: [], 1: []}
    with httpx.stream("POST", gateway.url + path, json={**body, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in orjson.loads(line[6:])["choices"]:
                    if choice.get("logprobs"):
                        streamed[choice["index"]].append(choice["logprobs"])
    for choice in whole["choices"]:
        parts = streamed[choice["index"]]
        if kind == "chat":
            assert choice["logprobs"]["content"] == [e for p in parts for e in p["content"]]
        else:
            for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                assert choice["logprobs"][field] == [e for p in parts for e in p[field]], field


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_rendered_line_by_line_is_rendered_whole(kind: str) -> None:
    rng = random.Random(7)
    words = ["a", " the", "é", "💡", " x\"y", "\n", "\\"]
    lines = [[[rng.choice(words), -rng.random() * 9, [[rng.choice(words), -rng.random() * 9] for _ in range(3)]]
              for _ in range(rng.randrange(0, 4))] for _ in range(40)]
    rendered = RenderedLogprobs(kind)  # type: ignore[arg-type]
    added = sum(rendered.add(entries) for entries in lines)
    got = orjson.dumps(rendered.value())
    assert got == orjson.dumps(render(kind, [e for entries in lines for e in entries]))  # type: ignore[arg-type]
    assert added <= len(got)


def test_the_largest_answer_ends_first_and_its_task_is_cancelled() -> None:
    async def run() -> None:
        answers = WholeAnswers(1000)
        small_added = asyncio.Event()

        async def build(size: int, steps: int) -> str:
            answer = answers.open()
            try:
                for _ in range(steps):
                    answer.add(size)
                    small_added.set()
                    await asyncio.sleep(0.01)
                return "whole"
            except asyncio.CancelledError:
                assert answer.ended is not None
                return answer.ended.code or ""
            except (AnswerTooLarge, Unavailable) as exc:
                return exc.code or ""
            finally:
                answer.close()

        big = asyncio.create_task(build(300, 3))  # 900: alone within the bound
        await small_added.wait()
        small = asyncio.create_task(build(100, 3))  # the two together pass 1,000: the big one ends
        assert await big == "answers_full"
        assert await small == "whole"
        assert answers.total == 0
        assert await asyncio.create_task(build(600, 2)) == "answer_too_large"
        assert answers.total == 0

    asyncio.run(run())


def test_a_retried_attempts_answer_replaces_the_failed_ones() -> None:
    """What an embeddings answer holds is told per attempt (WorkerLines): a worker that broke
    off mid-answer, then another's whole answer, is one answer's bytes, not two."""
    async def run() -> None:
        answers = WholeAnswers(1000)
        answer = answers.open(streamable=False)
        answer.holds(300)
        answer.holds(700)  # the broken attempt's pieces so far
        answer.holds(900)  # the next attempt's announced length: in place of them
        assert answers.total == 900
        with pytest.raises(AnswerTooLarge):
            answer.holds(1001)
        answer.close()
        assert answers.total == 0

    asyncio.run(run())


def test_a_choices_text_holds_about_its_bytes() -> None:
    """The bound counts an answer's text in bytes; held as the lines bring it (a string a
    token), 4-character tokens cost ~15 times that in objects, and the bound let a process
    hold 20 times what it counted (gateway/surfaces/openai.py)."""
    lines = [orjson.dumps({"text": f" t{i % 97:02d}"}) for i in range(50_000)]
    counted = 0
    text = PiecedText()
    tracemalloc.start()
    try:
        for line in lines:
            token = orjson.loads(line)["text"]  # a string of its own, as each line's
            counted += len(token)
            text.add(token)
        del token
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 1.5 * counted, f"{held:,} bytes held for {counted:,} counted"
    assert text.value() == "".join(f" t{i % 97:02d}" for i in range(50_000))
    for n in (0, 1, 255, 256, 257, 513):  # around the joins
        short = PiecedText()
        for i in range(n):
            short.add(str(i))
        assert short.value() == "".join(map(str, range(n)))


def test_a_tool_calls_arguments_in_many_pieces_are_whole() -> None:
    """Arguments held as pieces (before: ``+=`` on the call's string, each piece copying all
    before it), joined when the call is read, the same as the pieces' concatenation."""
    assembler = ToolCallAssembler()
    pieces = [f'"k{i}": {i}, ' for i in range(1000)]
    assembler.add([{"index": 1, "id": "call_b", "function": {"name": "second", "arguments": "{"}}])
    assembler.add([{"index": 0, "id": "call_a", "function": {"name": "first", "arguments": ""}}])
    for piece in pieces:
        assembler.add([{"index": 0, "function": {"arguments": piece}}, {"index": 1, "function": {"arguments": "x"}}])
    assert assembler.call(0)["function"]["arguments"] == "".join(pieces)
    first, second = assembler.calls()
    assert (first["id"], first["function"]["name"]) == ("call_a", "first")
    assert second["function"] == {"name": "second", "arguments": "{" + "x" * 1000}
