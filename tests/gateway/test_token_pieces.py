"""The precise index's tokenizing by pieces: the same ids as the tokenizer, or not used."""

from __future__ import annotations

from array import array
from typing import Any

import pytest

from gateway.admission import token_pieces
from gateway.admission.token_pieces import PieceEncoder, _independent


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from sluice.models import default_model_dir, is_prepared

    if not is_prepared(default_model_dir()):
        pytest.skip("run 'sluice model prepare' first")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


SYSTEM = "You keep the lock of the Sluice canal; boats come from the north and the south. " * 20


def chat(tokenizer: Any, user: str) -> str:
    return tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                                         add_generation_prompt=True, tokenize=False)


def test_pieces_give_the_tokenizers_ids_and_a_long_piece_is_tokenized_once(tokenizer: Any) -> None:
    pieces = PieceEncoder.of(tokenizer)
    assert pieces is not None
    users = ["When does the gate open?", "  twice\n\nspaced  ", "é 12345 \t", "<|im_end|><|im_start|>user\nhi",
             "x" * 300 + "<|im_start|>" + "y" * 300]
    for user in users:
        text = chat(tokenizer, user)
        assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False), user
    assert pieces.hits == len(users) - 1  # the system prompt, tokenized for the first text only


def test_a_tokenizer_whose_pieces_may_act_on_each_other_is_tokenized_whole() -> None:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False}
    token = {"id": 1, "content": "<|im_end|>", "lstrip": False, "rstrip": False, "single_word": False,
             "normalized": False, "special": True}
    assert _independent({"normalizer": None, "pre_tokenizer": byte_level, "added_tokens": [token]})
    assert _independent({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split"}, byte_level]},
                         "added_tokens": [token]})
    # SentencePiece-style (Metaspace: a piece's first word is marked as a sequence's first),
    # a normalizer, a token that strips the space beside it: tokenized whole.
    assert not _independent({"pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "first"}})
    assert not _independent({"normalizer": {"type": "NFC"}, "pre_tokenizer": byte_level})
    assert not _independent({"pre_tokenizer": byte_level, "added_tokens": [{**token, "rstrip": True}]})


def test_pieces_that_differ_from_the_whole_turn_themselves_off(tokenizer: Any) -> None:
    pieces = PieceEncoder.of(tokenizer)
    assert pieces is not None
    text = chat(tokenizer, "Which gate first?")
    whole = tokenizer.encode(text, add_special_tokens=False)
    pieces.encode(text)
    (remembered,) = pieces._pieces  # the system prompt's piece, now given wrong ids
    pieces._pieces[remembered] = array("I", [0])
    seen = [pieces.encode(text) for _ in range(token_pieces.VERIFY_EVERY)]
    assert seen[-1] == whole and not pieces.on  # the check caught it, and every text is whole now
    assert pieces.encode(text) == whole and not pieces._pieces


def test_remembered_pieces_stay_within_their_bytes(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_pieces, "CACHE_BYTES", 8_000)
    pieces = PieceEncoder.of(tokenizer)
    assert pieces is not None
    for n in range(40):
        text = f"Boat {n} " * 100 + "<|im_end|>"
        assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False)
        assert pieces._bytes <= 8_000
    assert 0 < len(pieces._pieces) < 40


def test_a_long_prompt_is_tokenized_apart_from_the_event_loop(tokenizer: Any) -> None:
    """Regression: the gateway tokenized every prompt on its event loop, 0.6 s of it for a
    1M-character one, which every other stream of the process waited (from a thread too: the
    tokenizer's ``encode`` holds the GIL). A prompt past ``APART_CHARS`` is tokenized on a
    thread with the GIL released, to the same ids; the loop keeps ticking meanwhile."""
    import asyncio
    import time

    from gateway.admission.prompt_tokens import APART_CHARS, PromptTokenizer
    from sluice.models import default_model_dir

    prompts = PromptTokenizer(str(default_model_dir()))  # (the fixture: the model is prepared)
    text = ("The gate opens at dawn <|im_end|> for boats, é 1234.\n\n " * 12_000)[:600_000]
    payloads = [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]},
                {"prompt": text}]
    assert len(text) > 10 * APART_CHARS

    async def tokenize(payload: dict[str, Any]) -> tuple[list[int] | None, int, float]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        ticks, started = 0, time.perf_counter()
        ids = await prompts.ids(payload)
        ticker.cancel()
        return ids, ticks, time.perf_counter() - started

    for payload in payloads:
        ids, ticks, took_s = asyncio.run(tokenize(payload))
        assert ids == prompts.ids_now(payload)
        assert len(ids or ()) > 100_000
        # Inline, the loop could not tick at all; a tick is 1 ms and more on a busy machine.
        assert ticks >= 10, f"the loop ticked {ticks} times in the {took_s:.3f} s a prompt was tokenized"
    # The long pieces tokenized apart are remembered as those tokenized on the loop are: the
    # loop's next tokenizing of the same prompt finds them.
    assert prompts._pieces is not None
    fresh = {"messages": [{"role": "user", "content": "again: " + text.replace("<|im_end|>", "")}]}
    apart = asyncio.run(prompts.ids(fresh))
    hits = prompts._pieces.hits
    assert prompts.ids_now(fresh) == apart
    assert prompts._pieces.hits > hits
