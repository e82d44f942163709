"""Classifies every request's history against its exact reference and the faults of the run.

Outcomes:

- **exact**: every choice's text equals its reference, ends with the right finish reason,
  the stream ends with ``[DONE]`` (or the JSON body is complete), usage is right;
- **explicit**: the request ended with an error the client was told about, whose reason is
  on :data:`ALLOWED` (some only while a fault that explains them was under way), and what
  it got before that is a correct prefix;
- **left**: a plain stream its client left on purpose (its plan, or a ``client_cut``
  fault), with a correct prefix;
- **forbidden**: anything else. The kinds: ``different_text``, ``gap``, ``duplicate``,
  ``splice`` (two generations' chunk ids in one stream), ``over_max_tokens``,
  ``wrong_finish``, ``wrong_usage``, ``truncated`` (the stream ended without ``[DONE]``
  and without an error), ``hang`` (no outcome by the deadline plus a grace period),
  ``broken``/``stalled`` (the connection broke or went silent with no gateway fault to
  explain it), ``unshaped_error`` (not OpenAI's error shape), ``unlisted_error:<reason>``,
  ``queue_order`` (timed out in the queue while a later request of the same tenant and
  priority was served: a queued request Redis forgot), and ``auth_open`` (a probe with a
  bogus key or none was served).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from sluice.nemesis.clients import GRACE_S, STOPPED_MAX_S
from sluice.nemesis.faults import FaultRun
from sluice.nemesis.history import Attempt, ErrorSeen, History
from sluice.nemesis.schedule import DATA_LOSS
from sluice.nemesis.workload import Reference, RequestSpec

#: Seconds after a data-loss fault's API keys were restored during which a valid key may
#: still be refused (a gateway's request already past its key lookup).
KEY_RESTORE_GRACE_S = 3.0
#: How long after a data-loss fault a re-attach may still find the history it lost.
HISTORY_LOST_GRACE_S = 60.0
#: The gateways' own window for "registry_rebuilding" (30 s) plus a margin.
REGISTRY_REBUILD_GRACE_S = 33.0

_ALWAYS: Callable[[Attempt, list[FaultRun], list[int]], bool] = lambda attempt, runs, ports: True  # noqa: E731


def _during(kinds: Iterable[str], gateway_port: bool = False, grace_s: float = 0.0,
            ) -> Callable[[Attempt, list[FaultRun], list[int]], bool]:
    """Allowed when a fault of ``kinds`` overlapped the attempt (on the attempt's port, for
    gateway faults: ``ports[i]`` is gateway i's port)."""
    wanted = frozenset(kinds)

    def check(attempt: Attempt, runs: list[FaultRun], ports: list[int]) -> bool:
        for run in runs:
            if run.fault.kind not in wanted and not (run.lost_data and wanted & DATA_LOSS):
                continue
            end = (run.restored_s or run.ended_s or float("inf")) + grace_s
            if run.started_s > attempt.ended_s or end < attempt.started_s:
                continue
            if gateway_port and run.fault.target.startswith("gateway-"):
                if ports[int(run.fault.target.split("-")[1])] != attempt.port:
                    continue
            return True
        return False

    return check


#: The short documented list of explicit errors, by reason, and when each is allowed.
ALLOWED: dict[str, Callable[[Attempt, list[FaultRun], list[int]], bool]] = {
    "rate_limit_exceeded": _ALWAYS,     # 429: a key's limits
    "queue_full": _ALWAYS,              # 429: the queue is at its bound
    "queue_timeout": _ALWAYS,           # 429: waited the queue timeout (see queue_order)
    "service_unavailable": _ALWAYS,     # 503 + Retry-After: Redis or every worker unreachable
    "request_timeout": _ALWAYS,         # 504 / in-band: the request's deadline passed
    "timeout": _ALWAYS,
    "worker_lost": _ALWAYS,             # 502 / in-band: workers failed past the migration budget
    "stall_timeout": _ALWAYS,
    # Two workers died under one request: the gateway stops trying it (a query of death),
    # by design; only when workers really were killed or stalled meanwhile.
    "query_of_death": _during({"worker_kill", "worker_stop"}),
    # 401 for a valid key: only while Redis had lost the keys (until restored, plus a grace).
    "invalid_api_key": _during(DATA_LOSS, grace_s=KEY_RESTORE_GRACE_S),
    # The connection to the gateway broke, or went silent: only when that port's gateway
    # was killed or stalled meanwhile.
    "connection_lost": _during({"gateway_kill", "gateway_stop"}, gateway_port=True),
    # A resumable stream's journal lost events with Redis's data: a reader re-attaching from
    # before the loss is told so rather than given a gap (the loss may precede its re-attach).
    "stream_history_lost": _during(DATA_LOSS, grace_s=HISTORY_LOST_GRACE_S),
    # A model briefly unknown while workers register again after a loss: 503 + Retry-After.
    "registry_rebuilding": _during(DATA_LOSS, grace_s=REGISTRY_REBUILD_GRACE_S),
    # Bounds on what one client can make Redis hold (README, "What one client can grow").
    "stream_too_long": _ALWAYS,
    "journal_memory_exceeded": _ALWAYS,
}


@dataclass(slots=True)
class Verdict:
    index: int
    path: str
    outcome: str  # exact, explicit, left, forbidden
    reason: str = ""
    kinds: list[str] = field(default_factory=list)
    detail: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)  # kinds of the faults its lifetime overlapped


