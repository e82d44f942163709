"""What a client and the log are told when Redis fails a request.

Every request of a gateway goes through Redis, so one Redis fault fails them all the same
way. Two things follow:

- The client's answer names the fault: a Redis at its ``maxmemory`` (``noeviction``)
  refuses writes (``OOM command not allowed``) while it still answers, and a connection
  left on a server that a failover made a replica refuses them (``READONLY``). Both were
  told "the gateway's state store is unreachable", which sends an operator to the
  network. Each is a 503 with ``Retry-After``, as before.
- The log says it once per :data:`EVERY_S` per kind, with a count of the requests it
  failed meanwhile, not once per request: a gateway serving 5,000 requests a second wrote
  5,000 warnings a second through an outage, which is what buries the first, useful line.

>>> raise unavailable(exc)      # the client's 503, from any RedisError or OSError
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from redis.exceptions import ResponseError

from sluice.errors import Unavailable
from sluice.redis_pool import is_demotion

log = logging.getLogger("sluice.gateway")

#: A kind of Redis fault is logged at most once this often (with a count of the rest).
EVERY_S = 5.0

_SAID: dict[tuple[str, ...], list[float]] = {}  # what -> [when last said, times since]


def kind_of(exc: BaseException) -> str:
    """``full``, ``read-only`` or ``unreachable``."""
    if isinstance(exc, ResponseError) and "OOM command not allowed" in str(exc):
        return "full"  # (inside a script, redis-py raises a plain ResponseError that quotes it)
    if isinstance(exc, ResponseError) and is_demotion(exc):
        return "read-only"
    return "unreachable"


_TOLD = {
    "full": "the gateway's state store is full (Redis refuses writes past its maxmemory)",
    "read-only": "the gateway's state store is failing over (Redis refused a write as a replica)",
    "unreachable": "the gateway's state store is unreachable",
}
_WHY = {
    "full": "Redis refuses writes: it is at its maxmemory (noeviction); free memory or raise maxmemory",
    "read-only": "Redis refused a write as a read-only replica (a failover moved the master)",
    "unreachable": "Redis error",
}


def unavailable(exc: BaseException, *, log_it: bool = True) -> Unavailable:
    """The client's 503 for a Redis fault (any ``RedisError`` or ``OSError``), logged as
    :data:`EVERY_S` allows (``log_it=False``: a request's record, whose answer says it)."""
    if log_it:
        report("a request got 503", exc)
    return Unavailable(_TOLD[kind_of(exc)], retry_after_s=2)


def report(what: str, exc: BaseException, detail: str = "") -> None:
    """Log ``what`` happened because of ``exc``, once per :data:`EVERY_S` for each ``what``
    and kind of fault, with how many times it happened in between; ``detail`` (a stream's
    key, say) is said with the line that is logged."""
    kind = kind_of(exc)
    throttled((what, kind), log.error if kind == "full" else log.warning,
              "%s%s: %s: %s", what, detail, _WHY[kind], exc)


def throttled(what: tuple[str, ...], say: Callable[..., None], message: str, *args: object) -> None:
    """``say(message, *args)`` once per :data:`EVERY_S` for each ``what``, with how many
    times it was asked in between: for a line that one fault can make every request or
    stream of a gateway write at once (a Redis that lost its data: one per live stream)."""
    now = time.monotonic()
    said = _SAID.get(what)
    if said is not None and now - said[0] < EVERY_S:
        said[1] += 1
        return
    if said is not None and said[1]:
        message += f" ({int(said[1])} more like it in the last {now - said[0]:.0f} s)"
    say(message, *args)
    _SAID[what] = [now, 0]
