"""Every Redis key and TTL Sluice uses, in one place.

Per-model keys carry the model as a hash tag (``sl:{model}:...``) so that each
admission script touches a single Redis Cluster slot; every script receives all
of its keys in ``KEYS`` (nothing is derived inside Lua). Keys of other families
carry their own hash tag for the same reason.

    sl:models                      set of models with workers (directory); a model leaves it once its
                                   last worker has been gone for MODEL_FORGET_S (with its keys)
    sl:epoch                       hash {id, at, lost}: this Redis's registry generation; a new id
                                   means Redis lost its data (gateways re-queue their waiters).
                                   Registry state: no TTL (it must outlive every idle period, or
                                   an expiry would read as data loss)
    sl:reaper                      held for one reap period by the gateway process that reaps

    sl:{m}:workers                 hash worker id -> JSON {id, url, engine, capacity}
    sl:{m}:alive                   hash worker id -> heartbeat expiry (ms, Redis clock)
    sl:{m}:stats                   hash worker id -> JSON engine stats of its last beat
    sl:{m}:inflight                hash worker id -> slots leased on that worker
    sl:{m}:leases                  zset lease id -> lease expiry (ms); renewed while streaming
    sl:{m}:lease_owner             hash lease id -> worker id holding its slot
    sl:{m}:q:urgent                zset request id -> score (urgent class, retries, migrations)
    sl:{m}:q:normal                zset, lexicographic: tenant|priority+arrival|request (everything else)
    sl:{m}:q:normal:heads          zset tenant -> start tag of its first waiting request
    sl:{m}:queue_meta              hash request id -> JSON {deadline, exclude, priority, need, gw, ...}
    sl:{m}:depth                   hash priority class -> requests waiting (for /metrics)
    sl:{m}:grants                  stream of grants, read by one listener per gateway process
    sl:{m}:gateways                hash gateway process id -> liveness expiry (ms, Redis clock)
    sl:{m}:fair                    hash V:<class> -> virtual time, F:<class>:<tenant> -> finish tag;
                                   seq, rr -> counters (arrivals, round robin's turn); least:last ->
                                   the worker least routing took last (its turn; `least`, a counter
                                   until 2026-12-05, is left to gateways of earlier versions); cap,
                                   cap:at -> the most slots the live generating workers held lately
                                   and when REAP noted it (a request for more at once than live now
                                   but not than that is a 503, not a 400)
    sl:{m}:done                    list of recent completion times (ms), for Retry-After
    sl:{m}:urgent_seen             exists for a minute after an urgent request: slot headroom is on
    sl:{m}:prefix                  hash prefix block hash -> ids of workers holding it (space-separated)
    sl:{m}:prefix:lru              zset prefix block hash -> last use (ms); the oldest go past the cap
    sl:{m}:prefill                 hash worker id -> uncached prompt blocks of its leases (cache routing)
    sl:{m}:lease_prefill           hash lease id -> uncached prompt blocks it added to its worker's count
    sl:{m}:vacant                  since when (ms) the model has had no worker, lease or waiter

Nothing here is created for a model without a registered worker: a client naming a model
creates no key (``check_model_name`` bounds the name itself).

    sl:apikeys                     set of API key prefixes
    sl:apikey:{prefix}             hash: one API key's record (SHA-256 of the key, name, tier, limits,
                                   revoked); a revoked key's record stays, as its tombstone
    sl:apikeys:revoked             set of revoked key prefixes: gateways read it each second to learn
                                   revocations of the records they remember (gateway/admission/key_keeper.py)
    sl:apikeys:enforced            "1": keys exist here, so gateways in auth=auto enforce them; written by
                                   ``sluice keys create`` and, after a data loss, by every gateway that enforces
                                   (these four: no TTL; bounded by the keys an operator creates)
    sl:rl:{prefix}                 hash: the key's token buckets
    sl:rl:{prefix}:streams         zset: the key's running generations -> expiry (ms)
    sl:idem:{scope}                hash: an Idempotency-Key's record (state, body hash, owner token, ...)
    sl:journal:{scope}             stream: a resumable stream's SSE events
    sl:journal:{scope}:live        the token of the key's live owner: the gateway producing its stream, or
                                   holding its pending claim (3 s TTL, renewed while it lives)
    sl:journal:{scope}:plan        what another gateway needs to take that stream over
    sl:journal:{scope}:head        the bytes every chunk event of that stream starts with

    sl:{journals}:held             zset scope -> expiry (ms, Redis clock) of its journal's memory
    sl:{journals}:size             hash scope -> journal bytes reserved for it
    sl:{journals}:owner            hash scope -> tenant it is charged to
    sl:{journals}:tenants          hash tenant -> journal bytes reserved by all its streams
    sl:{journals}:total            journal bytes reserved by every tenant
    sl:{journals}:holder           hash scope -> token of the producer whose first reservation it is
                                   (these six: TTL = their latest reservation's expiry, set on
                                   every write; gone once nothing is reserved)
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

MODELS = "sl:models"
API_KEYS = "sl:apikeys"
API_KEYS_REVOKED = "sl:apikeys:revoked"
API_KEYS_ENFORCED = "sl:apikeys:enforced"
#: The digest of the keys file whose records a gateway process last wrote back whole, and
#: the lease (TTL) of the process writing one back now (gateway/admission/key_keeper.py):
#: one process writes a file back after a loss, not every one.
API_KEYS_FILED = "sl:apikeys:filed"
API_KEYS_FILING = "sl:apikeys:filing"
EPOCH = "sl:epoch"
REAPER = "sl:reaper"
#: LoRA adapters (gateway/admission/adapters.py): name -> {parent, path, until (ms, Redis
#: time)}, written by the workers that hold them at every beat; an entry its holders stopped
#: renewing is dropped by the next worker beat that writes adapters.
ADAPTERS = "sl:adapters"
#: An adapter entry outlives its holders' last beat by this long.
ADAPTER_TTL_MS = 30_000

#: A model name is part of every key of its model (and of its Cluster hash tag): at most
#: this long, of these characters (Hugging Face ids, folder names, ``name:tag``).
MODEL_NAME_MAX_CHARS = 256
_MODEL_NAME = re.compile(r"[A-Za-z0-9._:/@+=-]+")
#: A model whose last worker has been gone this long leaves the directory, and its keys go.
MODEL_FORGET_S = 600.0
#: For this long after Redis lost its data, the registry may still miss workers that have
#: not beaten since: an unknown model is "retry soon" (503), not "does not exist" (404).
REGISTRY_REBUILD_S = 30.0
#: Gateways that kept API keys write them back within about a second of Redis losing them
#: (a new epoch); until the epoch is this old, a key Redis does not know may be one being
#: written back (503, retry), and a gateway in auth=auto that finds no keys in a registry
#: marked as following a loss waits this long before it serves openly.
API_KEYS_RESTORE_S = 3.0
#: The same wait for an epoch nobody marked as following a loss: every running process that
#: knew the previous one marks it within a second.
API_KEYS_UNMARKED_S = 1.5

#: A worker that misses this many heartbeats in a row stops getting traffic.
HEARTBEAT_MISSES = 3
#: Grants kept in a model's grant stream (approximate trim); a listener further behind
#: than this still gets its grant when its waiter gives up and asks (CANCEL).
GRANTS_KEPT = 10_000


#: Prefix blocks the shared index keeps per model (least recently used dropped first),
#: and workers remembered per block (the oldest holder dropped first).
PREFIX_BLOCKS_KEPT = 200_000
PREFIX_HOLDERS = 4


def model_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a model name, or None when it can."""
    if len(name) > MODEL_NAME_MAX_CHARS:
        return f"a model name is at most {MODEL_NAME_MAX_CHARS} characters"
    if not _MODEL_NAME.fullmatch(name):
        return "a model name is letters, digits and . _ : / @ + = -"
    return None