def reason_of(error: ErrorSeen) -> str:
    """The error's reason: its code, except the one message that means "stream lost"."""
    if "producer is gone" in error.message:
        return "stream_lost"
    return error.code or error.type or "unknown"


#: A fault's aftermath: a request that starts this soon after a fault ended is still counted
#: under it (workers re-register, gateways reconnect, keys come back).
AFTERMATH_S = 2.0


def overlapping(runs: list[FaultRun], start_s: float, end_s: float) -> list[str]:
    """Kinds of the faults under way (or in their aftermath) during [start_s, end_s]."""
    return sorted({r.fault.kind for r in runs
                   if r.started_s <= end_s and (r.ended_s or end_s) + AFTERMATH_S >= start_s})


def hang_allowance_s(attempt: Attempt, runs: list[FaultRun], ports: list[int]) -> float:
    """Seconds the nemesis held a gateway of ``attempt``'s port stopped (SIGSTOP) while the
    attempt waited: a frozen process answers nothing, so a request is not called hung for
    that time (at most the client's :data:`STOPPED_MAX_S`). Regression (the nemesis,
    Cluster): a re-sent POST with 2.5 s left reached a gateway its nemesis then stopped
    twice, 12.3 s in all; the gateway's 504 came 2.85 s after its handler began, 80.0 s after
    the request's first send, and the client, at 80 s, called it a hang."""
    held = 0.0
    for run in runs:
        if run.fault.kind != "gateway_stop" or ports[int(run.fault.target.split("-")[1])] != attempt.port:
            continue
        end = run.ended_s if run.ended_s is not None else attempt.ended_s
        held += max(0.0, min(end, attempt.ended_s) - max(run.started_s, attempt.started_s))
    return min(held, STOPPED_MAX_S)


def check(spec: RequestSpec, ref: Reference, hist: History, runs: list[FaultRun], ports: list[int]) -> Verdict:
    v = Verdict(spec.index, spec.path, "exact", faults=overlapping(runs, hist.started_s, hist.ended_s))
    attempts = hist.attempts
    if spec.path == "nonstream":
        ok = [a for a in attempts if a.status == 200]
        judged = ok[-1:] if ok else []
    else:
        judged = attempts
    _text(spec, ref, judged, v)
    if spec.path == "resumable":
        _event_ids(attempts, v)
    for attempt in attempts:
        for error in attempt.errors:
            if not error.type or not error.message:
                v.kinds.append("unshaped_error")
                v.detail.append(f"attempt {attempt.how}@{attempt.started_s:.1f}s: {error.message}")
    life_s = hist.ended_s - hist.started_s
    if hist.hung or (attempts and life_s > spec.deadline_s + GRACE_S + hang_allowance_s(attempts[-1], runs, ports)):
        v.kinds.append("hang")
        v.detail.append(f"no outcome {life_s:.1f}s after it started "
                        f"(deadline {spec.deadline_s:.0f}s); {len(attempts)} attempts")
    last = attempts[-1] if attempts else None
    complete = _complete(ref, judged)
    if v.kinds:
        v.outcome = "forbidden"
    elif last is None:
        v.outcome, v.reason = "forbidden", "no attempt"
        v.kinds.append("hang")
    elif complete and (last.done or spec.path == "nonstream"):
        _usage(spec, ref, judged, v)
        if v.kinds:
            v.outcome = "forbidden"
    elif spec.path == "plain" and any(a.left for a in attempts):
        v.outcome, v.reason = "left", next(a.left for a in attempts if a.left) or ""
    else:
        _explicit(attempts, runs, ports, v)
    v.kinds = sorted(set(v.kinds))
    return v


