"""Generating on an OpenAI-compatible engine server (``vllm serve``, ``trtllm-serve``,
SGLang, TGI): a :class:`GenerateRequest` becomes the server's request, its server-sent
chunks become :class:`Delta` s. One way to do it, used from two places:

- the ``openai`` worker (engine_worker/engines/openai_upstream.py) relays for gateways;
- a gateway calls the server itself when that worker registered with ``--relay direct``
  (gateway/relay/direct.py): the worker's record then carries a relay URL (:func:`relay_url`)
  instead of its own, and the translation runs in the gateway, one process fewer per chunk.

A server that returns token ids (vLLM) gets ``return_token_ids`` and resumes a migrated
stream token-exactly: prompt ids from its own ``/tokenize`` + the ids already sent, as a
token prompt to ``/v1/completions``.

Prefill/decode disaggregation (gateway/relay/disagg.py) through vLLM servers started with a
KV connector: a request's ``kv_transfer_params`` go to the server in its body. A prefill hop
(``do_remote_decode``) is asked for a whole answer, not a stream, because vLLM returns the
parameters its decode server needs (where the KV is) in whole answers only, as its own
disaggregation proxy asks for them; they come back on the hop's one delta.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import orjson

from engine_worker.protocol import Delta, GenerateRequest, Usage, stop_string
from sluice.errors import (
    Conflict,
    InvalidRequest,
    ModelNotFound,
    SluiceError,
    Unavailable,
    UpstreamFailed,
)
from sluice.http1 import Http1Pool, Http1Response, drain
from sluice.lines import LineCutter

log = logging.getLogger("sluice.engine_server")

#: A worker record's URL with this prefix names an engine server that gateways call directly.
RELAY_SCHEME = "openai+"

T = TypeVar("T")


def relay_url(url: str, model: str, token_ids: bool) -> str:
    """The registry URL of ``--relay direct``: ``openai+http://host:port?model=NAME&ids=1``."""
    return f"{RELAY_SCHEME}{url.rstrip('/')}?model={quote(model, safe='')}&ids={int(token_ids)}"


def parse_relay_url(url: str) -> tuple[str, str, bool]:
    """(server URL, its model name, whether it returns token ids) from :func:`relay_url`'s form."""
    parts = urlsplit(url.removeprefix(RELAY_SCHEME))
    query = parse_qs(parts.query)
    return parts._replace(query="").geturl(), query["model"][0], query.get("ids", ["0"])[0] == "1"


def upstream_error(status: int, body: bytes) -> SluiceError:
    """The server's refusal in Sluice's error tree: its 4xx are the client's (not retried on
    other workers), its 5xx and 429 are this worker's (the gateway tries another)."""
    try:
        err = orjson.loads(body)
        err = err.get("error", err) if isinstance(err, dict) else {}
        message = str(err.get("message") or err.get("detail") or "")[:500] if isinstance(err, dict) else ""
    except orjson.JSONDecodeError:
        message = ""
    message = message or f"upstream server answered {status}"
    if status == 404:
        return ModelNotFound(f"upstream server: {message}")
    if status in (400, 422):
        code = "context_length_exceeded" if "context length" in message.lower() else None
        return InvalidRequest(f"upstream server: {message}", code=code)
    if status == 429 or status >= 500:
        return Unavailable(f"upstream server answered {status}: {message}", retry_after_s=1)
    return UpstreamFailed(f"upstream server answered {status}: {message}")


def _chat_logprobs(logprobs: Any) -> list[list[Any]] | None:
    if not isinstance(logprobs, dict) or not logprobs.get("content"):
        return None
    return [
        [e.get("token", ""), e.get("logprob", 0.0),
         [[t.get("token", ""), t.get("logprob", 0.0)] for t in e.get("top_logprobs") or ()]]
        for e in logprobs["content"]
    ]


def _text_logprobs(logprobs: Any) -> list[list[Any]] | None:
    if not isinstance(logprobs, dict) or not logprobs.get("tokens"):
        return None
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
    return [
        [token, lp if lp is not None else 0.0, sorted(([t, v] for t, v in (top or {}).items()), key=lambda x: -x[1])]
        for token, lp, top in zip(logprobs["tokens"], logprobs.get("token_logprobs") or (), tops, strict=False)
    ]


