"""Gateway settings: environment ``SLUICE_GATEWAY_*`` (and ``SLUICE_REDIS_URL``), or CLI flags."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import SettingsConfigDict

from gateway.admission.name_limits import NameLimit
from gateway.relay import whole_answers
from sluice import connection_bounds, keys
from sluice.settings import RedisSettings


class GatewaySettings(RedisSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICE_GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    #: Gateway processes on this port (SO_REUSEPORT); 0: one per two cores, 1 to 8.
    procs: int = Field(default=0, ge=0, le=64)
    #: Set by the supervisor of several processes: bind the port shared.
    reuse_port: bool = False
    #: Request bodies above this size get 413 before they are parsed.
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    #: A request's head (request line and headers) still incomplete past this many bytes gets
    #: 431 and its connection closed (sluice/connection_bounds.py).
    max_head_bytes: int = Field(default=connection_bounds.MAX_HEAD_BYTES, ge=4096)
    #: Seconds a request's head may take, from the connection's opening (its first request)
    #: or the head's first byte (the later ones): past it, 408 and the connection closed. Also
    #: a body's slack: after it, a body must average 16 KiB/s (else 408 request_body_timeout).
    head_timeout_s: float = Field(default=connection_bounds.HEAD_TIMEOUT_S, gt=0)
    #: Client connections one gateway process keeps open; past it a newcomer closes the one
    #: that has waited longest without a request in flight (idle, or its request still
    #: coming), or gets 503 too_many_connections if every one has a request in flight.
    #: 0: half the process's descriptor limit (raised to its hard limit at start).
    max_connections: int = Field(default=0, ge=0)
    #: Bytes of responses one gateway process holds for clients that take them slower than
    #: they come (16 KiB/s after head_timeout_s of slack, else cut); past it, the connection
    #: holding most is cut.
    max_unsent_bytes: int = Field(default=connection_bounds.MAX_UNSENT_BYTES, ge=2**20)
    #: Bytes of non-streaming answers one gateway process builds at once (their text and
    #: logprobs as JSON): past it the largest ends with 503 answers_full + Retry-After, and one
    #: alone past it with 400 answer_too_large (gateway/relay/whole_answers.py).
    max_answer_bytes: int = Field(default=whole_answers.MAX_ANSWER_BYTES, ge=2**20)
    #: Workers tried for one request before the first token (first try included).
    max_attempts: int = Field(default=3, ge=1, le=10)
    retry_backoff_ms: float = Field(default=50.0, ge=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    #: At start, how long to wait for Redis (restarting, failing over) before giving up
    #: with a message; logged as it waits.
    redis_startup_wait_s: float = Field(default=30.0, ge=0)
    #: Times one stream may move to another worker after its worker broke off mid-stream.
    max_migrations: int = Field(default=2, ge=0, le=10)
    #: Seconds a mid-stream migration waits for Redis or for a live worker it has not tried.
    migration_wait_s: float = Field(default=15.0, ge=0)
    #: From dispatch to the first token; past it the attempt counts as failed.
    ttft_timeout_s: float = Field(default=60.0, gt=0)
    #: Longest silence between two upstream lines once tokens flow.
    stall_timeout_s: float = Field(default=30.0, gt=0)
    #: A non-streaming request for at most this many tokens (no logprobs, tools or echo) is
    #: asked of an OpenAI-compatible engine server (``--engine openai``, either relay) as one
    #: JSON answer, not a stream: its server serializes one body instead of a chunk per token
    #: plus a usage chunk (the mock engine spent 1.9x the CPU on a streamed one-token answer;
    #: loadtest/peers/README.md). Its attempt is bounded by ``ttft_timeout_s`` as a first token
    #: is, and an engine lost meanwhile means a retry from the start, not a migration: its
    #: client has seen nothing. 0: always stream.
    whole_max_tokens: int = Field(default=16, ge=0, le=4096)
    #: SSE comment pings keep idle proxies from closing a slow stream.
    sse_ping_s: float = Field(default=15.0, gt=0)
    #: Longest wait in the model's queue before 429 + Retry-After.
    queue_timeout_s: float = Field(default=30.0, gt=0)
    #: Requests waiting per model beyond which new ones get 429 at once.
    max_queue: int = Field(default=1024, ge=1)
    #: A granted slot's lease; renewed every third of it while the stream runs.
    lease_ttl_s: float = Field(default=15.0, ge=0.3)
    #: How often this gateway reclaims leases of gateways that stopped renewing.
    reap_interval_s: float = Field(default=1.0, gt=0)
    #: A model with no worker, lease or waiter for this long leaves the directory (its keys go).
    model_forget_s: float = Field(default=keys.MODEL_FORGET_S, gt=0)
    #: Fair queuing charges a request at its grant with its prompt estimate plus, per
    #: generation, its max_tokens up to this many (an omitted max_tokens counts as this);
    #: its release corrects the charge with the real usage. A declared limit is a bound,
    #: not a forecast: above this, declaring one costs no more than omitting it.
    fair_output_tokens: int = Field(default=256, ge=1)
    #: Aging within a queue: one priority level is worth this many tokens of others'
    #: service (so a lower level waits longer but never forever); 0 = strict levels.
    priority_step_tokens: int = Field(default=2048, ge=0)
    #: Which worker gets a request: "cache" (prefix affinity balanced against load and
    #: prefill backlog, see gateway/admission/scripts.py), "least" (least loaded), "rr" (round robin).
    #: "cache" is the default: it beat or tied "least" on every workload of the prefix
    #: bench, the no-shared-prefix control included (loadtest/README.md).
    routing: Literal["cache", "least", "rr"] = "cache"
    #: Cache routing: one request in flight on a worker of the fleet's mean capacity weighs
    #: as much as prefilling this many prompt blocks (of 64 tokens); on a worker half that
    #: size, twice as much (load is a share of each worker's slots).
    route_load_blocks: float = Field(default=2.0, ge=0)
    #: Cache routing: weight of one block of prefill a worker still owes (uncached prompt
    #: blocks of its requests not past their first token) against one block this request
    #: would prefill. Below 1 on purpose: a spill costs the fleet the prefix's prefill again
    #: and a second cache's room; at 1 a prefill-bound fleet spilled its way into overload
    #: (loadtest/README.md, "Cache-aware routing").
    route_prefill_weight: float = Field(default=0.25, ge=0)
    #: Cache routing, hot-spot guard: a worker this share of its slots busier than the
    #: least-loaded one gets no credit for its cached prefix.
    route_hot_share: float = Field(default=0.75, ge=0, le=1)
    #: Least-loaded routing: a request granted but not yet past its first token counts as
    #: 1 + this many requests in flight. Such a request is what the next one's first token
    #: would wait behind (the worker's front end tokenizes one request at a time, then the
    #: engine prefills it); a decoding one costs that next request next to nothing. Counting
    #: slots alone (0), least sent a worker its requests in waves: the users a worker freed at
    #: one step all found it the least loaded and came back together, and their prompts queued
    #: in its front end: on one H200, 2.5-3.2x rr's TTFT p90, 67-70 % of a worker's arrivals
    #: within 10 ms of the one before (rr 5-7 %; README.md, "Migration at GPU speed, and the
    #: easy and w5 arms"). At 12 a worker holding one such request is passed over until the
    #: others hold one too. In virtual time (tests/gateway/closed_loop.py ``H200``: a 6 ms front
    #: end per prompt; 12 seeds, least's p90 against rr's) weights 0, 1, 3, 6, 12 at spread 1
    #: gave 2.66x, 1.50x, 1.25x, 1.13x, 1.13x, and 12 at spread 3 1.04x (worst seed 1.23x; 24
    #: no better), arrivals in waves 60 % -> 25 % (rr 10 %). The H200 run of 2026-12-01 where
    #: a weight of 3 "did not help" (w5 p90 1,411 ms, slots alone 1,286) proves nothing: its
    #: load generator (one httpx client for 64 users) sent requests in convoys, which its TTFT
    #: columns measured (README.md, "Where the 2.5 s TTFT floor came from"). On the H200 since
    #: (loadtest/gpu/h200-2026-12-03-m8b-routing/, 1B fleet, easy workload, 64 users): least's
    #: p90 against rr's 1.60x with slots alone, 1.56x / 1.31x at weights 2 / 4, 1.35x at 12 with
    #: spread 3 (the p50 1.24x): better, not yet within 1.2x; w5 0.95x with slots alone. On the
    #: 8B-shaped fleet (h200-2026-12-03-m8b-knobs/): 1.07x rr's p90 on easy (the old default
    #: 3.47x there), 0.89x on w5.
    route_least_pending_weight: float = Field(default=12.0, ge=0)
    #: Least-loaded routing: the workers within this many requests (weighted as above) of the
    #: least loaded are taken in turn. 0 is the least loaded alone (ties in turn), which in a
    #: closed loop sends every user back to the worker it left (gateway/admission/scripts.py);
    #: kept to measure. 3, measured with the weight above (1 before, with slots alone).
    route_least_spread: float = Field(default=3.0, ge=0)
    #: A model with more than 4x this many registered workers: a plain request is routed
    #: (least, cache) among this many workers drawn at random plus those the prefix index
    #: names for its prompt, read alone, not the whole fleet (the whole fleet when none of
    #: them has room and nobody waits); with requests waiting, the queue's pump looks at such
    #: a sample too (gateway/admission/scripts.py, "Large fleets"). 0: always the whole fleet.
    #: Admission's cost in Redis then stops growing with the fleet (loadtest/admission_cost.py).
    route_sample: int = Field(default=8, ge=0, le=1024)
    #: Cache routing's index (``SLUICE_PREFIX_INDEX``, shared with the workers): ``approx``
    #: names blocks of 64 words and learns from routing and ``cached_tokens``; ``precise``
    #: names blocks of 64 token ids (the ``tokenizer`` folder's tokenizer and chat template,
    #: as the worker applies them) and learns what vLLM workers really cache from their
    #: engines' KV events (sluice/prefix_tokens.py).
    prefix_index: Literal["approx", "precise"] = Field(
        default="approx",
        validation_alias=AliasChoices("SLUICE_PREFIX_INDEX", "SLUICE_GATEWAY_PREFIX_INDEX", "prefix_index"))
    #: A model folder (tokenizer and chat template): this gateway tokenizes every prompt with
    #: it, for the precise index and for the workers (``send_prompt_ids``). Set without the
    #: precise index, it moves the tokenizer's work from a vLLM worker's one process (its
    #: frontend, what bounds short requests on a GPU) to the gateway's: on the CPU machine
    #: -435 µs of worker CPU and +207 µs of gateway CPU a one-token chat request
    #: (loadtest/peers/README.md, "The worker's side of a short request"). One folder for
    #: every model this gateway serves: workers of another tokenizer ignore the ids (and say so once).
    tokenizer: str | None = None
    #: With a tokenizer: send each prompt's token ids to the worker with the tokenizer's
    #: digest; a vLLM worker with the same tokenizer takes them and does not tokenize again
    #: (engine_worker/engines/prompts.py ``PromptIds``). Off: every worker tokenizes (to measure).
    send_prompt_ids: bool = True
    #: Session affinity (``prompt_cache_key``, ``x-session-id`` or ``user``): "cost" (a term
    #: in cache routing's cost; with the other routings it is "bounded"), "bounded"
    #: (consistent hashing with bounded loads) or "off". "cost" by measurement: on the
    #: multi-turn bench it kept cache routing's hit rate, "bounded" lost 2.4 points of it
    #: (loadtest/README.md, "Session affinity"; gateway/admission/affinity.py).
    session_affinity: Literal["bounded", "cost", "off"] = "cost"
    #: Bounded affinity: a session's worker may carry at most this many times the fleet's
    #: mean load (share of slots, with this request) before the session spills to its next one.
    session_load_bound: float = Field(default=1.25, ge=1)
    #: Cost affinity: prompt blocks (of 64 tokens) that sending a session elsewhere than its
    #: home worker costs, against the cache routing's cost.
    session_cost_blocks: float = Field(default=8.0, ge=0)
    #: Per model or adapter name: a budget shared by every caller and a default priority,
    #: as JSON (gateway/admission/name_limits.py).
    name_limits: dict[str, NameLimit] = Field(default_factory=dict)
    #: Share of each worker's slots only urgent requests may fill (headroom under overload;
    #: a request that needs more than the rest may fill them all, see gateway/admission/scripts.py).
    reserved_slots: float = Field(default=0.125, ge=0, lt=1)
    #: Priorities at or below this are urgent (service_tier "priority" maps to -10).
    urgent_priority_max: int = -1
    #: Priorities (lower runs first) are clamped to this range.
    min_priority: int = -1000
    max_priority: int = 1000
    #: Whole-request limit when the client gives none (header X-Sluice-Timeout-Ms).
    request_timeout_s: float = Field(default=600.0, gt=0)
    #: Upper bound for a client's X-Sluice-Timeout-Ms.
    max_request_timeout_s: float = Field(default=3600.0, gt=0)
    #: How long an Idempotency-Key and its stored result live.
    idempotency_ttl_s: float = Field(default=3600.0, gt=0)
    #: A resumable stream's journal is kept this long after its last event (a finished
    #: one); a running one, ``idempotency_ttl_s`` after its latest.
    journal_done_ttl_s: float = Field(default=600.0, gt=0)
    #: Events one resumable stream may journal (about 100 B each, see gateway/streams/journal_quota.py):
    #: a request whose max_tokens x choices needs more gets 400; one with no max_tokens ends
    #: with an in-band error should it get there.
    journal_max_events: int = Field(default=131_072, ge=64)
    #: Journal bytes in Redis one API key's resumable streams may hold (429 past it).
    journal_tenant_max_bytes: int = Field(default=512 * 1024 * 1024, ge=1024 * 1024)
    #: Journal bytes in Redis all resumable streams together may hold (429 past it).
    journal_max_bytes: int = Field(default=2 * 1024 * 1024 * 1024, ge=1024 * 1024)
    #: Copies of finished journals one gateway process keeps in memory to write them back
    #: should Redis lose them (for 60 s after each stream's end; the oldest dropped first past
    #: this; 0 keeps none: gateway/streams/journal_keeper.py).
    journal_keep_max_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    #: "auto": API keys required as soon as one exists in Redis; "keys": always; "open": never.
    auth: Literal["auto", "keys", "open"] = "auto"
    #: Serve without API keys on a non-loopback address (refused by default).
    allow_open: bool = False
    #: A keys file (``sluice keys export``): its records are written back whenever Redis
    #: lacks them, so keys outlive a Redis that lost its data (sluice/apikeys.py). With
    #: ``auth=auto``, keys are enforced when it holds any.
    keys_file: str | None = None
    #: Bearer token for /metrics; without it, /metrics answers loopback clients only.
    admin_key: str | None = None
    #: Request caps (400 when exceeded).
    max_messages: int = Field(default=512, ge=1)
    max_prompt_chars: int = Field(default=1_000_000, ge=1)
    max_tokens_cap: int = Field(default=32_768, ge=1)
    max_n: int = Field(default=16, ge=1)
    #: Generations one request may ask for: n times the number of prompts (all admitted at once).
    max_generations: int = Field(default=64, ge=1)
    max_stop: int = Field(default=4, ge=0)
    max_stop_chars: int = Field(default=256, ge=1)
    #: Seconds uvicorn waits for open streams on shutdown.
    shutdown_grace_s: float = Field(default=30.0, ge=0)

    @model_validator(mode="after")
    def _precise_needs_tokenizer(self) -> GatewaySettings:
        if self.prefix_index == "precise" and self.routing == "cache" and not self.tokenizer:
            raise ValueError("SLUICE_PREFIX_INDEX=precise needs SLUICE_GATEWAY_TOKENIZER (the model folder "
                             "whose tokenizer and chat template the workers use)")
        return self
