"""Process-wide logging: JSON lines (default when stderr is not a terminal) or text.

``SLUICE_LOG_FORMAT=json|text`` overrides the choice. A record's ``fields`` extra
(the access line's request id, status, timings, tokens...) becomes top-level keys. Each line
names its process's role and id (``process``, ``pid``): a gateway's ``--procs`` share one
log, and one process short of CPU shows in its own lines.

A gateway logs at INFO by default, so every request writes its access line (it bills the
request: written before the answer's end, one write each, never held in a buffer). What a
line costs is part of every request's: the JSON is written by orjson (compact, as the
rest of Sluice writes JSON; the standard library's encoder took about a third of a line's
CPU) and the timestamp's text is made once a second (loadtest/peers/README.md). The
logging module's process-wide switches (no caller, thread or process facts per record, as
the Logging HOWTO suggests) are left alone: a worker process hosts vLLM, whose own
formatter prints the process id and the line, and broke on records without them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import orjson


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self._process = process
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        entry: dict[str, object] = {
            "ts": f"{self._stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "process": self._process,
            "pid": record.process,  # which of a --procs gateway's processes (or a worker's)
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        try:
            return orjson.dumps(entry, default=str).decode()
        except TypeError:  # what orjson refuses (an integer past 64 bits, a key that is no string)
            return json.dumps(entry, default=str)


def configure_logging(level: str = "INFO", process: str = "sluice") -> None:
    handler = logging.StreamHandler(sys.stderr)
    mode = os.environ.get("SLUICE_LOG_FORMAT") or ("text" if sys.stderr.isatty() else "json")
    if mode == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {process} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # One line per upstream call is noise on the hot path; our access log covers it.
    logging.getLogger("httpx").setLevel(logging.WARNING)