def _tag(model: str) -> str:
    return "sl:{" + model + "}"


def workers(model: str) -> str:
    return _tag(model) + ":workers"


def alive(model: str) -> str:
    return _tag(model) + ":alive"


def stats(model: str) -> str:
    return _tag(model) + ":stats"


def routing(model: str) -> str:
    """Each registered worker's routing facts (sluice/routing_facts.py), what admission reads
    of it at every request; written beside its record by every beat."""
    return _tag(model) + ":routing"


def inflight(model: str) -> str:
    return _tag(model) + ":inflight"


def leases(model: str) -> str:
    return _tag(model) + ":leases"


def prefill(model: str) -> str:
    return _tag(model) + ":prefill"


def queues(model: str) -> tuple[str, str]:
    """The model's two queues: (urgent, normal)."""
    return _tag(model) + ":q:urgent", _tag(model) + ":q:normal"


def grants(model: str) -> str:
    return _tag(model) + ":grants"


def done(model: str) -> str:
    return _tag(model) + ":done"


class AdmissionKeys(NamedTuple):
    """The KEYS of every admission script, in the order gateway/admission/scripts.py reads them."""

    workers: str
    alive: str
    inflight: str
    leases: str
    lease_owner: str
    q_urgent: str
    q_normal: str
    queue_meta: str
    depth: str
    grants: str
    gateways: str
    fair: str
    done: str
    urgent_seen: str
    heads: str
    prefix: str
    prefix_lru: str
    prefill: str
    lease_prefill: str
    routing: str


