"""What Sluice's Redis state does when a failover loses writes: the design, one table.

Redis replicates asynchronously. When a master dies, Sentinel (``redis+sentinel://``) or
the Cluster (``redis+cluster://``) promotes a replica that may lack the master's last
writes, typically the last few milliseconds; a replica that was cut off for longer
lacks more. Replication keeps the order of writes, so the new master is the old one *as
it was at an earlier instant* (per shard in a Cluster: each model's keys share a slot,
so each model's admission state rolls back as one). Nothing is half-applied: every Lua
script's writes replicate as one unit. So the question for each key family is what a
rollback of the last moments does to it, and what brings it back in line.

Meanwhile (master dead, replica not yet promoted, 2-3 s with Sentinel's
``down-after-milliseconds`` 1000 and a Cluster's ``cluster-node-timeout`` 1000) Redis is
unreachable: 503 + ``Retry-After`` for new requests, running streams go on, background
loops retry (sluice/redis_pool.py). When the old master is still running (``SENTINEL
FAILOVER``, a master that was stalled or restarted past the timeout), it stays a writable
master for some ten seconds after the sentinels named another, until they demote it: every
Sluice process leaves it as soon as its sentinel names the new one (``+switch-master``, or
its check every 2 s), so only writes of that moment land on it, and are lost with it. A
resumable stream whose generation ends while Redis is away writes its journal's last
events once Redis is back, for up to 30 s (gateway/streams/journal.py, ``DRAIN_S``).

| family (sluice/keys.py) | rolled back, what happens | what restores it |
| --- | --- | --- |
| registry: ``workers``, ``alive``, ``stats``, ``models`` | a worker registered in the window is missing; one that left in it is back until its heartbeat expiry (3 beats) | every heartbeat rewrites the worker's record and adds its model to ``models``: whole again within one beat (default 1 s). A request routed to a worker that left gets a refused connection and is retried on another worker, invisibly |
| gateway liveness: ``gateways`` | a gateway's last beat is older than it was | each gateway beats every second (``GATEWAY_TTL_S`` 3 s); a pump drops, not grants, queued entries of a gateway that looks dead, so a failover longer than about two seconds can drop a live gateway's queued entries before its next beat: the waiters' re-queue (the epoch check, below) covers them too |
| leases: ``leases``, ``lease_owner``, ``inflight``, ``prefill``, ``lease_prefill`` | a lease granted in the window is gone: its stream runs on (it needs no Redis), its worker counts one slot fewer, and its release frees nothing (``free_lease`` returns 0). A lease released in the window is back | the gateway's renewal reports leases Redis no longer has ("expired before renewal", logged); a lease released in the window is no longer renewed and the reaper reclaims it after ``lease_ttl_s``; the reaper's recount (every 10th pass) rebuilds ``inflight`` and ``prefill`` from the leases. Tested: every slot is free again once the streams end |
| queue: ``q:urgent``, ``q:normal``, ``heads``, ``queue_meta``, ``depth`` | a request queued in the window is not in the queue; one granted in the window is queued again | the latter is granted again; its grant finds no waiter (already served) and its lease expires unrenewed. The former waits for a grant that will not come until its queue deadline, then CANCEL answers ``gone``, unless the epoch check (below) saw the loss: then each gateway process queues its waiters again, in arrival order, with their priority and the rest of their timeout |
| grants: ``grants`` | grants published in the window are gone, with the leases and dequeues of the same scripts | rolled back together, so the requests are queued again and granted again; the listener reads the stream again from its start when it ends before the listener's position (gateway/admission/grants.py), so a grant numbered below that position is not skipped |
| fair queuing and statistics: ``fair``, ``done``, ``urgent_seen`` | tags and completion times of the window are gone | approximate by design: fairness resumes from the older tags, ``Retry-After`` estimates from fewer completions |
| tenancy: ``rl:{p}`` buckets, ``rl:{p}:streams`` | a tenant's requests and tokens of the window are refunded; generations admitted in it stop counting toward ``max_concurrent`` | the refund is bounded by what a tenant could spend in the lost moment. Each gateway renews its running generations every ``lease_ttl_s / 3`` and the renewal re-adds members Redis forgot, so they count again within that period (a generation released in the window is not renewed and stops counting after ``lease_ttl_s``) |
| API keys: ``apikeys``, ``apikey:{p}``, ``apikeys:revoked``, ``apikeys:enforced`` | a key record of the window is missing; so, after a whole loss, is every key (each would be 401) and the marker that keys exist; a revocation of the window is undone | every gateway process keeps a copy of the records it verified in the last 10 min (the stored hash, never the key; at most 10,000) and writes back the missing ones, only where Redis has none: at once when a verify finds one missing, and within a second of a new epoch or of Redis being back (gateway/admission/key_keeper.py). A key that Redis does not know while the epoch is under 3 s old, within 3 s of the gateway seeing a loss (a new epoch, other servers answering, Redis away) or, in a registry rebuilt after a loss (on a Cluster, in any registry: one node's loss leaves the epoch as it was), in a gateway process's first 3 s, is a ``503 registry_rebuilding`` + ``Retry-After`` (SDKs retry), not a 401. A gateway that enforces keys also writes back ``apikeys:enforced``, and one in ``auth=auto`` that starts with no keys in a young registry waits for it (1.5 s, 3 s after a loss): never open because of a loss while a gateway that saw keys runs. Revocations: a copy learns one within a second (``apikeys:revoked``) or from the next verify, and writes the record back revoked, so a revocation Redis loses later is restored too. ``sluice keys create`` / ``revoke`` wait for a replica to acknowledge (``WAIT``) |
| idempotency: ``idem:{scope}`` | a claim made in the window is gone: a retry with the same key would claim it again and start a second generation beside the first; a ``done`` record of the window is gone: a retry runs again | a streaming claim: the producer's next journal write re-claims ``:live`` and restores the record (gateway/streams/journal.py's APPEND), so a retry attaches to the one generation; a pending claim lives on ``:live`` too, renewed every second. A finished stream's record comes back with its journal from the producer's keeper (gateway/streams/journal_keeper.py), and at once when the producer finds it gone as it settles it; a retry that finds no record waits for that while its gateway knows of a loss (gateway/streams/idempotency.py, at most ``UNSURE_MAX_S``). A non-streaming ``done`` record of the window is not restored: a retry runs again |
| journals: ``journal:{scope}``, ``:live``, ``:plan`` | the last events of a resumable stream are gone; ``:live`` may be gone too | a missing ``:live`` is not a take-over: the producer re-claims it and writes on, numbering events from the journal's last entry (if its own process stalled past ``:live``'s TTL since its last write, it may have been taken over: it first waits ``RECLAIM_GRACE_S`` for a gateway that took it over to re-claim it, and stops if one did); a reader whose next event is missing gets an in-band ``stream_history_lost`` error, and a take-over refuses a journal that is not whole: never a gap; a take-over that finds no plan lets go of ``:live`` and its readers wait (``wait_for_producer_s``, 10 s) for a producer that may still run to write it all back; a client's re-sent POST or re-attach for a stream Redis lost waits as long; the wait ends at once when the producer's process has had no beat for as long (``sl:producer:*``, 8 s, gateway/streams/producers.py): it is generated again; no reader takes over a stream its own process produces, and readers judge ``:live`` only after their idle period has passed since Redis last answered promptly (a ``:live`` that expired in a stall says nothing of its producer); the first client is fed from memory and does not notice |
| prefix index: ``prefix``, ``prefix:lru`` | block-to-worker hints of the window are gone | hints only: a miss costs prefill, never correctness; routing and the workers' KV events refill it |

The data-loss check: ``sl:epoch`` holds one id for the registry (sluice/directory.py);
workers create it with their heartbeat, gateways at start. A restart without persistence,
FLUSHALL or a failover that lost its write drops it, the next beat creates a new id, and
each gateway process, checking every second, sees the change: it re-leases the slots of
its running streams, queues its waiters again, and for 30 s answers a model the registry
does not know yet with ``503 registry_rebuilding`` + ``Retry-After`` instead of 404. A
partial loss that keeps ``sl:epoch`` (on a Cluster, a failover of another node than the
epoch's) is not detected: those waiters get 429 at their queue deadline. Tested:
tests/chaos/test_redis_failover.py, tests/test_redis_failover.py,
tests/gateway/test_registry_loss.py, tests/gateway/test_journal_faults.py.

API keys, what is not covered: a key created and lost before any gateway verified it (401:
create it again); a revocation lost within a second of being made, before the gateways
read it (a restart without persistence right after ``sluice keys revoke``): the copies
bring the key back valid, so revoke it again after such a loss; every gateway that kept
copies gone or cut off from Redis when it lost its data: the keys stay lost, and a
gateway in ``auth=auto`` then starts open (production uses ``auth=keys``: never open). On
a Cluster, a failover that loses key records on a node other than the epoch's is seen
only by the verify that misses one: the gateway that kept it writes back all its copies
at once; another gateway answers such a key 401 until then.

Not covered by a failover: a *partition* that leaves the old master reachable by some
gateways and not by the sentinels. Those gateways keep writing to it until Sentinel
demotes it; Sluice does not set ``min-replicas-to-write``, so those writes are lost when
it rejoins. Deployments that need that bound set ``min-replicas-to-write 1`` and
``min-replicas-max-lag`` on the servers; Sluice then sees the refused writes as errors
(503) like any other.
"""
