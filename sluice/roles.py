"""A worker's part in prefill/decode disaggregation, registered with it in Redis.

    both      prefill and decode in one engine (aggregated serving: every worker before roles)
    prefill   computes a prompt's KV cache and hands it to a decode worker through the
              engine's KV connector (vLLM: ``kv_role`` ``kv_producer``)
    decode    receives a prompt's KV cache from a prefill worker and streams the tokens
              (vLLM: ``kv_role`` ``kv_consumer``)

A model whose live workers include both a prefill and a decode worker is served through
two hops (gateway/relay/disagg.py); any other fleet is served as before, by any worker.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["both", "prefill", "decode"]

BOTH: Role = "both"
PREFILL: Role = "prefill"
DECODE: Role = "decode"
