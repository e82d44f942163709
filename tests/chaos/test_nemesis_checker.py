"""The nemesis's checker on made-up histories: each forbidden kind is found, and exact and
explicit outcomes are not mistaken for one (no processes: the checker is pure)."""

from __future__ import annotations

from dataclasses import replace

from sluice.nemesis.checker import check, queue_order
from sluice.nemesis.clients import GRACE_S
from sluice.nemesis.faults import FaultRun
from sluice.nemesis.history import Attempt, Chunk, ErrorSeen, History
from sluice.nemesis.schedule import Fault
from sluice.nemesis.workload import RequestSpec, reference

PORT = 8001


def _spec(path: str = "resumable", n: int = 1, max_tokens: int = 6, index: int = 1) -> RequestSpec:
    return RequestSpec(index=index, path=path, at_s=0.0, tenant=0, priority=0, n=n,  # type: ignore[arg-type]
                       max_tokens=max_tokens, ignore_eos=True, seed=42)


def _attempt(spec: RequestSpec, words: list[str], *, start: int = 1, how: str = "post", last: int = 0,
             chunk_id: str = "chatcmpl-a", done: bool = True, finish_last: bool = True, choice: int = 0,
             t: float = 0.0) -> Attempt:
    att = Attempt(how, PORT, t, last_event_id=last, ended_s=t + 1, status=200, done=done)
    for k, word in enumerate(words):
        finish = "length" if finish_last and k == len(words) - 1 else None
        att.chunks.append(Chunk(start + k, chunk_id, choice, " " + word, finish))
        att.event_ids.append(start + k)
    ref = reference(spec)
    att.usage = {"prompt_tokens": ref.prompt_tokens, "completion_tokens": ref.completion_tokens}
    return att


def _history(*attempts: Attempt) -> History:
    return History(1, 0.0, list(attempts), ended_s=max(a.ended_s for a in attempts))


def _words(spec: RequestSpec, choice: int = 0) -> list[str]:
    return list(reference(spec).words[choice])


def test_an_exact_stream_is_exact() -> None:
    spec = _spec()
    verdict = check(spec, reference(spec), _history(_attempt(spec, _words(spec))), [], [PORT])
    assert (verdict.outcome, verdict.kinds) == ("exact", [])


def test_a_reattached_stream_that_goes_on_after_last_event_id_is_exact() -> None:
    spec = _spec()
    w = _words(spec)
    first = _attempt(spec, w[:2], done=False, finish_last=False)
    first.broke = "RemoteProtocolError"
    rest = _attempt(spec, w[2:], start=3, how="get", last=2, t=2.0)
    verdict = check(spec, reference(spec), _history(first, rest), [], [PORT])
    assert (verdict.outcome, verdict.kinds) == ("exact", [])


def test_a_reattach_that_skips_events_is_a_gap() -> None:
    spec = _spec()
    w = _words(spec)
    first = _attempt(spec, w[:2], done=False, finish_last=False)
    rest = _attempt(spec, w[4:], start=5, how="get", last=2, t=2.0)
    verdict = check(spec, reference(spec), _history(first, rest), [], [PORT])
    assert verdict.outcome == "forbidden" and "gap" in verdict.kinds


def test_a_second_generation_after_a_retry_is_a_splice_and_a_duplicate() -> None:
    spec = _spec()
    w = _words(spec)
    first = _attempt(spec, w[:3], done=False, finish_last=False)
    again = _attempt(spec, w, how="repost", last=3, chunk_id="chatcmpl-b", t=2.0)
    verdict = check(spec, reference(spec), _history(first, again), [], [PORT])
    assert verdict.outcome == "forbidden"
    assert {"splice", "duplicate", "over_max_tokens"} <= set(verdict.kinds)


def test_other_text_is_different_text() -> None:
    spec = _spec()
    w = _words(spec)
    verdict = check(spec, reference(spec), _history(_attempt(spec, [*w[:3], "zzzz", *w[4:]])), [], [PORT])
    assert "different_text" in verdict.kinds


def test_a_stream_that_ends_without_done_or_error_is_truncated() -> None:
    spec = _spec(path="plain")
    w = _words(spec)
    verdict = check(spec, reference(spec), _history(_attempt(spec, w[:3], done=False, finish_last=False)), [],
                    [PORT])
    assert (verdict.outcome, verdict.kinds) == ("forbidden", ["truncated"])


