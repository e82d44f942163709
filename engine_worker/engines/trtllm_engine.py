"""TensorRT-LLM through its LLM API (PyTorch backend).

NEVER RUN ON A REAL TensorRT-LLM: it cannot be installed on our development
machines (its wheel comes from NVIDIA's own index) and they have no GPU. This
adapter is written against the documented API of TensorRT-LLM 1.x and checked
by contract tests against a stand-in module (tests/engine_worker/standins/).

What it relies on:
- ``LLM(model, kv_cache_config=KvCacheConfig(enable_block_reuse=True, ...),
  max_batch_size, max_seq_len, enable_chunked_prefill, enable_iter_perf_stats)``;
- ``llm.generate_async(inputs, sampling_params=..., streaming=True)`` returns a
  result that is async-iterable; each step exposes *cumulative*
  ``outputs[0].token_ids`` / ``.text``, which we turn into deltas;
- ``result.abort()`` cancels (finish reason ``cancelled``);
- ``llm.get_stats_async(timeout)`` yields per-iteration dicts
  (``numActiveRequests``, ``numQueuedRequests``, ``kvCacheStats``);
- ``result.cached_tokens`` (TensorRT-LLM >= 1.1; read defensively).
The chat template is applied here with the Hugging Face tokenizer, and token
ids are passed, so TensorRT-LLM adds no second BOS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from engine_worker.engines.base import EngineStats
from engine_worker.engines.prompts import completion_budget, prompt_token_ids
from engine_worker.engines.resume import ResumedText
from engine_worker.protocol import Delta, GenerateRequest, KVEvent, Usage, stop_string
from sluice.errors import InvalidRequest

log = logging.getLogger("sluice.worker.trtllm")

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "error"}


class TrtllmEngine:
    name = "trtllm"
    healthy = True

    def __init__(
        self,
        model_dir: Path,
        *,
        max_batch_size: int = 64,
        max_seq_len: int = 4096,
        kv_cache_fraction: float = 0.9,
        stats_interval_s: float = 1.0,
    ) -> None:
        self.model_dir = model_dir
        self.capacity = max_batch_size
        self.max_seq_len = max_seq_len
        self._kv_cache_fraction = kv_cache_fraction
        self._stats_interval_s = stats_interval_s
        self._llm: Any = None
        self._tokenizer: Any = None
        self._stats = EngineStats()
        self._stats_task: asyncio.Task[None] | None = None
        self.aborted = 0

    def llm_kwargs(self) -> dict[str, Any]:
        from tensorrt_llm.llmapi import KvCacheConfig

        return {
            "model": str(self.model_dir),
            "kv_cache_config": KvCacheConfig(
                enable_block_reuse=True, free_gpu_memory_fraction=self._kv_cache_fraction
            ),
            "max_batch_size": self.capacity,
            "max_seq_len": self.max_seq_len,
            "enable_chunked_prefill": True,
            "enable_iter_perf_stats": True,
        }

    async def start(self) -> None:
        from tensorrt_llm import LLM

        kwargs = self.llm_kwargs()
        log.info("starting TensorRT-LLM with %s", kwargs)
        self._llm = await asyncio.to_thread(lambda: LLM(**kwargs))
        tok = self._llm.tokenizer
        self._tokenizer = getattr(tok, "tokenizer", tok)  # TransformersTokenizer wraps the HF one
        self._stats_task = asyncio.create_task(self._poll_stats(), name="trtllm-stats")

    async def shutdown(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats_task
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)
            self._llm = None

    def take_kv_events(self) -> list[KVEvent]:
        # TensorRT-LLM's KV event API names blocks by token-id hashes too (see the vLLM engine);
        # the index is corrected from each response's cached_tokens.
        return []

    def stats(self) -> EngineStats:
        return self._stats

    def sampling_params(self, request: GenerateRequest, prompt_len: int) -> Any:
        from tensorrt_llm import SamplingParams

        if request.logprobs is not None:
            raise InvalidRequest("logprobs are not supported by the trtllm engine yet", param="logprobs")
        # Not wired to TensorRT-LLM's guided decoding / logits processors yet: refused, not dropped.
        unsupported = {
            "response_format": request.structured, "tools": request.tool_mode not in (None, "none") or None,
            "logit_bias": request.logit_bias, "min_p": request.min_p, "echo": request.echo or None,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise InvalidRequest(f"{name} is not supported by the trtllm engine yet", param=name)
        fields: dict[str, Any] = {
            # TensorRT-LLM's default is only 32 tokens: always set it.
            "max_tokens": completion_budget(request, prompt_len, self.max_seq_len),
            "n": 1,
            "detokenize": True,
        }
        if request.temperature == 0:
            fields["top_k"] = 1  # greedy is keyed on top_k in 1.0, not on temperature
        elif request.temperature is not None:
            fields["temperature"] = request.temperature
        if request.top_p is not None:
            fields["top_p"] = request.top_p
        if request.top_k is not None and "top_k" not in fields:
            fields["top_k"] = request.top_k
        if request.seed is not None:
            fields["seed"] = request.seed
        if request.stop and not request.resume_token_ids:  # a resumed one checks them itself
            fields["stop"] = list(request.stop)
        return SamplingParams(**fields)

    async def prompt_tokens(self, request: GenerateRequest) -> int:
        return len(prompt_token_ids(self._tokenizer, request))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        prompt = prompt_token_ids(self._tokenizer, request)
        full = prompt + list(request.resume_token_ids)
        params = self.sampling_params(request, len(full))
        result = self._llm.generate_async(
            {"prompt_token_ids": full}, sampling_params=params, streaming=True
        )
        seen_ids = 0
        seen_text = 0
        resumed_text = ResumedText.start(self._tokenizer, request)  # see engines/resume.py
        engine_done = False
        completion = 0
        try:
            async for step in result:
                out = step.outputs[0]
                ids = list(out.token_ids[seen_ids:])
                text = out.text[seen_text:]
                seen_ids, seen_text = len(out.token_ids), len(out.text)
                engine_done = out.finish_reason is not None
                finish = FINISH_REASONS.get(str(out.finish_reason), str(out.finish_reason)) if engine_done else None
                if resumed_text is not None:
                    ids, text, stopped = resumed_text.step(ids, engine_done)
                    finish = "stop" if stopped else finish
                completion += len(ids)
                usage = None
                if finish is not None:
                    usage = Usage(
                        prompt_tokens=len(full),
                        completion_tokens=completion,
                        cached_tokens=int(getattr(step, "cached_tokens", 0) or 0),
                    )
                if ids or text or finish:
                    stopped_by = (resumed_text.stopped_by if resumed_text is not None
                                  else getattr(out, "stop_reason", None))
                    yield Delta(ids, text, finish, usage, stop_sequence=stop_string(finish, stopped_by))
                if finish is not None:
                    return
        finally:
            if not engine_done:
                self.aborted += 1
                result.abort()

    async def _poll_stats(self) -> None:
        while True:
            try:
                async for it in self._llm.get_stats_async(timeout=self._stats_interval_s):
                    self._apply_stats(it)
            except Exception as exc:  # stats are advisory; a bad poll must not kill the worker
                log.warning("TensorRT-LLM stats poll failed: %s", exc)
            await asyncio.sleep(self._stats_interval_s)

    def _apply_stats(self, it: dict[str, Any]) -> None:
        s = self._stats
        s.running = int(it.get("numActiveRequests", s.running))
        s.waiting = int(it.get("numQueuedRequests", s.waiting))
        kv = it.get("kvCacheStats") or {}
        if kv.get("maxNumBlocks"):
            s.kv_usage = float(kv.get("usedNumBlocks", 0)) / float(kv["maxNumBlocks"])
        # reusedBlocks / missedBlocks are cumulative block counts.
        if "reusedBlocks" in kv:
            s.prefix_hits = int(kv["reusedBlocks"])
            s.prefix_queries = int(kv["reusedBlocks"]) + int(kv.get("missedBlocks", 0))
