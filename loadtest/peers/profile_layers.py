"""How a gateway request's CPU splits between the HTTP server's layers (uvicorn, the ASGI
middleware) and Sluice's own code, from ``profile_gateway.py --cprofile`` stats.

    .venv/bin/python loadtest/peers/profile_gateway.py --levels 64 --max-tokens 1 --keep-alive \\
        --measure-s 10 --cprofile /tmp/gw.prof
    .venv/bin/python loadtest/peers/profile_layers.py /tmp/gw.prof

It answers one question (issue 22): how much would an HTTP server of our own for the
completion routes save? Only what these layers cost. Requests are counted as uvicorn's
``on_headers_complete`` calls (cProfile counts every resumption of a coroutine as a call).
A layer's own cost is its inclusive time less that of what it calls into: uvicorn's
``run_asgi`` less the front's (uvicorn's proxy-headers middleware between them), the lean
front (sluice/lean_routes.py) less the endpoint and the response it runs. uvicorn's ``send`` includes the
socket writes (uvloop's C code is not profiled apart), which any server makes.
"""

from __future__ import annotations

import argparse
import pstats

#: (label, function name, a part of its file's path)
POINTS = {
    "data_received": ("data_received", "uvicorn/protocols/http/httptools_impl"),
    "headers": ("on_headers_complete", "uvicorn/protocols/http/httptools_impl"),
    "run_asgi": ("run_asgi", "uvicorn/protocols/http/httptools_impl"),
    "send": ("send", "uvicorn/protocols/http/httptools_impl"),
    "send_with_id": ("send_with_id", "sluice/lean_routes"),
    "lean": ("__call__", "sluice/lean_routes"),
    "route": ("route", "gateway/app.py"),
    "sse": ("__call__", "gateway/relay/sse"),
}


def entry(stats: pstats.Stats, name: str, path_part: str) -> tuple[int, float, float]:
    """(calls, own time, inclusive time) of one function, summed over its definitions."""
    calls = own = inclusive = 0.0
    for (file, _, function), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        if function == name and path_part in file:
            calls, own, inclusive = calls + ncalls, own + tottime, inclusive + cumtime
    return int(calls), own, inclusive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stats", help="cProfile output of the gateway (profile_gateway.py --cprofile)")
    args = parser.parse_args()
    stats = pstats.Stats(args.stats)
    at = {label: entry(stats, *point) for label, point in POINTS.items()}
    requests = at["headers"][0]
    assert requests, "no request in this profile"
    work = at["data_received"][2] + at["run_asgi"][2]  # everything a request runs from the server
    # The response's sends run inside the endpoint's response (sse), which the lean front
    # runs: its send wrapper, then uvicorn's send.
    layers = {
        "uvicorn: parsing, the request's task (data_received)": at["data_received"][2],
        "uvicorn's run_asgi and proxy-headers middleware (their own time)":
            at["run_asgi"][2] - at["lean"][2],
        "the lean front (Front), less the endpoint and its response":
            at["lean"][2] - at["route"][2] - at["sse"][2],
        "the front's send wrapper, less uvicorn's send": at["send_with_id"][2] - at["send"][2],
        "uvicorn's send, the socket writes included": at["send"][2],
    }
    print(f"{requests:,} requests; {work / requests * 1e6:,.0f} µs each from the server's entry points (profiled: "
          "cProfile slows the gateway about twofold, so compare shares, not µs)")
    for label, seconds in layers.items():
        print(f"  {label:82s} {seconds / requests * 1e6:6.1f} µs  {seconds / work * 100:5.1f} %")
    total = sum(layers.values())
    print(f"  {'the HTTP server and middleware in all':82s} {total / requests * 1e6:6.1f} µs  {total / work * 100:5.1f} %")
    print(f"  {'Sluice: the endpoint and its response, less the sends':82s} "
          f"{(work - total) / requests * 1e6:6.1f} µs  {(work - total) / work * 100:5.1f} %")


if __name__ == "__main__":
    main()
