"""Process-wide logging: JSON lines (default when stderr is not a terminal) or text.

``SLUICE_LOG_FORMAT=json|text`` overrides the choice. A record's ``fields`` extra
(the access line's request id, status, timings, tokens...) becomes top-level keys.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self._process = process

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "process": self._process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
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
