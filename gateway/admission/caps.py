"""Request caps beyond the wire schema: each a clear 400, checked before any work starts."""

from __future__ import annotations

import orjson

from gateway.config import GatewaySettings
from gateway.surfaces.openai import ChatCompletionRequest, CompletionRequest, prompts_chars
from sluice.errors import InvalidRequest


def prompt_chars(req: ChatCompletionRequest | CompletionRequest) -> int:
    if isinstance(req, CompletionRequest):
        return prompts_chars(req.prompts())
    total = 0
    for message in req.messages:
        if isinstance(message.content, str):
            total += len(message.content)
        elif message.content:
            total += sum(len(str(part.get("text", ""))) for part in message.content)
        for call in message.tool_calls or ():
            total += len(call.function.arguments)
    # Tool definitions reach the prompt too (through the chat template).
    total += sum(len(orjson.dumps(tool.model_dump(exclude_none=True))) for tool in req.tools or ())
    return total


def check_caps(req: ChatCompletionRequest | CompletionRequest, s: GatewaySettings) -> int:
    """Refuse a request past the gateway's caps; returns its prompt's characters, counted once
    for :func:`token_estimate` and :func:`queue_cost` (a chat's tools are serialized to count
    them: three times per request, before)."""
    refused = req.refusal()
    if refused is not None:
        raise InvalidRequest(f"{refused[0]}: {refused[1]}", param=refused[0])
    if isinstance(req, ChatCompletionRequest) and len(req.messages) > s.max_messages:
        raise InvalidRequest(f"at most {s.max_messages} messages per request", param="messages")
    chars = prompt_chars(req)
    if chars > s.max_prompt_chars:
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        raise InvalidRequest(f"the prompt has {chars} characters; the limit is {s.max_prompt_chars}",
                             param=param, code="context_length_exceeded")
    limit = req.token_limit()
    if limit is not None and limit > s.max_tokens_cap:
        param = "max_completion_tokens" if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens else "max_tokens"
        raise InvalidRequest(f"{param} is at most {s.max_tokens_cap}", param=param)
    if req.n > s.max_n:
        raise InvalidRequest(f"n is at most {s.max_n}", param="n")
    if generations(req) > s.max_generations:
        param = "prompt" if isinstance(req, CompletionRequest) and len(req.prompts()) > 1 else "n"
        raise InvalidRequest(
            f"this request asks for {generations(req)} generations (prompts x n); the limit is "
            f"{s.max_generations}", param=param)
    stops = req.stop_list()
    if len(stops) > s.max_stop:
        raise InvalidRequest(f"at most {s.max_stop} stop sequences", param="stop")
    if any(len(stop) > s.max_stop_chars or not stop for stop in stops):
        raise InvalidRequest(f"stop sequences must be 1-{s.max_stop_chars} characters", param="stop")
    return chars


def generations(req: ChatCompletionRequest | CompletionRequest) -> int:
    """Engine requests this request makes: n per prompt."""
    return req.n * (len(req.prompts()) if isinstance(req, CompletionRequest) else 1)


def token_estimate(req: ChatCompletionRequest | CompletionRequest, chars: int) -> int:
    """Tokens charged against a key's TPM at admission (corrected by real usage at the end);
    ``chars``: the prompt's (:func:`prompt_chars`)."""
    return chars // 4 + 1 + generations(req) * (req.token_limit() or 256)


def queue_cost(req: ChatCompletionRequest | CompletionRequest, chars: int, output_tokens: int) -> int:
    """The request's charge to its tenant's fair share of the queue, until its real usage
    corrects it: each generation's output at its max_tokens, but at most ``output_tokens``.
    (Charged at its declared max_tokens, a tenant sending 32768 got 1 of the first 10 grants
    against one that omitted it, for equal real work.)"""
    return chars // 4 + 1 + generations(req) * min(req.token_limit() or output_tokens, output_tokens)
