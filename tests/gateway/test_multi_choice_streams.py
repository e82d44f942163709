"""Streams of several choices (``n > 1``): each choice has its own upstream, merged in
arrival order (gateway/streams/migration.py); a client that leaves must close all of them."""

from __future__ import annotations

import httpx
import openai

from sluice import keys
from tests.conftest import streaming, wait_for


def _inflight(client, model: str) -> int:
    return sum(int(v) for v in client.hvals(keys.inflight(model)))


def test_n_choices_client_disconnect_logs_no_error_and_frees_every_slot(
    start_worker, start_gateway, redis_client
) -> None:
    """Regression: closing the merged lines of an ``n > 1`` stream left each choice's
    reader running in its pump task, so closing the first upstream failed with
    "aclose(): asynchronous generator is already running" (two ERROR tracebacks) and the
    first clean-up stopped before the other upstreams."""
    model = "leave-n"
    worker = start_worker(model, sim_max_seqs=8, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway()
    body = {"model": model, "prompt": "leave early", "n": 4, "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # keep a reference: a dropped iterator closes the stream
        events = 0
        for line in lines:
            events += line.startswith("data: ")
            if events >= 12:
                break
        assert streaming(worker) == 4
    wait_for(lambda: streaming(worker) == 0, 5, "the worker to abort every choice")
    wait_for(lambda: _inflight(redis_client, model) == 0, 5, "every slot to come back")
    assert redis_client.zcard(keys.leases(model)) == 0
    wait_for(lambda: f"model={model}" in gateway.log_path.read_text(), 5, "the request's access line")
    # One more request through the same loop: whatever the first one's clean-up logs is out by then.
    done = httpx.post(gateway.url + "/v1/completions", json={"model": model, "prompt": "after", "max_tokens": 2},
                      timeout=30)
    assert done.status_code == 200
    log = gateway.log_path.read_text()
    assert '"level":"error"' not in log and "Traceback" not in log, log[-3000:]


def test_one_worker_dying_under_two_choices_is_not_a_query_of_death(start_worker, start_gateway) -> None:
    """Regression (nemesis seed 7: 41 of the 46 "query of death" errors were n > 1
    requests): the gateway counted a lost worker per choice, so one worker killed under
    two choices of a request read as two workers dead, and the stream ended with
    ``query_of_death`` instead of migrating both choices. The migration is logged once."""
    model = "one-death-n"
    doomed = start_worker(model, sim_max_seqs=8, sim_token_ms=15, sim_ttft_ms=0)
    # The simulator's text depends only on (prompt, seed, position): a fast worker of another
    # name writes the uninterrupted reference in no time, where the doomed one takes 9 s.
    start_worker(f"{model}-reference", sim_max_seqs=8, sim_token_ms=0, sim_ttft_ms=0)
    gateway = start_gateway()
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        reference = client.completions.create(model=f"{model}-reference", prompt="both on one worker", n=2,
                                              max_tokens=600, seed=7, extra_body={"ignore_eos": True})
        texts = ["", ""]
        stream = client.completions.create(model=model, prompt="both on one worker", n=2, max_tokens=600,
                                           seed=7, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
            if all(len(t.split()) >= 10 for t in texts) and doomed.alive():
                assert streaming(doomed) == 2  # both choices on the one worker
                start_worker(model, sim_max_seqs=8, sim_token_ms=1, sim_ttft_ms=0)  # where they can go
                doomed.kill()
    assert texts == [c.text for c in sorted(reference.choices, key=lambda c: c.index)]
    # One line for the worker that broke off under both choices (it was a line per choice:
    # an n=16 stream of the nemesis wrote each migration's line 16 times).
    assert gateway.log_path.read_text().count(" broke off after ") == 1
