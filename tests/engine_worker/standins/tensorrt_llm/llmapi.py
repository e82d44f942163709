"""Stand-in for ``tensorrt_llm.llmapi`` (contract tests only)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class KvCacheConfig:
    enable_block_reuse: bool = True
    free_gpu_memory_fraction: float | None = 0.9
