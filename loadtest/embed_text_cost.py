"""What a vLLM worker spends writing an embeddings answer: the vectors as float32 arrays
(engine_worker/pooling.py since 9e68cb3) against the way before (a Python float per value,
then those floats written), both ways in one run, each the median of ``--repeat`` rounds.

    .venv/bin/python loadtest/embed_text_cost.py [--inputs 1024] [--dim 4096] [--repeat 3]

Prints, per way: making the vectors (the tensor's values to what is written), their JSON text,
their base64, and the bytes of the text. The vectors are random unit vectors in float32 (a
pooled, normalised embedding's shape); no engine runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import orjson

from engine_worker.pooling import float32_base64, vector_json


def _timed(make: Callable[[], object]) -> tuple[float, object]:
    began = time.perf_counter()
    made = make()
    return time.perf_counter() - began, made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    arrays = [(v / np.linalg.norm(v)).astype(np.float32) for v in rng.standard_normal((args.inputs, args.dim))]
    rows: dict[str, dict[str, list[float]]] = {"floats (before)": {}, "float32 arrays (now)": {}}
    sizes: dict[str, int] = {}
    for _ in range(args.repeat):
        for way in rows:
            if way.startswith("floats"):
                made_s, vectors = _timed(lambda: [[float(x) for x in a.tolist()] for a in arrays])
            else:
                made_s, vectors = 0.0, arrays  # the worker hands on what the engine gave
            text_s, text = _timed(lambda: [vector_json(v) for v in vectors])  # type: ignore[union-attr]
            b64_s, _ = _timed(lambda: [float32_base64(v) for v in vectors])  # type: ignore[union-attr]
            for name, value in (("make", made_s), ("text", text_s), ("base64", b64_s)):
                rows[way].setdefault(name, []).append(value)
            sizes[way] = sum(map(len, text))  # type: ignore[arg-type]
    first, second = list(rows)
    for array in arrays[:8]:  # the text reads back as the very float32 values
        assert (np.asarray(orjson.loads(vector_json(array)), dtype=np.float32) == array).all()
    print(f"{args.inputs} vectors of {args.dim}, medians of {args.repeat} rounds (ms; ranges in brackets)")
    print(f"| step | {first} | {second} |")
    print("| --- | --- | --- |")
    for name in ("make", "text", "base64"):
        cells = []
        for way in rows:
            values = [1000 * v for v in rows[way][name]]
            cells.append(f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})")
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    print(f"| JSON text, bytes | {sizes[first]:,} | {sizes[second]:,} ({sizes[first] / sizes[second]:.2f}x fewer) |")


if __name__ == "__main__":
    main()
