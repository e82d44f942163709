"""Embeddings on the GPU: `sluice up` with an embedding worker beside vLLM's own server.

usage (on the device, from embed_gpu.sh; any OpenAI-compatible base URL):
  python3 embed_gpu.py short URL SIDE VEC_OUT RES     3 short inputs: float, base64 (raw and the SDK's)
  python3 embed_gpu.py big URL SIDE RES [REPS]         1,024 inputs of ~50 tokens, float and base64
  python3 embed_gpu.py compare VEC_A VEC_B RES         the 3 short inputs' vectors of two servers

Environment: EMB_MODEL (served name, m135), EMBED_DIM (576); CPU_PIDS="name=pid,..." : `big` reads
/proc/<pid>/stat (utime+stime) of each such process and, apart, of its live descendants, before and
after each request: the CPU seconds each spent on it (name_cpu_s, name_children_cpu_s).

Each check or measurement is one JSON line appended to RES (and printed). `big` sends fresh
texts for every (repetition, format) so that no request hits the prefix cache of an earlier one;
the same seeds on both sides, so both get the same texts.
"""

from __future__ import annotations

import base64
import json
import os
import random
import statistics
import sys
import time

import httpx
import numpy as np
import openai
import orjson
import struct

MODEL = os.environ.get("EMB_MODEL", "m135")
DIM = int(os.environ.get("EMBED_DIM", 576))  # SmolLM2-135M's hidden size; m8b: 4096
SHORT = ["The cat sat on the mat.", "A cat is sitting on a mat.",
         "Stock markets fell sharply after the central bank raised interest rates."]
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education "
         "river garden window market letter paper music island bridge station engine winter summer animal forest").split()
N_BIG = 1024


def emit(res: str, **rec: object) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    with open(res, "a") as f:
        f.write(line + "\n")


def b64_vec(s: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype="<f4")


TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime+stime in seconds) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def cpu_snapshot() -> dict[str, float]:
    spec = [kv.split("=") for kv in os.environ.get("CPU_PIDS", "").split(",") if "=" in kv]
    if not spec:
        return {}
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None:
                table[int(d)] = st
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out = {}
    for name, pid_s in spec:
        pid = int(pid_s)
        out[f"{name}_cpu_s"] = table.get(pid, (0, 0.0))[1]
        total, todo = 0.0, list(kids.get(pid, []))
        while todo:
            c = todo.pop()
            total += table[c][1]
            todo.extend(kids.get(c, []))
        out[f"{name}_children_cpu_s"] = total
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before[k], 3) for k in before if k in after}


def texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Note {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(44)) + "." for i in range(N_BIG)]


