"""The JSON log lines every Sluice process writes (sluice/logs.py): one object per line, the
access line's fields at the top level, whatever a record carries."""

from __future__ import annotations

import calendar
import io
import json
import logging
import os
import time

import pytest

from sluice.logs import JsonFormatter, configure_logging


@pytest.fixture
def logged(monkeypatch: pytest.MonkeyPatch):
    """configure_logging's handler, writing to a buffer; the root logger restored after."""
    monkeypatch.setenv("SLUICE_LOG_FORMAT", "json")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    configure_logging("INFO", "gateway")
    buffer = io.StringIO()
    root.handlers[0].setStream(buffer)  # type: ignore[attr-defined]
    yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines()]
    root.handlers[:], root.level = handlers, level


def test_a_line_carries_its_fields_and_time(logged) -> None:
    before = time.time()
    fields = {"request_id": "r1", "status": "ok", "total_ms": 12.5, "workers": "w-ü", "retries": 0}
    logging.getLogger("sluice.access").info("access request_id=r1", extra={"fields": fields})
    logging.getLogger("sluice.gateway").warning("plain %s", "words")
    access, plain = logged()
    assert access == {"ts": access["ts"], "level": "info", "process": "gateway", "pid": os.getpid(),
                      "logger": "sluice.access",
                      "msg": "access request_id=r1", **fields}
    assert plain["msg"] == "plain words" and plain["level"] == "warning" and "request_id" not in plain
    stamp, millis = access["ts"].removesuffix("Z").split(".")
    written = calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S")) + int(millis) / 1000
    assert before - 0.001 <= written <= time.time()


def test_lines_a_second_apart_carry_their_own_second() -> None:
    """The timestamp's text is made once a second: a record of another second makes its own."""
    formatter = JsonFormatter("gateway")
    first = logging.LogRecord("x", logging.INFO, "f", 1, "a", None, None)
    later = logging.LogRecord("x", logging.INFO, "f", 1, "b", None, None)
    later.created += 61.0
    stamps = [json.loads(formatter.format(r))["ts"][:19] for r in (first, later, first)]
    assert stamps[0] == stamps[2] != stamps[1]
    assert stamps[1] == time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(later.created)))


def test_what_orjson_refuses_is_still_written(logged) -> None:
    """A value past 64 bits and a key that is no string, in any record's fields: still a line."""
    logging.getLogger("sluice.x").info("odd", extra={"fields": {"big": 2**70, 3: "three"}})
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("sluice.x").exception("failed")
    odd, failed = logged()
    assert odd["big"] == 2**70 and odd["3"] == "three"
    assert failed["level"] == "error" and "ValueError: boom" in failed["exc"]


def test_other_formatters_in_the_process_still_get_every_fact(logged) -> None:
    """Regression (make run, 2026-12-06): configure_logging turned off the logging module's
    process, thread and caller facts to save a line 2 µs, and vLLM's formatter in the worker
    process, which prints the process id and the line, failed on every record ("%d format:
    a real number is required, not NoneType")."""
    theirs = io.StringIO()
    handler = logging.StreamHandler(theirs)
    handler.setFormatter(logging.Formatter("%(process)d %(threadName)s %(filename)s:%(lineno)d %(message)s"))
    other = logging.getLogger("vllm.like")
    other.addHandler(handler)
    other.propagate = False
    try:
        other.info("theirs")
    finally:
        other.removeHandler(handler)
        other.propagate = True
    assert theirs.getvalue() == f"{os.getpid()} MainThread test_logs.py:{_line_of('other.info(')} theirs\n"


def _line_of(text: str) -> int:
    """The line of this file that holds ``text`` first."""
    with open(__file__) as source:
        return next(i for i, line in enumerate(source, 1) if text in line and "_line_of" not in line)
