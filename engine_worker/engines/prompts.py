"""Turning a generate request into prompt token ids, shared by the real engines."""

from __future__ import annotations

import json
from typing import Any

from engine_worker.protocol import GenerateRequest
from sluice.errors import InvalidRequest
from sluice.prefix import text_content


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


def prompt_token_ids(tokenizer: Any, request: GenerateRequest) -> list[int]:
    """The model's chat template for ``messages``, plain encoding for ``prompt``.

    A template that refuses the conversation (``raise_exception``: roles that do not
    alternate, say) or a tokenizer that refuses the text is the client's error: a 400
    that no other worker is tried for, not an engine failure.
    """
    from jinja2 import TemplateError

    param = "messages" if request.messages is not None else "prompt"
    try:
        if request.messages is not None:
            return as_token_ids(
                tokenizer.apply_chat_template(
                    template_messages(tokenizer, request), tools=request.tools,
                    add_generation_prompt=True, tokenize=True,
                )
            )
        if request.prompt_token_ids is not None:
            return checked_ids(request.prompt_token_ids, len(tokenizer))
        return as_token_ids(tokenizer.encode(request.prompt or ""))
    except TemplateError as exc:
        raise InvalidRequest(f"the model's chat template refused these messages: {exc}", param=param) from None
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"the tokenizer refused this input: {exc}", param=param) from None


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
