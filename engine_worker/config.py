"""Worker settings: environment ``SLUICE_WORKER_*`` (and ``SLUICE_REDIS_URL``), or CLI flags."""

from __future__ import annotations

import socket
import uuid
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICE_WORKER_", extra="ignore")

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("SLUICE_WORKER_REDIS_URL", "SLUICE_REDIS_URL", "redis_url"),
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=0, le=65535)
    #: URL the gateways use to reach this worker; default http://host:port.
    advertise_url: str | None = None
    worker_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
    engine: Literal["sim", "vllm", "trtllm"] = "sim"
    #: Local Hugging Face model folder (vllm and trtllm engines).
    model: str | None = None
    #: Name clients use in the ``model`` field.
    served_model_name: str = "sim"
    heartbeat_ms: int = Field(default=1000, ge=50)
    #: On SIGTERM: stop taking requests, wait this long for in-flight ones, then exit.
    drain_timeout_s: float = Field(default=30.0, ge=0)
    sim_ttft_ms: float = Field(default=20.0, ge=0)
    sim_token_ms: float = Field(default=5.0, ge=0)
    sim_max_seqs: int = Field(default=64, ge=1)

    def url(self) -> str:
        """Where gateways reach this worker: the advertised URL, else this host's address."""
        if self.advertise_url:
            return self.advertise_url
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            # Bound to every interface (containers): advertise the address others can route to.
            host = socket.gethostbyname(socket.gethostname())
        return f"http://{host}:{self.port}"
