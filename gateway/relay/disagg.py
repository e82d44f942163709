"""Prefill/decode disaggregation: one request served by a prefill worker, then a decode worker.

A model whose live workers include a ``prefill`` and a ``decode`` worker (sluice/roles.py)
is served in two hops, each admitted on its own role's workers (the model's one queue,
slots and routing), each bound by the request's deadline and retried before its first
token on another worker of its role:

1. **prefill**: the request with ``max_tokens=1`` and vLLM's ``kv_transfer_params``
   ``{"do_remote_decode": true}``: the engine computes the prompt's KV cache and keeps it
   for a decode engine to fetch through its KV connector; its one token is not relayed.
   Its finishing line carries the ``kv_transfer_params`` the decode engine needs (where the
   KV is: NixlConnector's engine id, host, port and block ids), or none for a connector
   that finds the KV by the prompt itself (vLLM's ExampleConnector, KV through files).
2. **decode**: the whole request with what the prefill returned; its stream is the client's.
   Boosted (first in line, charged nothing): the request already waited for, and was
   charged at, its prefill hop. That charge moves to the decode hop's lease, whose release
   corrects it with the decode's usage (prompt and output): the tenant's fair share counts
   a P/D request as it counts an aggregated one, once.

A decode worker that dies mid-stream is a migration as any other (gateway/streams/migration.py):
the migration opens the request again here, so the prompt plus the tokens already sent are
prefilled on a live prefill worker and decoded on another decode worker; under greedy
decoding the client's stream goes on token for token.

A fleet without both roles (every worker ``both``, or one role's workers all gone) is
served whole by any worker, as before roles; the fleet's roles are read from the registry at
most once a second per model (:class:`FleetRoles`), and at once when a hop finds no live
worker of its role (the request is then served whole, not refused).

A decode retry before its first token reuses the prefill's ``kv_transfer_params``: the
simulator's and ExampleConnector's KV stays readable; with NixlConnector a decode engine
that read the KV and then failed leaves none to read, and the next one falls back to
vLLM's load-failure policy (recomputing the prompt) -- that path is untested here (no GPU).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisError

from gateway.admission.queue import ClientGone
from gateway.context import RequestContext
from sluice import keys
from sluice.errors import Unavailable, UpstreamFailed
from sluice.roles import DECODE, PREFILL
from sluice.single_flight import SingleFlight

if TYPE_CHECKING:
    from gateway.admission.queue import QueueCharge
    from gateway.relay.upstream import Dispatcher, Upstream

log = logging.getLogger("sluice.gateway")

#: What a prefill hop asks of vLLM's KV connector: keep the KV for a remote decode
#: (the fields vLLM's disaggregated-serving proxy sends; the connector fills them in).
REMOTE_DECODE: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


class FleetRoles:
    """Whether a model's live workers include prefill and decode workers, from the registry,
    cached for ``ttl_s``. Bounded: cleared when it holds :data:`CACHED` models, whatever
    names clients send. Redis unreadable: served whole (admission then answers as it does)."""

    CACHED = 4096

    def __init__(self, redis: Any, ttl_s: float = 1.0) -> None:
        self._redis = redis
        self._ttl_s = ttl_s
        self._cache: dict[str, tuple[float, bool]] = {}
        self._flights = SingleFlight[str, bool]()

    async def disaggregated(self, model: str, fresh: bool = False) -> bool:
        """``fresh``: read the registry now (a hop found no live worker of its role)."""
        now = time.monotonic()
        cached = self._cache.get(model)
        if cached is not None and now - cached[0] < self._ttl_s and not fresh:
            return cached[1]
        if fresh:
            return await self._refresh(model, now)
        return await self._flights.run(model, lambda: self._refresh(model, now))  # one read for all who ask

    async def _refresh(self, model: str, now: float) -> bool:
        try:
            split = await self._read(model)
        except (RedisError, OSError):
            split = False
        if len(self._cache) >= self.CACHED:
            self._cache.clear()
        self._cache[model] = (now, split)
        return split

    async def _read(self, model: str) -> bool:
        # Registered records, live or not: admission drops a dead worker's record at the
        # model's next grant (on Redis's clock, which this process does not share), and its
        # hop then goes to the live workers of the role.
        roles = {orjson.loads(raw).get("role") for raw in (await self._redis.hgetall(keys.workers(model))).values()}
        return PREFILL in roles and DECODE in roles


class Disaggregation:
    """The two hops of one request (see the module docstring)."""

    def __init__(self, roles: FleetRoles, stall_timeout_s: float) -> None:
        self._roles = roles
        self._stall_timeout_s = stall_timeout_s

    async def applies(self, model: str) -> bool:
        return await self._roles.disaggregated(model)

    async def open(
        self, dispatcher: Dispatcher, model: str, payload: dict[str, Any], ctx: RequestContext, *,
        exclude: list[str] | tuple[str, ...], boost: bool, cost: int,
    ) -> Upstream:
        """The decode hop's stream (its first line read), after the prefill hop.

        A hop that finds no live worker of its role, when the registry no longer lists one
        either (every prefill or every decode worker died), is not a 503: the request is
        served whole by the workers left, as a fleet without roles would be."""
        prefilled, charge = False, None
        try:
            params, charge = await self._prefill(dispatcher, model, payload, ctx, exclude=exclude, boost=boost,
                                                 cost=cost)
            prefilled = True
            if ctx.disconnected is not None and await ctx.disconnected():
                # Gone during its prefill: no decode slot for it (a whole request notices only
                # at its first token, which is the decode hop's).
                raise ClientGone("the client left during its prefill")
            decode = {k: v for k, v in payload.items() if k != "kv_transfer_params"}
            if params is not None:
                decode["kv_transfer_params"] = params
            upstream = await dispatcher.open(model, decode, ctx, exclude=exclude, boost=True, cost=cost, role=DECODE)
            upstream.carry_charge(charge)
            return upstream
        except Unavailable:
            if await self._roles.disaggregated(model, fresh=True):
                raise
        log.warning("request %s: model %r lost its prefill or its decode workers; serving it whole",
                    ctx.request_id, model)
        # Prefilled already: it waited and was charged once; its whole serving corrects that charge.
        upstream = await dispatcher.open(model, payload, ctx, exclude=exclude, boost=boost or prefilled, cost=cost)
        if prefilled:
            upstream.carry_charge(charge)
        return upstream

    async def _prefill(
        self, dispatcher: Dispatcher, model: str, payload: dict[str, Any], ctx: RequestContext, *,
        exclude: list[str] | tuple[str, ...], boost: bool, cost: int,
    ) -> tuple[dict[str, Any] | None, QueueCharge | None]:
        """Run the prefill hop to its end; the ``kv_transfer_params`` it returned, and its
        fair-share charge, taken off its lease for the next hop to correct (its own usage, the
        prompt and one token not relayed, is not the request's)."""
        hop = {**payload, "request_id": f"{payload['request_id']}-p", "max_tokens": 1, "min_tokens": 0,
               "logprobs": None, "echo": False, "kv_transfer_params": REMOTE_DECODE}
        upstream = await dispatcher.open(model, hop, ctx, exclude=exclude, boost=boost, cost=cost, role=PREFILL)
        params: dict[str, Any] | None = None
        finished = False
        try:
            async for line in upstream.lines(self._stall_timeout_s, ctx.deadline):
                if line.get("finish_reason") is not None:
                    params, finished = line.get("kv_transfer_params"), True
            charge = upstream.hand_over_charge()
        finally:
            await upstream.aclose()
        if not finished:
            raise UpstreamFailed("the prefill worker ended without finishing", code="worker_lost")
        return params, charge