def test_a_broken_connection_is_explicit_only_while_its_gateway_was_killed() -> None:
    spec = _spec(path="plain")
    att = _attempt(spec, _words(spec)[:3], done=False, finish_last=False)
    att.broke = "RemoteProtocolError"
    kill = FaultRun(Fault(0, 0.2, "gateway_kill", "gateway-0", 1.0), started_s=0.2, ended_s=1.5)
    assert check(spec, reference(spec), _history(att), [kill], [PORT]).outcome == "explicit"
    assert check(spec, reference(spec), _history(att), [], [PORT]).kinds == ["broken"]
    elsewhere = check(spec, reference(spec), _history(att), [kill], [PORT + 1])
    assert elsewhere.kinds == ["broken"]


def test_an_error_on_the_list_is_explicit_and_a_lost_stream_is_not() -> None:
    spec = _spec()
    att = _attempt(spec, _words(spec)[:2], finish_last=False)
    att.errors.append(ErrorSeen(200, True, "timeout", "request_timeout", "the request ran past its deadline"))
    assert check(spec, reference(spec), _history(att), [], [PORT]).outcome == "explicit"
    att.errors[-1] = ErrorSeen(200, True, "server_error", "upstream_error",
                               "the stream's producer is gone; the rest is lost")
    assert check(spec, reference(spec), _history(att), [], [PORT]).kinds == ["unlisted_error:stream_lost"]


def test_a_journaled_error_read_by_a_later_re_attach_is_explained_by_the_faults_before_it() -> None:
    """Regression (full single-server run, nem-250): two workers killed at 38-43 s ended a
    resumable stream with an in-band query of death, journaled then; the client re-attached
    at 78 s and read it. The checker judged the error by the re-attach's own window alone
    and called a documented outcome forbidden."""
    spec = _spec()
    first = _attempt(spec, _words(spec)[:2], done=False, finish_last=False, t=30.0)
    later = _attempt(spec, _words(spec)[2:3], start=3, how="get", last=2, finish_last=False, t=78.0)
    later.errors.append(ErrorSeen(200, True, "server_error", "query_of_death",
                                  "two workers died while serving this request; it is not sent to another"))
    kills = [FaultRun(Fault(i, t, "worker_kill", f"worker-{i}", 2.0), started_s=t, ended_s=t + 2.0)
             for i, t in enumerate((38.7, 40.6))]
    assert check(spec, reference(spec), _history(first, later), kills, [PORT]).outcome == "explicit"
    assert check(spec, reference(spec), _history(first, later), [], [PORT]).kinds == [
        "unlisted_error:query_of_death"]


def test_usage_must_count_the_prompt_once_per_prompt() -> None:
    spec = _spec(n=2)
    ref = reference(spec)
    first = _attempt(spec, _words(spec, 0), done=False)
    second = _attempt(spec, _words(spec, 1), start=len(ref.words[0]) + 1, choice=1)
    second.usage = {"prompt_tokens": 2 * ref.prompt_tokens, "completion_tokens": ref.completion_tokens}
    verdict = check(spec, ref, _history(first, second), [], [PORT])
    assert verdict.kinds == ["wrong_usage"]


def test_a_hung_request_is_forbidden() -> None:
    spec = _spec()
    hist = _history(_attempt(spec, _words(spec)[:2], done=False, finish_last=False))
    hist.hung = True
    assert "hang" in check(spec, reference(spec), hist, [], [PORT]).kinds


def test_an_answer_late_by_the_time_its_gateway_was_stopped_is_no_hang() -> None:
    """Regression (the nemesis, Cluster, nem-3753): a re-sent POST's 504 came 80.0 s after
    the request's first send (deadline 60 s, grace 20 s) because the nemesis had stopped the
    gateway that held it for 12.3 s meanwhile: a frozen process is given that time back.
    The same lateness with the stop on the other port, or beyond the stopped time, is a hang."""
    spec = _spec()
    late = spec.deadline_s + GRACE_S + 9.0  # two stops of 6 s cover it, one does not

    def hist_ending(at: float) -> History:
        waited = Attempt("repost", PORT, 50.0, ended_s=at, status=504)
        waited.errors.append(ErrorSeen(504, False, "timeout", "timeout", "the request's deadline passed"))
        return History(1, 0.0, [waited], ended_s=at)

    stop = FaultRun(Fault(0, 60.0, "gateway_stop", "gateway-0", 6.0), started_s=60.0, ended_s=66.0)
    stopped_twice = [stop, replace(stop, started_s=67.0, ended_s=73.0)]
    assert check(spec, reference(spec), hist_ending(late), stopped_twice, [PORT]).outcome == "explicit"
    assert "hang" in check(spec, reference(spec), hist_ending(late), stopped_twice, [PORT + 1]).kinds
    assert "hang" in check(spec, reference(spec), hist_ending(late), [stop], [PORT]).kinds
    assert "hang" in check(spec, reference(spec), hist_ending(late), [], [PORT]).kinds


