"""The simulator's structured output: a deterministic JSON value valid for a schema.

A real engine constrains sampling with a grammar; the simulator has no sampling, so
it writes one instance of the schema (the first ``anyOf`` branch, every property,
minimal arrays) and streams it a few characters per token. Covers the JSON Schema
that tool parameters and ``response_format`` use in practice: objects, arrays,
strings (``enum``, ``const``), numbers, integers, booleans, null, ``anyOf`` /
``oneOf``, local ``$ref``.

The value is built within a budget of characters: what the request's token limit lets out,
or :data:`MAX_CHARS`. Unbounded, a 300-byte schema with ``minLength: 20000000`` made a
one-token request build 20 MB on the worker's loop (1.07 s, +345 MiB: a review), and nested
``minItems`` multiply. Past the budget, arrays and strings stop growing: such a value is cut
by its limit anyway (``finish_reason: length``), as a real engine's would be.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

#: Characters per simulated token of JSON text.
PIECE_CHARS = 4
#: The most JSON text one generation writes: a simulated context of 32,768 tokens.
MAX_CHARS = PIECE_CHARS * 32768


def example(schema: dict[str, Any], seed: str, root: dict[str, Any] | None = None, depth: int = 0,
            budget: list[int] | None = None) -> Any:
    """A value that validates against ``schema``; strings and numbers vary with ``seed``.
    ``budget``: characters left (one item, spent as the value grows); past it arrays and
    strings stop growing, and the value no longer need validate."""
    root = schema if root is None else root
    budget = [MAX_CHARS] if budget is None else budget
    if depth > 16:
        return None
    if "$ref" in schema:
        target: Any = root
        for part in str(schema["$ref"]).removeprefix("#/").split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return example(target, seed, root, depth + 1, budget)
    if "const" in schema:
        return _spent(budget, schema["const"])
    if schema.get("enum"):
        return _spent(budget, schema["enum"][_pick(seed, len(schema["enum"]))])
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return example({**schema[key][0], **{k: v for k, v in schema.items() if k != key}}, seed, root,
                           depth + 1, budget)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        value: dict[str, Any] = {}
        for name, sub in (schema.get("properties") or {}).items():
            if budget[0] <= 0:
                break
            budget[0] -= len(name) + 4
            value[name] = example(sub, f"{seed}.{name}", root, depth + 1, budget)
        return value
    if kind == "array":
        items = schema.get("items") or {}
        count = max(1, int(schema.get("minItems", 1)))
        if "maxItems" in schema:
            count = min(count, int(schema["maxItems"]))
        values = []
        for i in range(count):
            if budget[0] <= 0:
                break
            budget[0] -= 2
            values.append(example(items, f"{seed}[{i}]", root, depth + 1, budget))
        return values
    if kind == "integer":
        return _spent(budget, int(schema.get("minimum", 0)) + _pick(seed, 100))
    if kind == "number":
        return _spent(budget, float(schema.get("minimum", 0)) + _pick(seed, 1000) / 10)
    if kind == "boolean":
        return _spent(budget, _pick(seed, 2) == 1)
    if kind == "null":
        return _spent(budget, None)
    text = "sim-" + hashlib.blake2b(seed.encode(), digest_size=3).hexdigest()
    low, high = min(int(schema.get("minLength", 0)), max(0, budget[0])), int(schema.get("maxLength", 1 << 30))
    return _spent(budget, (text + "x" * max(0, low - len(text)))[:high])


def _spent(budget: list[int], value: Any) -> Any:
    """``value``, its JSON text's length (about) taken from ``budget``."""
    budget[0] -= len(value) + 2 if isinstance(value, str) else 6
    return value


def _pick(seed: str, count: int) -> int:
    return int.from_bytes(hashlib.blake2b(seed.encode(), digest_size=4).digest(), "little") % count


def structured_pieces(constraint: dict[str, Any], seed: str, max_chars: int = MAX_CHARS) -> tuple[list[str], bool]:
    """The JSON text for a decoding constraint, split into simulated tokens, and whether it is
    whole: a value cut by ``max_chars`` ends with ``length``, never as a grammar's end."""
    budget = [max_chars]
    if constraint.get("json_object"):
        value: Any = {"answer": example({"type": "string"}, seed, budget=budget)}
    else:
        schema = constraint.get("json")
        value = example(json.loads(schema) if isinstance(schema, str) else dict(schema or {}), seed, budget=budget)
    text = json.dumps(value, ensure_ascii=False)
    whole = budget[0] > 0
    return [text[i:i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)], whole
