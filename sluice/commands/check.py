"""``sluice check URL``: exit 0 if the URL answers 200, else 1, for container healthchecks.

Compose runs it every 2 s in every Sluice container, so it loads nothing but the standard
library. Through the whole command line (argparse for every subcommand, the bench's
modules, pydantic, httpx) one check cost 0.84 s of CPU: about 40 % of a core per container
at that interval. On a busy machine it ran past the healthcheck's 3 s timeout, so a
restarted gateway did not turn healthy for a minute (make test's compose test, beside
three other pytest processes). Now about 0.06 s.

>>> main(["http://127.0.0.1:8000/ready"])  # 0 when it answers 200
"""

from __future__ import annotations

import argparse
import urllib.error
import urllib.request


def check(url: str, timeout_s: float = 3.0) -> int:
    # No proxy: a healthcheck asks its own container, whatever HTTP_PROXY says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError, ValueError):  # refused, timed out, non-2xx, a bad URL
        return 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="e.g. http://127.0.0.1:8000/ready")
    parser.add_argument("--timeout-s", type=float, default=3.0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sluice check", description="exit 0 if URL answers 200, else 1")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return check(args.url, args.timeout_s)