def _explicit(attempts: list[Attempt], runs: list[FaultRun], ports: list[int], v: Verdict) -> None:
    last = attempts[-1]
    # A re-attach that only got the final [DONE] ends the stream an earlier attempt's error ended.
    errors = last.errors or ([e for a in attempts for e in a.errors][-1:] if last.done and not last.chunks else [])
    if errors:
        v.reason = reason_of(errors[-1])
        v.detail.append(f"{last.how} {last.status}: {errors[-1].message}")
    elif last.broke or last.stalled:
        v.reason = "connection_lost"
        v.detail.append(f"{last.how} {last.status}: {last.broke or 'stalled'}")
    elif last.left:
        v.reason = "client_left"  # a resumable client that left and ran out of time to come back
    elif last.status == 200 and not last.done:
        v.outcome = "forbidden"
        v.kinds.append("truncated")
        v.detail.append(f"{last.how}: the stream ended without [DONE] and without an error")
        return
    else:
        v.reason = "incomplete"
        v.detail.append(f"{last.how} {last.status}: complete answer expected")
    allowed = ALLOWED.get(v.reason)
    window = last
    if errors and last.status == 200 and last.how in ("get", "repost"):
        # An in-band error a re-attach read from the journal: its producer journaled it at
        # any time since the stream began, so the fault that explains it may be over by the
        # re-attach (a query of death at 40 s read at 78 s).
        window = replace(last, started_s=attempts[0].started_s)
    if v.reason == "client_left" or (allowed is not None and allowed(window, runs, ports)):
        v.outcome = "explicit"
        return
    v.outcome = "forbidden"
    if v.reason == "connection_lost":
        v.kinds.append("stalled" if last.stalled else "broken")
    else:
        v.kinds.append(f"unlisted_error:{v.reason}")


