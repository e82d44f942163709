"""Resumed text is exact at every break: UTF-8 characters split over tokens, stop
strings spanning the break, special tokens. Real tokenizer of the default model; the
reference is what an engine's incremental detokenizer (tokenizers' DecodeStream, as
vLLM uses it) would have streamed without a break."""

from __future__ import annotations

import pytest

from engine_worker.engines.resume import ResumedText
from engine_worker.protocol import GenerateRequest
from sluice.models import default_model_dir, is_prepared

pytestmark = pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first")

ANSWER = "Voilà 😀 — 你好，世界！Say it: Voilà 😀🚢 ok. THE END and more text after it."


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def engine_stream(tokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], int]:
    """What an engine sends per token without a break: (text per token, tokens kept).

    Mirrors vLLM: whole characters only, the last ``max(len(stop)) - 1`` characters held
    back, the text cut before a stop string and no token after the one completing it."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=True)
    hold = max((len(s) for s in stop), default=1) - 1
    text, sent, pieces = "", 0, []
    for n, token_id in enumerate(ids, start=1):
        text += stream.step(tokenizer._tokenizer, token_id) or ""
        hits = [i for s in stop if (i := text.find(s)) >= 0]
        if hits:
            pieces.append(text[sent:min(hits)])
            return pieces, n
        ready = max(sent, len(text) - hold)
        pieces.append(text[sent:ready])
        sent = ready
    pieces[-1] += text[sent:]  # finished: nothing held back any more
    return pieces, len(ids)


@pytest.mark.parametrize("stop", [[], ["THE END"], ["😀🚢"], ["界！S", "zzz"]], ids=["none", "words", "emoji", "cjk"])
def test_every_break_gives_the_uninterrupted_text(tokenizer, stop: list[str]) -> None:
    ids = tokenizer.encode(ANSWER) + [tokenizer.eos_token_id]
    pieces, kept = engine_stream(tokenizer, ids, stop)
    reference = "".join(pieces)
    assert "\ufffd" not in reference
    split_chars = 0
    for k in range(1, kept):
        sent_chars = sum(len(p) for p in pieces[:k])
        request = GenerateRequest(request_id="r", model="m", prompt="p", stop=stop,
                                  resume_token_ids=ids[:k], resume_text_chars=sent_chars)
        text = ResumedText.start(tokenizer, request)
        assert text is not None
        out, stopped = "", False
        for j in range(k, len(ids)):
            _, piece, stopped = text.step([ids[j]], finished=j == len(ids) - 1)
            out += piece
            if stopped:
                assert j + 1 == kept, f"break after {k}: stopped at token {j + 1}, not {kept}"
                break
        assert stopped == bool(stop) and kept < len(ids) or not stop
        assert reference[:sent_chars] + out == reference, f"break after token {k}"
        split_chars += tokenizer.decode(ids[:k]).endswith("\ufffd")
    assert split_chars, "the answer must put a break inside a multi-byte character"


def test_not_resuming_is_none(tokenizer) -> None:
    assert ResumedText.start(tokenizer, GenerateRequest(request_id="r", model="m", prompt="p")) is None