def _delta(choice: dict[str, Any], chat: bool) -> Delta:
    # Once per streamed chunk: the logprobs and the stop string are looked at only where a
    # chunk has them (most have neither).
    tool_calls = logprobs = None
    given = choice.get("logprobs")
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        tool_calls = delta.get("tool_calls") or None
        if given is not None:
            logprobs = _chat_logprobs(given)
    else:
        text = choice.get("text") or ""
        if given is not None:
            logprobs = _text_logprobs(given)
    finish = choice.get("finish_reason")
    return Delta(choice.get("token_ids") or [], text, finish, None, logprobs, tool_calls,
                 stop_sequence=None if finish is None else stop_string(finish, choice.get("stop_reason")))


def _tool_choice(mode: str | dict[str, str] | None) -> str | dict[str, Any] | None:
    """The request's tool mode as OpenAI's ``tool_choice``."""
    if isinstance(mode, dict):
        return {"type": "function", "function": {"name": mode.get("name", "")}}
    return mode


def _response_format(constraint: dict[str, Any]) -> dict[str, Any]:
    """A decoding constraint (``{"json": schema}``, ``{"json_object": true}``) as OpenAI's
    ``response_format``."""
    if "json" in constraint:
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": constraint["json"]}}
    return {"type": "json_object"}


def _usage(usage: dict[str, Any]) -> Usage:
    details = usage.get("prompt_tokens_details") or {}
    return Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                 int(details.get("cached_tokens") or 0))