@functools.lru_cache(maxsize=256)
def admission(model: str) -> AdmissionKeys:
    """Built once per model: every admission script call passes them."""
    t = _tag(model)
    urgent, normal = queues(model)
    return AdmissionKeys(
        workers=workers(model), alive=alive(model), inflight=inflight(model), leases=leases(model),
        lease_owner=t + ":lease_owner", q_urgent=urgent, q_normal=normal, queue_meta=t + ":queue_meta",
        depth=t + ":depth", grants=grants(model), gateways=t + ":gateways", fair=t + ":fair",
        done=done(model), urgent_seen=t + ":urgent_seen", heads=normal + ":heads",
        prefix=prefix_index(model)[0], prefix_lru=prefix_index(model)[1],
        prefill=prefill(model), lease_prefill=t + ":lease_prefill", routing=routing(model),
    )


def vacant(model: str) -> str:
    return _tag(model) + ":vacant"


def model_keys(model: str) -> list[str]:
    """Every key of one model, for the script that forgets a model nobody serves."""
    return [*admission(model), stats(model), vacant(model)]


def prefix_index(model: str) -> list[str]:
    """KEYS of the prefix index scripts: block holders, block recency."""
    return [_tag(model) + ":prefix", _tag(model) + ":prefix:lru"]


def worker_keys(model: str) -> list[str]:
    """KEYS of the worker registration scripts: workers, alive, stats, routing."""
    return [workers(model), alive(model), stats(model), routing(model)]


def api_key(prefix: str) -> str:
    return "sl:apikey:" + prefix


def rate_limits(prefix: str) -> list[str]:
    """KEYS of the tenancy scripts (one slot per API key): buckets, running generations."""
    tag = "sl:rl:{" + prefix + "}"
    return [tag, tag + ":streams"]


def idempotency(scope: str) -> str:
    # The journal's hash tag: scripts check the record and the journal's keys together.
    return "sl:idem:{" + scope + "}"


def journal(scope: str) -> str:
    return "sl:journal:{" + scope + "}"


def journal_live(scope: str) -> str:
    return journal(scope) + ":live"


def journal_plan(scope: str) -> str:
    return journal(scope) + ":plan"


def journal_head(scope: str) -> str:
    return journal(scope) + ":head"


def producer(instance: str) -> str:
    """A gateway process's beat (gateway/streams/producers.py)."""
    return "sl:producer:" + instance


class JournalQuotaKeys(NamedTuple):
    """KEYS of the journal memory scripts (gateway/streams/journal_quota.py): one slot for all tenants,
    so one script checks a tenant's bound and the total together."""

    held: str
    size: str
    owner: str
    tenants: str
    total: str
    holder: str


JOURNAL_QUOTA = JournalQuotaKeys(*("sl:{journals}:" + name for name in JournalQuotaKeys._fields))


def nemesis_marker(tag: int) -> str:
    """The nemesis harness's marker (sluice/nemesis/system.py): gone means Redis lost data."""
    return f"sl:nemesis:marker:{{{tag}}}"


NEMESIS_MARKER_TTL_S = 3600