def short(url: str, side: str, vec_out: str, res: str) -> None:
    ok = True
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    fl = sdk.embeddings.create(model=MODEL, input=SHORT, encoding_format="float")
    floats = np.array([d.embedding for d in fl.data], dtype=np.float64)
    idx = [d.index for d in fl.data]
    dims = sorted({len(d.embedding) for d in fl.data})
    norms = [round(float(np.linalg.norm(v)), 6) for v in floats]
    rec = dict(side=side, test="short_float_sdk", count=len(fl.data), index=idx, dims=dims, norms=norms,
               prompt_tokens=fl.usage.prompt_tokens, total_tokens=fl.usage.total_tokens,
               ok=len(fl.data) == 3 and idx == [0, 1, 2] and dims == [DIM] and fl.usage.prompt_tokens > 0)
    ok &= rec["ok"]
    emit(res, **rec)
    with httpx.Client(timeout=120) as http:
        r = http.post(url + "/v1/embeddings", json={"model": MODEL, "input": SHORT, "encoding_format": "base64"})
        body = r.json()
        data = body.get("data", [])
        raw = [b64_vec(d["embedding"]) if isinstance(d.get("embedding"), str) else None for d in data]
        diffs = [float(np.max(np.abs(v.astype(np.float64) - floats[i]))) if v is not None and len(v) == DIM else None
                 for i, v in enumerate(raw)]
        # exactly the same float32: each parsed float packed as '<f' equals the base64's 4 bytes
        f32_equal, f32_values = 0, 0
        for i, d in enumerate(data):
            e = d.get("embedding")
            if isinstance(e, str) and i < len(floats):
                raw_b = base64.b64decode(e)
                f32_values += len(floats[i])
                f32_equal += sum(struct.pack("<f", float(x)) == raw_b[4 * j:4 * j + 4] for j, x in enumerate(floats[i]))
        rec = dict(side=side, test="short_base64_raw", status=r.status_code, count=len(data),
                   f32_values=f32_values, f32_bit_equal=f32_equal, f32_exact=f32_values == 3 * DIM and f32_equal == f32_values,
                   index=[d.get("index") for d in data], strings=all(isinstance(d.get("embedding"), str) for d in data),
                   dims=sorted({len(v) for v in raw if v is not None}), max_abs_diff_vs_float=diffs,
                   prompt_tokens=(body.get("usage") or {}).get("prompt_tokens"))
        rec["ok"] = (r.status_code == 200 and rec["count"] == 3 and rec["index"] == [0, 1, 2] and rec["strings"]
                     and rec["dims"] == [DIM] and all(d is not None and d <= 1e-6 for d in diffs)
                     and (rec["prompt_tokens"] or 0) > 0)
        ok &= rec["ok"] and rec["f32_exact"]
        emit(res, **rec)
    # The SDK's default: it asks for base64 and decodes it (float32).
    de = sdk.embeddings.create(model=MODEL, input=SHORT)
    dec = [np.array(d.embedding, dtype=np.float64) for d in de.data]
    diffs = [float(np.max(np.abs(v - floats[i]))) if len(v) == DIM else None for i, v in enumerate(dec)]
    rec = dict(side=side, test="short_sdk_default_base64", count=len(de.data), index=[d.index for d in de.data],
               dims=sorted({len(v) for v in dec}), max_abs_diff_vs_float=diffs, prompt_tokens=de.usage.prompt_tokens)
    rec["ok"] = (rec["count"] == 3 and rec["index"] == [0, 1, 2] and rec["dims"] == [DIM]
                 and all(d is not None and d <= 1e-6 for d in diffs) and de.usage.prompt_tokens > 0)
    ok &= rec["ok"]
    emit(res, **rec)
    with open(vec_out, "w") as f:
        json.dump({"side": side, "vectors": floats.tolist()}, f)
    emit(res, side=side, test="short_all", ok=bool(ok))


def one_big(http: httpx.Client, url: str, inputs: list[str], fmt: str, keep: list | None = None) -> dict[str, object]:
    payload = json.dumps({"model": MODEL, "input": inputs, "encoding_format": fmt}).encode()
    c0 = cpu_snapshot()
    t0 = time.perf_counter()
    r = http.post(url + "/v1/embeddings", content=payload, headers={"content-type": "application/json"})
    wall = time.perf_counter() - t0
    cpu = cpu_delta(c0, cpu_snapshot())
    rec: dict[str, object] = dict(fmt=fmt, status=r.status_code, wall_s=round(wall, 4), body_bytes=len(r.content),
                                  request_bytes=len(payload), content_encoding=r.headers.get("content-encoding"), **cpu)
    if r.status_code != 200:
        rec.update(ok=False, error=r.text[:500])
        return rec
    body = orjson.loads(r.content)
    data = body.get("data", [])
    good = 0
    bad_norm = 0
    for i, d in enumerate(data):
        e = d.get("embedding")
        v = b64_vec(e) if fmt == "base64" and isinstance(e, str) else (np.array(e, dtype=np.float64)
                                                                       if isinstance(e, list) else None)
        if d.get("index") == i and v is not None and len(v) == DIM and bool(np.all(np.isfinite(v))):
            good += 1
            if abs(float(np.linalg.norm(v)) - 1) > 1e-3:
                bad_norm += 1
        if keep is not None:
            keep.append(v)
    usage = body.get("usage") or {}
    rec.update(count=len(data), vectors_ok=good, not_unit_norm=bad_norm, prompt_tokens=usage.get("prompt_tokens"),
               tokens_per_input=round((usage.get("prompt_tokens") or 0) / N_BIG, 1),
               ok=len(data) == N_BIG and good == N_BIG)
    return rec


