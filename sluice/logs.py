"""Process-wide logging set-up."""

from __future__ import annotations

import logging
import sys


def configure_logging(level: str = "INFO", process: str = "sluice") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {process} %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # One line per upstream call is noise on the hot path; our access log covers it.
    logging.getLogger("httpx").setLevel(logging.WARNING)
