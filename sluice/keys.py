"""Every Redis key and TTL Sluice uses, in one place.

Per-model keys carry the model as a hash tag (``sl:{model}:...``) so that each
Lua script touches a single Redis Cluster slot.

    sl:models                  set of model names ever registered (directory)
    sl:{m}:workers             hash worker id -> JSON {id, url, engine, capacity}
    sl:{m}:hb:{worker}         heartbeat, JSON engine stats, expires after 3 beats
    sl:{m}:inflight            hash worker id -> slots leased on that worker
    sl:{m}:leases              zset request id -> lease expiry (ms); renewed while streaming
    sl:{m}:lease_owner         hash request id -> worker id holding its slot
    sl:{m}:queue               zset request id -> score (priority, aged by arrival)
    sl:{m}:queue_meta          hash request id -> JSON {deadline, exclude}
    sl:{m}:grant:{request}     list the waiting gateway blocks on; the grant lands here
    sl:{m}:done                list of recent completion times (ms), for Retry-After
    sl:{m}:urgent_seen         exists for a minute after an urgent request: slot headroom is on
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


def admission(model: str) -> list[str]:
    """The KEYS of every admission script, in the order gateway/scripts.py expects."""
    t = _tag(model)
    return [
        workers(model), inflight(model), t + ":leases", t + ":lease_owner",
        t + ":queue", t + ":queue_meta", t + ":done", t + ":urgent_seen",
    ]


def queue(model: str) -> str:
    return _tag(model) + ":queue"


def leases(model: str) -> str:
    return _tag(model) + ":leases"


def done(model: str) -> str:
    return _tag(model) + ":done"


def grant_prefix(model: str) -> str:
    return _tag(model) + ":grant:"
