"""vLLM's KV events renamed into the precise index's token-block hashes (no engine: the
events are built as vLLM 0.26/0.32 put them on the wire, maps tagged ``type``)."""

from __future__ import annotations

import msgspec

from engine_worker.engines.vllm_kv_events import BlockTranslator
from gateway.admission.routing import PromptPrefix, RouteCheck
from sluice.prefix_tokens import TOKEN_BLOCK, token_block_hashes


def stored(hashes: list[object], parent: object, tokens: list[int], size: int) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None}


def wire(*events: dict[str, object]) -> list[object]:
    """A KVEventBatch as the publisher encodes it, decoded without vLLM's classes."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode([1.0, list(events), None]))


def test_blocks_of_16_stored_in_runs_name_what_the_gateway_hashes() -> None:
    prompt = list(range(1000, 1000 + 200))  # 12 vLLM blocks of 16 (192 tokens), 3 of ours
    t = BlockTranslator()
    first = t.events(wire(stored([b"h0", b"h1", b"h2", b"h3", b"h4"], None, prompt[:80], 16)))
    rest = t.events(wire(stored([7, 8, 9, 10, 11, 12, 13], b"h4", prompt[80:192], 16)))
    names = [h for e in first + rest for h in e["block_hashes"]]
    assert names == token_block_hashes(prompt)  # the gateway's hashes of the same ids
    assert t.orphans == 0


def test_an_evicted_block_takes_every_block_of_ours_it_was_part_of() -> None:
    t = BlockTranslator()
    ours = t.stored(["a", "b", "c", "d"], None, list(range(128)), 32)
    assert len(ours) == 2
    # "a" is half of our first block: evicting it unmakes that block, not the second
    assert t.removed(["a"]) == ours[:1]
    assert t.removed(["d"]) == ours[1:]
    assert t.removed(["zz"]) == []


def test_a_child_of_an_unknown_parent_is_skipped_and_counted() -> None:
    t = BlockTranslator()
    assert t.stored(["x"], "never-seen", list(range(64)), 64) == []
    assert t.orphans == 1


def test_cleared_removes_everything_and_other_groups_are_ignored() -> None:
    t = BlockTranslator()
    other = {**stored(["g1"], None, list(range(64)), 64), "group_idx": 1}
    assert t.events(wire(other)) == []
    ours = t.stored(["a"], None, list(range(64)), 64)
    (event,) = t.events(wire({"type": "AllBlocksCleared"}))
    assert event == {"type": "removed", "block_hashes": ours}
    assert len(t) == 0


def test_precise_route_check_counts_tokens_and_forgives_the_engines_rounding() -> None:
    prefix = PromptPrefix.of_tokens(list(range(300)))
    assert len(prefix.blocks) == 300 // TOKEN_BLOCK and prefix.precise
    # 4 blocks matched, vLLM (blocks of 16) found 256 cached: exact
    exact = RouteCheck.of(prefix, 4, {"prompt_tokens": 300, "cached_tokens": 256}, 0)
    assert (exact.expected, exact.error, exact.held_blocks) == (256, 0, 4)
    # it found only 2 blocks' worth: the other two leave the index
    short = RouteCheck.of(prefix, 4, {"prompt_tokens": 300, "cached_tokens": 128}, 0)
    assert (short.error, short.held_blocks) == (128, 2)