def big(url: str, side: str, res: str, reps: int) -> None:
    with httpx.Client(timeout=180) as http:
        kf: list = []
        kb: list = []
        w = one_big(http, url, texts(999), "float", kf)  # warm-up, not counted
        emit(res, side=side, test="big_warmup", **w)
        # the same 1,024 texts again as base64 (not timed; prefix cache hits): float32-exact against the float?
        w = one_big(http, url, texts(999), "base64", kb)
        exact = None
        if len(kf) == len(kb) == N_BIG and all(a is not None and b is not None and len(a) == len(b) == DIM
                                               for a, b in zip(kf, kb)):
            fa = np.stack([np.asarray(a, dtype=np.float64) for a in kf])
            ba = np.stack(kb)
            same = fa.astype("<f4").view("<u4") == ba.view("<u4")
            exact = dict(values=int(same.size), bit_equal=int(same.sum()), vectors_all_equal=int(same.all(axis=1).sum()),
                         max_abs_diff=float(np.max(np.abs(fa - ba.astype(np.float64)))))
        emit(res, side=side, test="big_exact_pair", f32=exact, ok=bool(exact and exact["values"] == exact["bit_equal"]),
             **{k: v for k, v in w.items() if k in ("status", "wall_s", "body_bytes", "count", "vectors_ok")})
        del kf, kb
        walls: dict[str, list[float]] = {"float": [], "base64": []}
        cpus: dict[str, list[dict]] = {"float": [], "base64": []}
        for rep in range(reps):
            for k, fmt in enumerate(("float", "base64")):
                rec = one_big(http, url, texts(2 * rep + k), fmt)
                emit(res, side=side, test="big", rep=rep, **rec)
                if rec.get("ok"):
                    walls[fmt].append(float(rec["wall_s"]))  # type: ignore[arg-type]
                    cpus[fmt].append({k: v for k, v in rec.items() if k.endswith("cpu_s")})
        for fmt, ws in walls.items():
            if ws:
                cs = cpus[fmt]
                cpu_med = {k: round(statistics.median(c[k] for c in cs), 3) for k in (cs[0] if cs else {})}
                cpu_rng = {k: [min(c[k] for c in cs), max(c[k] for c in cs)] for k in (cs[0] if cs else {})}
                emit(res, side=side, test="big_summary", fmt=fmt, n=len(ws), median_s=round(statistics.median(ws), 4),
                     min_s=min(ws), max_s=max(ws), cpu_median=cpu_med, cpu_range=cpu_rng)
    # The SDK's default (base64, decoded by the SDK) once, timed with its parsing.
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=180)
    t0 = time.perf_counter()
    out = sdk.embeddings.create(model=MODEL, input=texts(998))
    wall = time.perf_counter() - t0
    good = sum(1 for i, d in enumerate(out.data) if d.index == i and len(d.embedding) == DIM)
    emit(res, side=side, test="big_sdk_default", wall_s=round(wall, 4), count=len(out.data), vectors_ok=good,
         prompt_tokens=out.usage.prompt_tokens, ok=good == N_BIG)


def compare(a: str, b: str, res: str) -> None:
    va, vb = (json.load(open(p)) for p in (a, b))
    out = []
    for x, y in zip(va["vectors"], vb["vectors"], strict=True):
        x, y = np.array(x), np.array(y)
        out.append(dict(max_abs_diff=float(np.max(np.abs(x - y))),
                        cosine=float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))),
                        f32_bit_equal=bool(np.array_equal(x.astype("<f4").view("<u4"), y.astype("<f4").view("<u4")))))
    emit(res, test="compare_short", a=va["side"], b=vb["side"], per_input=out,
         **{"f32_all_bit_equal": all(o["f32_bit_equal"] for o in out), "same_within_1e-6": all(o["max_abs_diff"] <= 1e-6 for o in out),
            "same_within_1e-3": all(o["max_abs_diff"] <= 1e-3 for o in out)})


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    try:
        if cmd == "short":
            short(*args)
        elif cmd == "big":
            big(args[0], args[1], args[2], int(args[3]) if len(args) > 3 else 3)
        elif cmd == "compare":
            compare(*args)
        else:
            sys.exit(f"unknown command {cmd}")
    except Exception as exc:  # a failure is a result too
        res = args[2] if cmd in ("big", "compare") else args[3]
        emit(res, test=f"{cmd}_exception", side=args[1] if cmd != "compare" else None,
             error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
