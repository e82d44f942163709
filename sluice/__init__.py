"""Sluice: an OpenAI-compatible LLM serving gateway.

Packages:
    sluice          shared infrastructure: CLI, Redis key schema, embedded Redis, supervisor
    gateway         the stateless HTTP gateway (admission, routing, relay)
    engine_worker   one inference engine behind a small streaming HTTP service
"""

__version__ = "0.1.0"
