"""Turning a generate request into prompt token ids, shared by the real engines."""

from __future__ import annotations

from typing import Any

from engine_worker.protocol import GenerateRequest
from sluice.errors import InvalidRequest


def text_content(content: object) -> str:
    """Flatten OpenAI content parts to text (chat templates take strings)."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [
        {"role": str(m.get("role", "user")), "content": text_content(m.get("content"))}
        for m in messages
    ]


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
                    chat_messages(request.messages), add_generation_prompt=True, tokenize=True
                )
            )
        return as_token_ids(tokenizer.encode(request.prompt or ""))
    except TemplateError as exc:
        raise InvalidRequest(f"the model's chat template refused these messages: {exc}", param=param) from None
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"the tokenizer refused this input: {exc}", param=param) from None


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