def test_a_queue_timeout_while_a_later_request_is_served_is_queue_order() -> None:
    early, late = _spec(path="plain", index=1), _spec(path="plain", index=2)
    waited = Attempt("post", PORT, 1.0, ended_s=11.0, status=429)
    waited.errors.append(ErrorSeen(429, False, "rate_limit_error", "queue_timeout", "timed out in the queue"))
    served = _attempt(late, _words(late), t=3.0)
    served.first_byte_s = 3.5
    histories = [History(1, 1.0, [waited], ended_s=11.0), History(2, 3.0, [served], ended_s=4.0)]
    verdicts = [check(s, reference(s), h, [], [PORT]) for s, h in zip([early, late], histories, strict=True)]
    assert verdicts[0].outcome == "explicit"
    queue_order([early, late], histories, verdicts, [])
    assert verdicts[0].kinds == ["queue_order"]


def test_a_stream_whose_gateway_died_just_after_its_end_is_unbilled_not_wrong(tmp_path) -> None:
    """A stream is billed once its journal is settled, just after its client read [DONE]: a
    gateway killed then logs nothing (nemesis, Sentinel: nem-778, killed moments after its
    end). Within ``BILLING_LAG_S`` of the end that is unbilled; later, a wrong bill."""
    from types import SimpleNamespace

    from sluice.nemesis.invariants import BILLING_LAG_S, usage

    spec = _spec()
    log = tmp_path / "gateway-0.log"
    log.write_text("")  # nothing logged: the gateway died before its access line
    system = SimpleNamespace(gateways=[SimpleNamespace(log_path=log)])
    hist = _history(_attempt(spec, _words(spec)))
    verdict = check(spec, reference(spec), hist, [], [PORT])

    def billing(kill_after_end_s: float) -> dict:
        kill = FaultRun(Fault(1, 0.0, "gateway_kill", "gateway-0", 1.0), started_s=hist.ended_s + kill_after_end_s,
                        ended_s=hist.ended_s + kill_after_end_s + 1)
        return usage(system, [spec], [hist], [verdict], [kill]).value  # type: ignore[arg-type]

    assert billing(BILLING_LAG_S / 2) == {**billing(BILLING_LAG_S / 2), "wrong": [], "unbilled_killed": 1}
    assert billing(BILLING_LAG_S + 2.5)["wrong"] == [f"nem-1: served {len(_words(spec))}, billed 0 in 0 line(s)"]


def test_a_gateway_stopped_at_the_streams_end_bills_it_later(tmp_path) -> None:
    """A gateway stopped (SIGSTOP) when its stream's client read [DONE] through another
    gateway bills it only once it runs again, after waiting for its lapsed claim (nemesis,
    single Redis, 5faa9e2: nem-3995, its gateway killed 1.2 s after it woke): a kill then is
    unbilled, not a wrong bill; a kill long after the stop still is."""
    from types import SimpleNamespace

    from gateway.streams.journal import RECLAIM_GRACE_S
    from sluice.nemesis.invariants import BILLING_LAG_S, usage

    spec = _spec()
    log = tmp_path / "gateway-0.log"
    log.write_text("")
    system = SimpleNamespace(gateways=[SimpleNamespace(log_path=log)])
    hist = _history(_attempt(spec, _words(spec)))
    verdict = check(spec, reference(spec), hist, [], [PORT])
    end = hist.ended_s
    stop = FaultRun(Fault(1, 0.0, "gateway_stop", "gateway-0", 3.0), started_s=end - 1.5, ended_s=end + 1.5)

    def billing(kill_after_end_s: float) -> dict:
        kill = FaultRun(Fault(2, 0.0, "gateway_kill", "gateway-0", 1.0), started_s=end + kill_after_end_s,
                        ended_s=end + kill_after_end_s + 1)
        return usage(system, [spec], [hist], [verdict], [stop, kill]).value  # type: ignore[arg-type]

    assert billing(1.5 + BILLING_LAG_S + RECLAIM_GRACE_S - 0.5)["unbilled_killed"] == 1
    assert billing(1.5 + BILLING_LAG_S + RECLAIM_GRACE_S + 2.5)["wrong"]
