"""Worker settings: environment ``SLUICE_WORKER_*`` (and ``SLUICE_REDIS_URL``), or CLI flags."""

from __future__ import annotations

import json
import socket
import uuid
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import SettingsConfigDict

from sluice.roles import Role
from sluice.settings import RedisSettings
from sluice.tasks import WorkerTask


class WorkerSettings(RedisSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICE_WORKER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=0, le=65535)
    #: Serve /internal/generate on a non-loopback address without SLUICE_INTERNAL_TOKEN.
    allow_open: bool = False
    #: URL the gateways use to reach this worker; default http://host:port.
    advertise_url: str | None = None
    #: No whitespace: the prefix index keeps a block's holders as space-separated ids.
    worker_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}",
                           pattern=r"^\S+$", max_length=128)
    engine: Literal["sim", "vllm", "trtllm", "openai"] = "sim"
    #: Local Hugging Face model folder (vllm and trtllm engines).
    model: str | None = None
    #: Name clients use in the ``model`` field; default "sim", or the model folder's name.
    served_model_name: str | None = None
    #: What the engine runs (sluice/tasks.py): ``generate`` (completions, and tokenize) or
    #: ``embed`` (a pooling model: embeddings, scores, tokenize; vLLM runs the model with
    #: ``runner="pooling"``); an ``openai`` worker passes that task's routes through.
    task: WorkerTask = "generate"
    #: Prefill/decode disaggregation (sluice/roles.py): ``prefill`` or ``decode`` workers of
    #: one model are used as pairs by the gateways; ``both`` serves whole requests.
    role: Role = "both"
    #: vLLM: the KV connector, as vLLM's ``--kv-transfer-config`` JSON, e.g.
    #: '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'. Needed by prefill and decode workers.
    #: Run here: ExampleConnector (KV through files) on CPU; NixlConnector on GPUs is untested.
    vllm_kv_transfer_config: dict[str, object] | None = None
    #: sim, decode role: time to receive one prompt token's KV from the prefill worker.
    sim_kv_transfer_ms_per_token: float = Field(default=0.0, ge=0)
    heartbeat_ms: int = Field(default=1000, ge=50)
    #: On SIGTERM: stop taking requests, wait this long for in-flight ones, then exit.
    drain_timeout_s: float = Field(default=30.0, ge=0)
    sim_ttft_ms: float = Field(default=20.0, ge=0)
    sim_token_ms: float = Field(default=5.0, ge=0)
    sim_max_seqs: int = Field(default=64, ge=1)
    #: sim: prefill cost per uncached prompt token, and prompt tokens prefilled per step.
    sim_prefill_ms_per_token: float = Field(default=0.0, ge=0)
    sim_prefill_chunk: int = Field(default=512, ge=1)
    #: sim: prefix cache capacity in blocks of 64 tokens (0: no prefix cache).
    sim_cache_blocks: int = Field(default=1024, ge=0)
    #: sim: the size of its embeddings (a large one stands in for a 4,096-wide model's answers).
    sim_embed_dim: int = Field(default=64, ge=1, le=16384)
    #: sim fault injection: the first N requests fail before their first token (worker 500).
    sim_fail_first: int = Field(default=0, ge=0)
    #: sim fault injection: a prompt containing this text kills the worker process.
    sim_crash_on: str | None = None
    #: vLLM: context length (prompt + completion).
    vllm_max_model_len: int = Field(default=2048, ge=16)
    #: vLLM: sequences batched at once; also the capacity this worker advertises.
    #: Unset: 16 on CPU, 256 on a GPU.
    vllm_max_num_seqs: int | None = Field(default=None, ge=1)
    #: vLLM: KV cache size in GiB (0 lets vLLM size it from gpu_memory_utilization, as its
    #: own server does; on CPU it must be set). Unset: 0.5 on CPU, 0 on a GPU.
    vllm_kv_cache_gib: float | None = Field(default=None, ge=0)
    #: vLLM: GPUs this worker spans with tensor parallelism (``sluice up --gpus --tensor-parallel``).
    vllm_tensor_parallel_size: int = Field(default=1, ge=1)
    #: vLLM: skip graph compilation. Unset: eager on CPU (starts in ~20 s instead of
    #: ~85 s, and the compiled CPU path changed greedy answers in our runs), graphs on GPU.
    vllm_enforce_eager: bool | None = None
    #: vLLM on NVIDIA GPUs: use FlashInfer's TensorRT-LLM attention/MoE kernels (untested here).
    vllm_trtllm_kernels: bool = False
    #: vLLM: the vLLM tool-call parser (``hermes``, ``llama3_json``...) for tool_choice "auto";
    #: unset, a request that needs one is a 400.
    tool_call_parser: str | None = None
    #: Which prefix index the gateways keep (``SLUICE_PREFIX_INDEX``, shared with them):
    #: ``precise`` makes a vLLM worker publish its engine's KV-cache events, renamed into
    #: token-block hashes (sluice/prefix_tokens.py); ``approx`` (word blocks) needs nothing.
    prefix_index: Literal["approx", "precise"] = Field(
        default="approx",
        validation_alias=AliasChoices("SLUICE_PREFIX_INDEX", "SLUICE_WORKER_PREFIX_INDEX", "prefix_index"))
    #: vLLM: extra AsyncEngineArgs as a JSON object, e.g. '{"dtype": "float32"}'.
    vllm_engine_args: dict[str, object] = Field(default_factory=dict)
    #: LoRA adapters to load at start, ``name=path`` (engine_worker/adapters.py).
    lora: list[str] = Field(default_factory=list)
    #: LoRA adapters this worker may hold (loading more on demand up to it); 0 with no
    #: ``lora``: adapters off. At least the number of ``lora`` given.
    max_loras: int = Field(default=0, ge=0)
    #: vLLM: the largest LoRA rank an adapter may have.
    max_lora_rank: int = Field(default=16, ge=1)
    #: TensorRT-LLM: sequences batched at once (untested here).
    trtllm_max_batch_size: int = Field(default=64, ge=1)
    #: TensorRT-LLM: context length.
    trtllm_max_seq_len: int = Field(default=4096, ge=16)
    #: TensorRT-LLM: share of free GPU memory for the KV cache.
    trtllm_kv_cache_fraction: float = Field(default=0.9, gt=0, le=1)

    #: openai: the OpenAI-compatible server this worker fronts (vllm serve, trtllm-serve, SGLang, TGI).
    upstream_url: str | None = None
    #: openai: the server's name for the model; default the first one its /v1/models lists.
    upstream_model: str | None = None
    #: openai: bearer token the server wants, if any.
    upstream_api_key: str | None = None
    #: openai: streams sent to the server at once (the worker's capacity).
    upstream_capacity: int = Field(default=64, ge=1)
    #: openai: whether the server returns token ids and takes token prompts (token-exact
    #: migration); auto: yes when it answers vLLM's /version.
    upstream_token_ids: Literal["auto", "on", "off"] = "auto"
    #: openai: how often /health and /metrics are read.
    upstream_poll_ms: int = Field(default=1000, ge=50)
    #: openai: how long to wait at start for the server to list its model.
    upstream_start_timeout_s: float = Field(default=600.0, gt=0)
    #: openai: who streams from the server. ``worker``: this worker relays (gateway → worker →
    #: server). ``direct``: the worker registers the server itself (keeping its capacity, health
    #: and load) and gateways call it, translating in-process (sluice/engine_server.py).
    relay: Literal["worker", "direct"] = "worker"

    @field_validator("vllm_kv_transfer_config", mode="before")
    @classmethod
    def _json_object(cls, value: object) -> object:
        """The command line gives the connector's config as JSON text, as vLLM's own flag does."""
        return json.loads(value) if isinstance(value, str) else value

    def url(self) -> str:
        """Where gateways reach this worker: the advertised URL, else this host's address."""
        if self.advertise_url:
            return self.advertise_url
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            # Bound to every interface (containers): advertise the address others can route to.
            host = socket.gethostbyname(socket.gethostname())
        return f"http://{host}:{self.port}"
