"""The prompt's token ids at the gateway, for the precise prefix index.

The precise index names blocks by the token ids the engine will see
(:mod:`sluice.prefix_tokens`), so the gateway tokenizes each prompt exactly as the worker
does: the same tokenizer folder, the same chat template, the same function
(:func:`engine_worker.engines.prompts.prompt_token_ids`). The other way, asking the worker
to tokenize, costs the gateway an HTTP round trip per request and the worker the same
tokenization; ``python -m loadtest.gpu.tokenize_cost`` measures both (README-ready figures in
the report of the change that brought this module).

A prompt the tokenizer or template refuses routes with no blocks: the worker answers it
with the 400 it deserves. A prompt it takes travels to the worker as its ids too, with the
tokenizer's digest (``gateway_prompt_ids``, ``gateway_tokenizer``), so a vLLM worker with
the same tokenizer does not tokenize it again (engine_worker/engines/prompts.py ``PromptIds``).
A chat template's text is tokenized piece by piece, the pieces other prompts had
remembered (gateway/admission/token_pieces.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

from engine_worker.engines.prompts import prompt_token_ids, tokenizer_digest
from engine_worker.protocol import GenerateRequest
from gateway.admission.token_pieces import PieceEncoder
from sluice.errors import InvalidRequest

log = logging.getLogger("sluice.gateway.prefix")

#: The payload fields that decide the prompt's token ids.
_PROMPT_FIELDS = ("messages", "prompt", "prompt_token_ids", "tools", "tool_mode")


@dataclass(frozen=True, slots=True)
class _PromptFields:
    """What of a GenerateRequest decides its prompt's token ids."""

    messages: list[dict[str, Any]] | None
    prompt: str | None
    prompt_token_ids: list[int] | None
    tools: list[dict[str, Any]] | None
    tool_mode: str | dict[str, str] | None


@contextmanager
def _tokenizers_only() -> Iterator[None]:
    """transformers imported as where torch is not installed, unless something in this process
    imported either already: a gateway only tokenizes, and ``AutoTokenizer`` reaches torch
    through the model's configuration (``transformers.generation``). Measured with the default
    model: 148 MB of resident memory against 481, loaded in 1.3 s against 3.1, the same class,
    digest and ids. A ``None`` in ``sys.modules`` makes ``importlib.util.find_spec`` answer
    None, so transformers' (cached) check finds no torch; the entry goes once transformers is
    in, so anything else of the process may still import torch."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        yield
        return
    advisory = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # not "PyTorch was not found" in our log
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import transformers  # noqa: F401 - decides, once, that there is no torch
        yield
    finally:
        del sys.modules["torch"]
        if advisory is None:
            del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advisory


class PromptTokenizer:
    """One model folder's tokenizer, loaded once per gateway process (without torch)."""

    def __init__(self, folder: str) -> None:
        with _tokenizers_only():
            from transformers import AutoTokenizer

            self.folder = folder
            self._tokenizer = AutoTokenizer.from_pretrained(folder)
        #: Sent with a prompt's ids: a worker takes them only if its tokenizer has this digest.
        self.digest = tokenizer_digest(self._tokenizer)
        self._pieces = PieceEncoder.of(self._tokenizer)

    def __repr__(self) -> str:
        return f"PromptTokenizer({self.folder}, digest={self.digest}, {self._pieces!r})"

    async def ids(self, payload: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the worker will compute them (resumed tokens excluded:
        they are not part of the shared prefix); None if the tokenizer refuses it. A prompt
        of more than :data:`APART_CHARS` characters is tokenized on a thread, the GIL
        released, so the event loop serves the process's other streams meanwhile."""
        request = _fields(payload)
        pieces = self._pieces
        if _chars(request) <= APART_CHARS:
            return self._ids(request, None if pieces is None else pieces.encode)
        if pieces is None:
            return await asyncio.to_thread(self._ids, request, None)
        learned: list[tuple[str, list[int]]] = []

        def encode(text: str) -> list[int]:
            ids, new = pieces.encode_apart(text)
            learned.extend(new)
            return ids

        ids = await asyncio.to_thread(self._ids, request, encode)
        pieces.remember(learned)  # here, on the loop's thread, which alone changes them
        return ids

    def ids_now(self, payload: dict[str, Any]) -> list[int] | None:
        """:meth:`ids` in the caller's thread, whatever the prompt's size (a benchmark's)."""
        return self._ids(_fields(payload), None if self._pieces is None else self._pieces.encode)

    def _ids(self, request: _PromptFields, encode: Callable[[str], list[int]] | None) -> list[int] | None:
        try:
            return prompt_token_ids(self._tokenizer, cast(GenerateRequest, request), encode)
        except InvalidRequest as exc:
            log.debug("no precise prefix for this prompt: %s", exc)
            return None


#: Prompts of more characters than this are tokenized apart from the event loop. The
#: tokenizer costs about 0.6 µs a character (here, the default model's): 600 ms of the loop for
#: a 1M-character prompt, which every other stream of the process waited; handing one to a
#: thread costs about 0.1 ms.
APART_CHARS = 32_768


def _fields(payload: dict[str, Any]) -> _PromptFields:
    # The few fields prompt_token_ids reads; GenerateRequest.model_construct cost a quarter
    # of a short prompt's tokenizing (pydantic inspects every default factory's signature).
    return _PromptFields(**{k: payload.get(k) for k in _PROMPT_FIELDS})


def _chars(request: _PromptFields) -> int:
    """About how many characters the prompt has (its messages' text, or its text prompt)."""
    if request.prompt is not None:
        return len(request.prompt)
    total = 0
    for message in request.messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(str(part.get("text", ""))) for part in content if isinstance(part, dict))
    return total