def _choices(attempts: list[Attempt], n: int) -> tuple[list[list[str]], list[str | None], set[str]]:
    texts: list[list[str]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    ids: set[str] = set()
    for attempt in attempts:
        for chunk in attempt.chunks:
            if chunk.index >= n:
                continue
            texts[chunk.index].append(chunk.text)
            finish[chunk.index] = chunk.finish or finish[chunk.index]
            if chunk.chunk_id:
                ids.add(chunk.chunk_id)
    return texts, finish, ids


def _complete(ref: Reference, attempts: list[Attempt]) -> bool:
    texts, finish, _ = _choices(attempts, len(ref.words))
    return all("".join(t).split() == list(w) for t, w in zip(texts, ref.words, strict=True)) and all(
        f == want for f, want in zip(finish, ref.finish, strict=True))


def _text(spec: RequestSpec, ref: Reference, attempts: list[Attempt], v: Verdict) -> None:
    texts, finish, chunk_ids = _choices(attempts, spec.n)
    if any(c.index >= spec.n for a in attempts for c in a.chunks):
        v.kinds.append("different_text")
        v.detail.append(f"a choice index >= n={spec.n}")
    if len(chunk_ids) > 1:
        v.kinds.append("splice")
        v.detail.append(f"chunk ids {sorted(chunk_ids)}")
    for choice, (pieces, want) in enumerate(zip(texts, ref.words, strict=True)):
        got = "".join(pieces).split()
        if len(got) > spec.max_tokens:
            v.kinds.append("over_max_tokens")
            v.detail.append(f"choice {choice}: {len(got)} tokens > max_tokens {spec.max_tokens}")
        if got != list(want[: len(got)]):
            kind, where = _diagnose(list(want), got)
            v.kinds.append(kind)
            v.detail.append(f"choice {choice}: {kind} {where}")
        elif finish[choice] is not None and len(got) < len(want):
            v.kinds.append("gap")
            v.detail.append(f"choice {choice}: finished ({finish[choice]}) after {len(got)} of {len(want)} tokens")
        elif finish[choice] is not None and finish[choice] != ref.finish[choice]:
            v.kinds.append("wrong_finish")
            v.detail.append(f"choice {choice}: finish {finish[choice]} != {ref.finish[choice]}")


def _diagnose(want: list[str], got: list[str]) -> tuple[str, str]:
    """What went wrong in ``got`` against ``want``, from the first token that differs: the
    tokens after it repeat earlier ones (duplicate), skip some (gap), or are others."""
    i = next((k for k, (w, g) in enumerate(zip(want, got, strict=False)) if w != g), min(len(want), len(got)))
    probe = got[i:i + 3]
    for j in range(i):
        if want[j:j + len(probe)] == probe:
            return "duplicate", f"from token {i}: the tokens from {j} on again"
    for j in range(i + 1, len(want)):
        if want[j:j + len(probe)] == probe:
            return "gap", f"tokens {i}-{j - 1} of the reference missing"
    return "different_text", f"from token {i}: got {probe} expected {want[i:i + 3]}"


def _event_ids(attempts: list[Attempt], v: Verdict) -> None:
    """A re-attached stream goes on at Last-Event-ID + 1, every event once, in order."""
    expect = 1
    for attempt in attempts:
        if attempt.how != "post":
            expect = attempt.last_event_id + 1
        for number in attempt.event_ids:
            if number > expect:
                v.kinds.append("gap")
                v.detail.append(f"{attempt.how}@{attempt.started_s:.1f}s: event {number} after {expect - 1}")
            elif number < expect:
                v.kinds.append("duplicate")
                v.detail.append(f"{attempt.how}@{attempt.started_s:.1f}s: event {number} again (after {expect - 1})")
            expect = number + 1


def _usage(spec: RequestSpec, ref: Reference, attempts: list[Attempt], v: Verdict) -> None:
    usage = next((a.usage for a in reversed(attempts) if a.usage), None)
    if usage is None:
        v.kinds.append("wrong_usage")
        v.detail.append("no usage reported")
        return
    if usage.get("completion_tokens") != ref.completion_tokens or usage.get("prompt_tokens") != ref.prompt_tokens:
        v.kinds.append("wrong_usage")
        v.detail.append(f"usage prompt={usage.get('prompt_tokens')} completion={usage.get('completion_tokens')}, "
                        f"served prompt={ref.prompt_tokens} completion={ref.completion_tokens}")


def queue_order(specs: list[RequestSpec], histories: list[History], verdicts: list[Verdict],
                runs: list[FaultRun]) -> None:
    """A request that timed out in the queue while a later one of the same tenant and priority
    (both n=1) was granted well before: the queue lost it (issue 20, item 8). Not judged
    when a gateway fault overlapped its wait (its grant may have gone to a stalled process)."""
    gateway_faults = {"gateway_kill", "gateway_stop", "link_cut", "link_delay"}
    granted = [(s, h.attempts[0]) for s, h in zip(specs, histories, strict=True)
               if s.n == 1 and s.path != "nonstream" and h.attempts and h.attempts[0].status == 200]
    for spec, hist, verdict in zip(specs, histories, verdicts, strict=True):
        if verdict.outcome != "explicit" or verdict.reason != "queue_timeout" or spec.n != 1:
            continue
        waited = hist.attempts[-1]
        if set(overlapping(runs, waited.started_s, waited.ended_s)) & gateway_faults:
            continue
        for other, first in granted:
            if (other.tenant == spec.tenant and other.priority == spec.priority
                    and first.started_s >= waited.started_s + 1.0
                    and first.first_byte_s is not None and first.first_byte_s < waited.ended_s - 1.0):
                verdict.outcome = "forbidden"
                verdict.kinds.append("queue_order")
                verdict.detail.append(f"queued {waited.started_s:.1f}-{waited.ended_s:.1f}s and timed out; "
                                      f"request {other.index} of the same tenant and priority arrived at "
                                      f"{first.started_s:.1f}s and was granted at {first.first_byte_s:.1f}s")
                break
