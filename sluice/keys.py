"""Every Redis key and TTL Sluice uses, in one place.

Per-model keys carry the model as a hash tag (``sl:{model}:...``) so that each
Lua script touches a single Redis Cluster slot.

    sl:models                  set of model names ever registered (directory)
    sl:{m}:workers             hash worker id -> JSON {id, url, engine, capacity}
    sl:{m}:hb:{worker}         heartbeat, JSON engine stats, expires after 3 beats
    sl:{m}:inflight            hash worker id -> requests the gateways have in flight
"""

from __future__ import annotations

MODELS = "sl:models"

#: A worker that misses this many heartbeats in a row stops getting traffic.
HEARTBEAT_MISSES = 3


def _tag(model: str) -> str:
    return "sl:{" + model + "}"


def workers(model: str) -> str:
    return _tag(model) + ":workers"


def heartbeat_prefix(model: str) -> str:
    return _tag(model) + ":hb:"


def heartbeat(model: str, worker_id: str) -> str:
    return heartbeat_prefix(model) + worker_id


def inflight(model: str) -> str:
    return _tag(model) + ":inflight"
