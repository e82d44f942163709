"""Turning a generate request into prompt token ids, shared by the real engines."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any

from engine_worker.protocol import GenerateRequest
from sluice.errors import InvalidRequest
from sluice.prefix import text_content

log = logging.getLogger("sluice.worker.prompts")


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages for a chat template: content as text, every other field intact
    (an assistant's ``tool_calls``, a tool answer's ``tool_call_id``, ``name``), with
    tool-call arguments parsed, as Hugging Face templates expect them."""
    rendered = []
    for m in messages:
        message = {**m, "role": str(m.get("role", "user")), "content": text_content(m.get("content"))}
        if m.get("tool_calls"):
            message["tool_calls"] = [_template_call(call) for call in m["tool_calls"]]
        rendered.append(message)
    return rendered


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    try:
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        pass  # a template gets the string as sent
    return {**call, "function": function}


def template_messages(tokenizer: Any, request: GenerateRequest) -> list[dict[str, Any]]:
    """:func:`chat_messages`, plus what a template that knows no tools would drop.

    A template that never mentions ``tools`` / ``tool_calls`` (SmolLM2's, say) would
    show the model neither the functions it may call nor the calls it made earlier;
    those are then written into the conversation as text, so nothing is lost silently.
    """
    messages = chat_messages(request.messages or [])
    source = str(getattr(tokenizer, "chat_template", None) or "")
    if request.tools and request.tool_mode != "none" and "tools" not in source:
        listing = json.dumps([t.get("function") for t in request.tools], ensure_ascii=False)
        note = f"You can call these functions (JSON schemas): {listing}"
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{note}".strip()}
        else:
            messages.insert(0, {"role": "system", "content": note})
    if "tool_calls" not in source:
        for message in messages:
            calls = message.pop("tool_calls", None)
            if calls:
                written = json.dumps([c.get("function") for c in calls], ensure_ascii=False)
                message["content"] = f"{message['content']}\n{written}".strip()
    return messages


def as_token_ids(encoded: Any) -> list[int]:
    """apply_chat_template returns a list, or a BatchEncoding in newer transformers."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def prompt_token_ids(tokenizer: Any, request: GenerateRequest,
                     encode_chat: Callable[[str], list[int]] | None = None) -> list[int]:
    """The model's chat template for ``messages``, plain encoding for ``prompt``.

    ``encode_chat``: tokenizes the template's text instead of the tokenizer, with the same
    ids (the gateway's :class:`gateway.admission.token_pieces.PieceEncoder`).

    A template that refuses the conversation (``raise_exception``: roles that do not
    alternate, say) or a tokenizer that refuses the text is the client's error: a 400
    that no other worker is tried for, not an engine failure.
    """
    from jinja2 import TemplateError

    param = "messages" if request.messages is not None else "prompt"
    try:
        if request.messages is not None:
            rendered = tokenizer.apply_chat_template(template_messages(tokenizer, request), tools=request.tools,
                                                     add_generation_prompt=True, tokenize=encode_chat is None)
            return as_token_ids(rendered) if encode_chat is None else encode_chat(rendered)
        if request.prompt_token_ids is not None:
            return checked_ids(request.prompt_token_ids, len(tokenizer))
        return as_token_ids(tokenizer.encode(request.prompt or ""))
    except TemplateError as exc:
        raise InvalidRequest(f"the model's chat template refused these messages: {exc}", param=param) from None
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"the tokenizer refused this input: {exc}", param=param) from None


def tokenizer_digest(tokenizer: Any) -> str:
    """What decides a prompt's token ids, as 16 hex digits: the tokenizer's whole definition
    (a fast tokenizer's JSON: vocabulary, merges, normalizer, added tokens), its special
    tokens and its chat template. Two tokenizers with one digest turn every request into
    the same ids, so a worker may take a gateway's ids for a prompt (:class:`PromptIds`)."""
    digest = hashlib.blake2b(digest_size=8)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    digest.update(definition.encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    digest.update(json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True, default=str).encode())
    return digest.hexdigest()


class PromptIds:
    """A worker's prompt token ids: the gateway's, when it sent them from a tokenizer with
    this worker's digest, else the worker's own (:func:`prompt_token_ids`).

    With the precise prefix index the gateway has already run the chat template and the
    tokenizer on the prompt (gateway/admission/prompt_tokens.py, the same function); taking
    its ids saves the worker's front end that work on every request: a few milliseconds of
    one busy event loop per 1,500-word prompt (H200 fleet, README "Cache routing's knobs
    at 8B": 85-100 ms between gateway and engine in the slow tenth). A gateway whose
    tokenizer differs is told once in the log, and its ids are not used (its precise index
    is then wrong too).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.digest = tokenizer_digest(tokenizer)
        #: Prompts whose ids came from the gateway.
        self.taken = 0
        self._warned = False

    def __repr__(self) -> str:
        return f"PromptIds(digest={self.digest}, taken={self.taken})"

    def __call__(self, request: GenerateRequest) -> list[int]:
        sent = request.gateway_prompt_ids
        if sent is not None and request.gateway_tokenizer == self.digest:
            self.taken += 1
            return checked_ids(sent, len(self._tokenizer))
        if sent is not None and not self._warned:
            self._warned = True
            log.warning("a gateway sent prompt ids from tokenizer %s, this worker's is %s: tokenizing here "
                        "(set the gateway's SLUICE_GATEWAY_TOKENIZER to this worker's model folder)",
                        request.gateway_tokenizer, self.digest)
        return prompt_token_ids(self._tokenizer, request)


def checked_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> list[int]:
    """Token-id prompts are the client's ids: each must name a token of this model."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{param}: token id {bad} is outside this model's vocabulary (0..{vocab_size - 1})",
                             param=param)
    return list(ids)


def checked_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """``logit_bias`` with int keys, each a token of this model."""
    if not bias:
        return None
    out = {int(k): float(v) for k, v in bias.items()}
    bad = next((i for i in out if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"logit_bias: token id {bad} is outside this model's vocabulary "
                             f"(0..{vocab_size - 1})", param="logit_bias")
    return out


def echo_text(tokenizer: Any, request: GenerateRequest, prompt_ids: list[int]) -> str | None:
    """The prompt as text, for ``echo``; only on a fresh (not resumed) generation."""
    if not request.echo or request.resume_token_ids:
        return None
    return request.prompt if request.prompt is not None else str(tokenizer.decode(prompt_ids))


def completion_budget(request: GenerateRequest, prompt_len: int, context_len: int) -> int:
    """``max_tokens`` checked against the context; the whole remaining room when unset."""
    room = context_len - prompt_len
    param = "messages" if request.messages is not None else "prompt"
    if room < 1:
        raise InvalidRequest(
            f"the prompt is {prompt_len} tokens; this model's context is {context_len} tokens",
            param=param, code="context_length_exceeded",
        )
    if request.max_tokens is not None and request.max_tokens > room:
        raise InvalidRequest(
            f"max_tokens={request.max_tokens} plus the {prompt_len}-token prompt exceeds this "
            f"model's context of {context_len} tokens",
            param="max_tokens", code="context_length_exceeded",
        )
    return request.max_tokens or room
