"""A gateway's py-spy profile by area of the request path: where one request's CPU goes.

py-spy's own views rank functions; a request path as flat as Sluice's has no function above a
few per cent, so the question "what would a leaner path save" needs the samples summed by the
job they do (parsing and validation, admission, the engine request, rendering, ...). Each
sample goes to the area of the deepest frame it names (a Redis write inside admission is
"redis write"); what no area names is "other".

    .venv/bin/python loadtest/peers/profile_gateway.py --levels 64 --max-tokens 1 --keep-alive \\
        --think-ms 4 --measure-s 20 --py-spy /tmp/gw        # writes /tmp/gw-64.txt (py-spy's raw stacks)
    .venv/bin/python loadtest/peers/profile_areas.py /tmp/gw-64.txt
    .venv/bin/python loadtest/peers/profile_areas.py /tmp/gw-64.txt --show "route glue"   # its frames

The areas name Sluice's functions as they are today: a renamed function falls to "other".
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Iterator

#: (area, substrings of a frame's "function file" that put a sample there), checked from the
#: deepest frame up; within a frame, the first area that names it.
AREAS: list[tuple[str, list[str]]] = [
    ("redis write", ["ScriptChannel._flush"]),
    ("client write", ["send_with_id", "RequestResponseCycle.send"]),
    ("admission args/script", ["_bulks", "ChannelScript.__call__", "Admission._ask", "Admission._granted",
                               "Admission._acquire_once", "Admission.acquire", "Dispatcher.admit"]),
    ("release", ["Admission.release", "Tenancy.settle_all"]),
    ("engine request", ["Http1Pool.post", "EngineServer._send", "EngineServer._open", "_sampling",
                        "DirectRelay.open"]),
    ("engine read/parse", ["aiter_raw", "_unchunk", "EngineServer._generate", "_delta"]),
    ("lines/migration", ["Upstream.lines", "Migrator._follow", "RouteCheck", "_check_route"]),
    ("rendering", ["sse_events", "ChunkWriter", "SSEResponse.__call__"]),
    ("record/metrics", ["RequestRecord", "prometheus_client"]),
    ("auth/parse/validate", ["_parse", "_read_body", "_context", "check_caps", "_credential", "model_validate",
                             "admitted", "worker_payload", "PromptPrefix", "begin"]),
    ("close/end", ["_end_stream", "_close", "aclose", "to_the_end", "end"]),
    ("uvicorn in", ["data_received", "on_headers_complete", "on_header", "on_url", "on_body",
                    "on_message_complete"]),
    ("route glue", ["run_asgi", "ProxyHeaders", "Front.__call__", "route ", "Serving"]),
    ("loop", ["Runner.run", "run_async"]),
]

_FRAME = re.compile(r"(.*?) \((.*?):(\d+)\)")


def samples(path: str) -> Iterator[tuple[list[str], int]]:
    """Each stack of py-spy's raw output (``frame;frame;... count``) as frame names and its count."""
    with open(path) as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            names = []
            for frame in stack.split(";"):
                m = _FRAME.match(frame)
                names.append(f"{m.group(1)} {m.group(2)}:{m.group(3)}" if m else frame)
            yield names, int(count)


def area_of(names: list[str]) -> tuple[str, int | None]:
    """The sample's area and the index of the frame that decided it."""
    for i in range(len(names) - 1, -1, -1):
        for area, marks in AREAS:
            if any(mark in names[i] for mark in marks):
                return area, i
    return "other", None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stacks", help="py-spy's raw output (profile_gateway.py --py-spy PREFIX: PREFIX-<level>.txt)")
    parser.add_argument("--show", help="an area: its samples' deciding frame and the two below it, by share")
    args = parser.parse_args()
    total, areas, shown = 0, Counter[str](), Counter[str]()
    for names, count in samples(args.stacks):
        total += count
        area, at = area_of(names)
        areas[area] += count
        if area == args.show:
            shown[" > ".join(names[at:at + 3] if at is not None else names[-3:])] += count
    if not total:
        raise SystemExit(f"{args.stacks}: no samples")
    print(f"{total} samples")
    for area, count in areas.most_common():
        print(f"{100 * count / total:5.1f} %  {area}")
    for frames, count in shown.most_common(30):
        print(f"{100 * count / total:5.2f} %  {frames}")


if __name__ == "__main__":
    main()
