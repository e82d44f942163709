"""A request's body: read within its byte limit, its JSON's shape bounded (depth, arrays and
objects), validated into its wire model, and a failure told as the client's 400 (the field
the client wrote, not pydantic's union branch tags).

>>> req, raw = await parse_body(request, ChatCompletionRequest, settings.max_body_bytes)
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gateway.admission.queue import ClientGone
from gateway.context import headers_of
from sluice.errors import BodyTooLarge, InvalidRequest

M = TypeVar("M", bound=BaseModel)
#: Past this much, an oversized body is no longer drained before the 413.
_DRAIN_LIMIT = 64 * 1024 * 1024


async def _read_body(request: Request, limit: int) -> bytes:
    declared = headers_of(request).get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > _DRAIN_LIMIT:
        raise _too_large(limit)
    # Straight from ``receive``: Starlette's ``request.stream()`` is an async generator
    # around the same loop, a frame and a few µs more per request.
    chunks: list[bytes] = []
    size = 0
    receive = request.receive
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":  # it left while sending its body: a 499, not an error of ours
            raise ClientGone("the client disconnected while sending its request body")
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > _DRAIN_LIMIT:
            break
    if size > limit:
        raise _too_large(limit)
    return b"".join(chunks)


def _too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"request body exceeds the {limit}-byte limit")


async def parse_body(request: Request, model: type[M], limit: int) -> tuple[M, bytes]:
    """The request's body, read within ``limit`` bytes, as ``model``; a 400 in the client's
    shape when it is no JSON object, nests too deep, holds too many arrays and objects, or
    does not validate."""
    body = await _read_body(request, limit)
    # Each array and object opens with a bracket (brackets in strings only count extra): a
    # body with few of them needs no closer look.
    brackets = body.count(b"{") + body.count(b"[")
    if brackets > MAX_JSON_CONTAINERS and _containers(body) > MAX_JSON_CONTAINERS:
        raise InvalidRequest(f"request body holds more than {MAX_JSON_CONTAINERS} arrays and objects")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidRequest("request body is not valid JSON") from None
    if not isinstance(obj, dict):
        raise InvalidRequest("request body must be a JSON object")
    if brackets > MAX_JSON_DEPTH and _depth(obj) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return model.model_validate(obj), body
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


#: Deeper JSON is refused: orjson refuses to write what it read past its own limit, and no
#: OpenAI request (tool schemas included) comes near this.
MAX_JSON_DEPTH = 64
#: More arrays and objects than this in one body are refused before it is parsed. Parsing
#: and validating cost the gateway's event loop about 3 µs each: a 2 MB completion body
#: whose prompt was 500,000 one-token lists held a gateway's loop 1.4 s (and every stream
#: it served), to answer 400 for the prompt's size in the end; 100,000 content parts of one
#: message were served, 0.44 s of the loop. No request of the APIs served comes near this
#: (512 messages, 2,048 inputs, a few thousand in the largest tool schemas).
MAX_JSON_CONTAINERS = 32_768
#: A JSON string, escapes and all (unrolled: ~30 ms for 4 MiB of text, in C).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def _containers(body: bytes) -> int:
    """The arrays and objects of a JSON text: its brackets outside its strings."""
    bare = _STRING.sub(b"", body)
    return bare.count(b"{") + bare.count(b"[")


def _depth(obj: object) -> int:
    """Nesting depth of parsed JSON (up to ``MAX_JSON_DEPTH + 1``), a level at a time: a
    container's scalars are passed over in C (``set(map(type, ...))``), only its arrays and
    objects in Python, and those are at most ``MAX_JSON_CONTAINERS``. A scalar counts as a
    level, as an array or object does. (Node by node, a prompt of 250,000 token ids took
    150 ms here, 6 ms now.)"""
    depth, level = 1, [obj]  # the level of ``obj``; each value one below its container's
    while level and depth <= MAX_JSON_DEPTH:
        nested: list[object] = []
        deeper = False
        for node in level:
            values = node.values() if type(node) is dict else node  # type: ignore[attr-defined]
            if not values:
                continue
            deeper = True
            kinds = set(map(type, values))  # type: ignore[call-overload]
            if list in kinds or dict in kinds:
                nested.extend(v for v in values if type(v) is list or type(v) is dict)  # type: ignore[attr-defined]
        depth += deeper
        level = nested
    return depth


def validation_error(errors: Any) -> InvalidRequest:
    first = _telling_error(errors)
    loc = [str(p) for p in _untagged(first) if p != "body"]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        # A check across fields (a model validator) names its field first: "best_of: ...".
        named = _FIELD_FIRST.match(msg)
        return InvalidRequest(msg, param=named.group(1) if named else None)
    return InvalidRequest(f"{param}: {msg}", param=param)


_FIELD_FIRST = re.compile(r"^([a-z_]+): ")


def _is_branch_tag(part: object) -> bool:
    """Whether a location part names a union's branch (``str``, ``list[str]``,
    ``list[constrained-int]``, a model's class name) rather than a field or an index: a
    client never wrote it, so it is no part of ``param``."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper())


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "none", "any"})


def _telling_error(errors: Any) -> Any:
    """The error to report. A value that fits no branch of a union gets one error per branch,
    the first branch's first. Among the errors of the first one's field, prefer one past the
    type check (a negative token id: "greater than or equal to 0", not the string branch's
    "should be a valid string"), then the deepest (a list of the wrong items: the item)."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if _untagged(first) == loc:
        return first  # no union branch in its location
    tag = next(i for i, part in enumerate(loc) if _is_branch_tag(part))
    field = loc[:tag]

    def telling(error: Any) -> tuple[bool, int]:
        return not str(error.get("type", "")).endswith(_TYPE_MISMATCH), len(_untagged(error))

    same = [e for e in errors if _untagged(e)[:len(field)] == field]
    return max(same, key=telling)  # the first of the best: max keeps the earliest


_TYPE_MISMATCH = ("_type", "_parsing")


def _untagged(error: Any) -> tuple[object, ...]:
    """An error's location without union branch tags; an unexpected key (its last part) is
    the client's own, whatever it looks like."""
    loc = tuple(error.get("loc", ()))
    keep = loc[-1:] if error.get("type") == "extra_forbidden" else ()
    return tuple(p for p in loc[:len(loc) - len(keep)] if not _is_branch_tag(p)) + keep
