"""The simulator's structured output: a deterministic JSON value valid for a schema.

A real engine constrains sampling with a grammar; the simulator has no sampling, so
it writes one instance of the schema (the first ``anyOf`` branch, every property,
minimal arrays) and streams it a few characters per token. Covers the JSON Schema
that tool parameters and ``response_format`` use in practice: objects, arrays,
strings (``enum``, ``const``), numbers, integers, booleans, null, ``anyOf`` /
``oneOf``, local ``$ref``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

#: Characters per simulated token of JSON text.
PIECE_CHARS = 4


def example(schema: dict[str, Any], seed: str, root: dict[str, Any] | None = None, depth: int = 0) -> Any:
    """A value that validates against ``schema``; strings and numbers vary with ``seed``."""
    root = schema if root is None else root
    if depth > 16:
        return None
    if "$ref" in schema:
        target: Any = root
        for part in str(schema["$ref"]).removeprefix("#/").split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return example(target, seed, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][_pick(seed, len(schema["enum"]))]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return example({**schema[key][0], **{k: v for k, v in schema.items() if k != key}}, seed, root,
                           depth + 1)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        return {name: example(sub, f"{seed}.{name}", root, depth + 1)
                for name, sub in (schema.get("properties") or {}).items()}
    if kind == "array":
        items = schema.get("items") or {}
        count = max(1, int(schema.get("minItems", 1)))
        if "maxItems" in schema:
            count = min(count, int(schema["maxItems"]))
        return [example(items, f"{seed}[{i}]", root, depth + 1) for i in range(count)]
    if kind == "integer":
        return int(schema.get("minimum", 0)) + _pick(seed, 100)
    if kind == "number":
        return float(schema.get("minimum", 0)) + _pick(seed, 1000) / 10
    if kind == "boolean":
        return _pick(seed, 2) == 1
    if kind == "null":
        return None
    text = "sim-" + hashlib.blake2b(seed.encode(), digest_size=3).hexdigest()
    low, high = int(schema.get("minLength", 0)), int(schema.get("maxLength", 1 << 30))
    return (text + "x" * max(0, low - len(text)))[:high]


def _pick(seed: str, count: int) -> int:
    return int.from_bytes(hashlib.blake2b(seed.encode(), digest_size=4).digest(), "little") % count


def structured_pieces(constraint: dict[str, Any], seed: str) -> list[str]:
    """The JSON text for a decoding constraint, split into simulated tokens."""
    if constraint.get("json_object"):
        value: Any = {"answer": example({"type": "string"}, seed)}
    else:
        schema = constraint.get("json")
        value = example(json.loads(schema) if isinstance(schema, str) else dict(schema or {}), seed)
    text = json.dumps(value, ensure_ascii=False)
    return [text[i:i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)]