class EngineServer:
    """One OpenAI-compatible server: generations as deltas.

    ``http`` serves the small JSON calls (``/tokenize``, ``/detokenize``) and ``https://``
    streams; ``streams`` (the lean client) the plain-HTTP streams, where every token crosses it.
    """

    def __init__(
        self, url: str, model: str, *, token_ids: bool, http: httpx.AsyncClient, streams: Http1Pool,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        #: Whether the server returns token ids and takes token prompts (vLLM).
        self.token_ids = token_ids
        #: Whether ``priority`` is passed on; cleared when the server refuses it.
        self.priority = True
        self._http = http
        self._streams = streams if self.url.startswith("http://") else None
        self._headers = {"content-type": "application/json",
                         **({"authorization": f"Bearer {api_key}"} if api_key else {})}

    def _sampling(self, request: GenerateRequest, chat: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                                "max_tokens": request.max_tokens}
        for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
            value = getattr(request, name)
            if value is not None:
                body[name] = value
        if request.stop:
            body["stop"] = request.stop
        if request.logprobs is not None:
            if chat:
                body["logprobs"] = True
                body["top_logprobs"] = request.logprobs
            else:
                body["logprobs"] = request.logprobs
        # Extensions most servers share (vLLM, SGLang, trtllm-serve); sent only when used.
        if request.top_k is not None:
            body["top_k"] = request.top_k
        if request.repetition_penalty is not None:
            body["repetition_penalty"] = request.repetition_penalty
        if request.ignore_eos:
            body["ignore_eos"] = True
        if request.min_tokens:
            body["min_tokens"] = request.min_tokens
        if self.token_ids:
            body["return_token_ids"] = True
        if self.priority and request.priority:
            body["priority"] = request.priority
        if request.kv_transfer_params is not None:
            body["kv_transfer_params"] = request.kv_transfer_params
        # What OpenAI's API names (min_p: vLLM's, SGLang's): sent as asked, so a server that
        # cannot honour one refuses it (its 400 is the client's), never dropped on the way.
        if request.min_p is not None:
            body["min_p"] = request.min_p
        if request.logit_bias:
            body["logit_bias"] = request.logit_bias
        # A prefill hop makes one token for its KV: the tools stay (they are in the prompt,
        # which both hops must share), the constraints on its answer go (a one-token answer
        # cannot be a call, nor the schema's JSON, and some servers refuse such an answer).
        prefill_hop = bool((request.kv_transfer_params or {}).get("do_remote_decode"))
        if request.structured is not None and not prefill_hop:
            body["response_format"] = _response_format(request.structured)
        if chat and request.tools:
            body["tools"] = request.tools
            body["tool_choice"] = "none" if prefill_hop else _tool_choice(request.tool_mode)
            if not request.parallel_tool_calls:
                body["parallel_tool_calls"] = False
        return body

    async def _post_json(self, path: str, body: dict[str, Any]) -> Any:
        try:
            response = await self._http.post(self.url + path, content=orjson.dumps(body), headers=self._headers)
        except httpx.HTTPError as exc:
            raise Unavailable(f"upstream server unreachable: {type(exc).__name__}", retry_after_s=1) from None
        if response.status_code != 200:
            raise upstream_error(response.status_code, response.content)
        return orjson.loads(response.content)

    async def prompt_tokens(self, request: GenerateRequest) -> int:
        """The prompt's size as this server counts it: its ``/tokenize``, its chat template
        (vLLM's; a server without token ids has none)."""
        if not self.token_ids:
            raise InvalidRequest(f"model {request.model!r} is served by a server that cannot count tokens "
                                 "(it has no /tokenize)", code="count_unsupported")
        return len(await self._prompt_ids(request))

    async def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids as this server makes them: its ``/tokenize`` with its chat
        template, which sees the tools too (with "none" as well), or the ids given."""
        if request.messages is not None:
            body: dict[str, Any] = {"model": self.model, "messages": request.messages, "add_generation_prompt": True}
            if request.tools:
                body["tools"] = request.tools
        elif request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        else:
            body = {"model": self.model, "prompt": request.prompt or ""}
        return [int(i) for i in (await self._post_json("/tokenize", body))["tokens"]]

    async def _resume_body(self, request: GenerateRequest) -> tuple[str, dict[str, Any], str]:
        """A migrated stream: the server's own prompt ids + the ids already sent, as a token
        prompt, and the text the previous worker held back."""
        if not self.token_ids:
            raise Conflict("this worker's upstream server does not return token ids, so a stream cannot "
                           "continue on it exactly", code="resume_unsupported")
        if request.tools and request.tool_mode != "none":
            # It goes on as a token prompt to /v1/completions, where the server parses no tool calls.
            raise Conflict("a stream that may call tools cannot continue exactly on an OpenAI-compatible "
                           "server", code="resume_unsupported")
        body = self._sampling(request, chat=False)
        body["prompt"] = await self._prompt_ids(request) + list(request.resume_token_ids)
        held = ""
        if request.resume_token_ids and request.resume_text_chars is not None:
            text = await self._post_json("/detokenize", {"model": self.model, "tokens": request.resume_token_ids})
            held = str(text.get("prompt", ""))[request.resume_text_chars:]
        return "/v1/completions", body, held

    def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        """Deltas until the finishing one (which carries usage); closing the iterator early
        closes the connection, which aborts the request on the server."""
        return self._generate(request, _same)

    def lines(self, request: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """The same stream as the lines a worker would send (:meth:`Delta.line`), for a
        gateway's direct relay: one generator per stream, none more to convert each delta."""
        return self._generate(request, Delta.line)

    async def _send(self, path: str, body: dict[str, Any]) -> Http1Response | httpx.Response:
        if self._streams is not None:
            return await self._streams.post(self.url, path, orjson.dumps(body), self._headers)
        request = self._http.build_request("POST", self.url + path, content=orjson.dumps(body),
                                           headers=self._headers)
        return await self._http.send(request, stream=True)

    async def _open(self, path: str, body: dict[str, Any], *, whole: bool = False) -> Http1Response | httpx.Response:
        """Send the request; a server that refuses ``priority`` is asked once more without it.
        ``whole``: a whole answer, whose head comes after its generation, so a connection that
        breaks before the head broke with the request in it (a lost server, as a stream's
        broken body is), where a stream's head comes at once."""
        while True:
            try:
                response = await self._send(path, body)
            except httpx.HTTPError as exc:
                if whole and not isinstance(exc, httpx.ConnectError):
                    raise UpstreamFailed(f"the upstream server broke off: {type(exc).__name__}",
                                         code="worker_lost") from None
                raise Unavailable(f"upstream server unreachable: {type(exc).__name__}", retry_after_s=1) from None
            if response.status_code == 200:
                return response
            detail = await response.aread()
            await response.aclose()
            if response.status_code == 400 and "priority" in body and b"priority" in detail:
                log.warning("upstream %s refuses 'priority' (start vLLM with --scheduling-policy priority); "
                            "no longer passed on", self.url)
                self.priority = False
                body = {k: v for k, v in body.items() if k != "priority"}
                continue
            raise upstream_error(response.status_code, detail)

    async def _echo(self, request: GenerateRequest) -> str:
        """A completion's prompt as text, for ``echo``: as given, or a token-id prompt detokenized
        by the server (one that cannot is refused: the client asked for the prompt back)."""
        if request.prompt is not None:
            return request.prompt
        if not self.token_ids:
            raise InvalidRequest(f"model {request.model!r} is served by a server that cannot detokenize, so a "
                                 "token-id prompt cannot be echoed", param="echo")
        detokenized = await self._post_json("/detokenize", {"model": self.model, "tokens": request.prompt_token_ids})
        return str(detokenized.get("prompt", ""))

    async def _whole(self, path: str, body: dict[str, Any], *, chat: bool) -> Delta:
        """One whole answer as one finishing delta, with the ``kv_transfer_params`` it returned."""
        body = {**{k: v for k, v in body.items() if k != "stream_options"}, "stream": False}
        response = await self._open(path, body, whole=True)
        try:
            answer = orjson.loads(await response.aread())
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            raise UpstreamFailed(f"the upstream answer broke: {type(exc).__name__}", code="worker_lost") from None
        finally:
            await response.aclose()
        choices = answer.get("choices") if isinstance(answer, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        finish = choice.get("finish_reason")
        if not finish:  # as a stream that ends before it finished
            raise UpstreamFailed("the upstream server's answer has no finished choice", code="worker_lost")
        message = (choice.get("message") or {}) if chat else {}
        text = message.get("content") if chat else choice.get("text")
        # Whole calls, as deltas of the streamed shape: each call's index is its place.
        calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or ())] or None
        return Delta(choice.get("token_ids") or [], text or "", finish,
                     _usage(answer["usage"]) if answer.get("usage") else None, tool_calls=calls,
                     stop_sequence=stop_string(finish, choice.get("stop_reason")),
                     kv_transfer_params=answer.get("kv_transfer_params"))

    async def _generate(self, request: GenerateRequest, emit: Callable[[Delta], T]) -> AsyncIterator[T]:
        """Server-sent chunks as deltas, each passed through ``emit``; the finishing delta
        waits for the end of the stream, and carries the last ``usage`` seen. Servers put
        usage in a chunk of its own after the finishing one (OpenAI's ``include_usage``), in
        the finishing chunk itself, or as running totals in every chunk (vLLM's
        ``continuous_usage_stats``): read before the finishing delta existed, it was dropped
        (prompt tokens 0, the key's TPM settled low).

        One generator does it all (the request, the parsing, the held-back text of a
        migrated stream, the check that it finished): every generator between the socket
        and the client is one more step per relayed chunk (loadtest/peers/README.md)."""
        held = ""
        resumed = bool(request.resume_token_ids or request.resume_text_chars)
        if resumed:
            path, body, held = await self._resume_body(request)
        elif request.messages is not None:
            path, body = "/v1/chat/completions", {**self._sampling(request, chat=True), "messages": request.messages}
        else:
            prompt = request.prompt if request.prompt is not None else request.prompt_token_ids or ""
            path, body = "/v1/completions", {**self._sampling(request, chat=False), "prompt": prompt}
        chat = path.endswith("chat/completions")
        # A completion's echoed prompt leads its first delta (a migrated stream's client has it).
        echo = await self._echo(request) if request.echo and not resumed else None
        # A prefill hop: vLLM returns the decode side's parameters only in whole answers. A
        # short answer its client takes whole: one body for the server to make, not a chunk
        # per token and one for usage (a migrated stream's resumption always streams).
        if (request.kv_transfer_params or {}).get("do_remote_decode") or (request.whole and not resumed):
            whole = await self._whole(path, body, chat=chat)
            whole.echo = echo
            yield emit(whole)
            return
        response = await self._open(path, body)
        finish: Delta | None = None
        usage: Usage | None = None
        try:
            cut = LineCutter()
            chunks = response.aiter_raw()
            ended = False
            async for raw in chunks:
                for event in cut.feed(raw):
                    if not event.startswith(b"data:"):
                        continue
                    data = event[5:].strip()
                    if data == b"[DONE]":
                        # the body's end: the connection can be reused
                        await drain(response, chunks)
                        ended = True
                        break
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                        raise UpstreamFailed(f"upstream server: {str(err.get('message'))[:500]}")
                    if chunk.get("usage"):
                        usage = _usage(chunk["usage"])
                    for choice in chunk.get("choices") or ():
                        delta = _delta(choice, chat)
                        if delta.finish_reason is not None:
                            finish = delta
                        elif delta.text or delta.token_ids or delta.tool_calls:
                            if held:
                                delta.text, held = held + delta.text, ""
                            if echo is not None:
                                delta.echo, echo = echo, None
                            yield emit(delta)
                if ended:
                    break
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            raise UpstreamFailed(f"the upstream stream broke: {type(exc).__name__}", code="worker_lost") from None
        finally:
            await response.aclose()
        if finish is None:
            raise UpstreamFailed("the upstream server ended the stream before it finished", code="worker_lost")
        finish.usage = usage
        if held:
            finish.text = held + finish.text
        if echo is not None:
            finish.echo = echo
        yield emit(finish)


def _same(delta: Delta) -> Delta:
    return delta
