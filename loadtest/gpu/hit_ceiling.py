"""Prefix-cache hit ceiling for the GPU routing bench's "overflow" workload.

Regenerates the request stream with the repo's own generator (loadtest/gpu/workloads.py:
plan/Sizes/groups_of, imported), tokenizes with the bench's tokenizer (SmolLM2-135M-Instruct,
the same tokenizer.json as .gpu/kit/tok) and the model's chat template, replays a closed loop of
64 users, and simulates 4 workers, each an LRU cache of 2,048 blocks of 16 tokens (vLLM's
free-block queue: blocks released tail-first, so a request's head blocks are the most recent).
Hit = leading full cached blocks * 16 / prompt tokens (vLLM's cached_tokens), summed over
requests.

    .venv/bin/python -m loadtest.gpu.hit_ceiling            (about 1-3 min of one core)
    .venv/bin/python -m loadtest.gpu.hit_ceiling --quick    (baseline only)

What it found (README, "Overflow: the hit rate no router can pass"): round robin gets ~47 %
from the popular prefixes every worker caches, so the best oracle reaches ~1.9x of it. And
"the slow tenth": even the oracle leaves ~12.5 % of requests missing their whole prefix at
Zipf 0.9, so the P90 request prefills a whole prefix under any router. Misses fall under a
tenth only at Zipf ~1.1 and above, where the hit rate's 2x is out of reach: with LRU caches
no popularity meets both of issue 24's overflow goals (pinning the hottest prefixes would).
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
from collections import OrderedDict
from dataclasses import replace

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from tokenizers import Tokenizer  # noqa: E402

from loadtest.gpu.workloads import Sizes, groups_of, plan, zipf_weights  # noqa: E402
from sluice.models import default_model_dir  # noqa: E402

BLOCK = 16          # vLLM block size (fleet.py FleetShape.block_tokens=16 for engine vllm)
KV_BLOCKS = 2048    # routing_gpu.py --kv-blocks default (num_gpu_blocks_override)
WORKERS = 4         # routing_gpu.py --workers
USERS = 64          # routing_gpu.py --users
MAX_TOKENS = 32     # routing_gpu.py --max-tokens; client sends ignore_eos=True
PREFIX_WORDS = 1500  # routing_gpu.py --prefix-words
TOKENIZER = str(default_model_dir() / "tokenizer.json")  # the default model's: `make install` puts it there

tok = Tokenizer.from_file(TOKENIZER)


def ntok(s: str) -> int:
    return len(tok.encode(s, add_special_tokens=False).ids)


# SmolLM2 chat template: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then
# "<|im_start|>assistant\n". Special tokens split the text, so lengths add up per segment.
ASSIST_HDR = ntok("assistant\n")  # 3
USER_HDR = ntok("user\n")         # 2


def user_msg(q_tokens: int) -> int:   # <|im_start|> user\n q <|im_end|> \n
    return 1 + USER_HDR + q_tokens + 2


def answer_msg() -> int:              # <|im_start|> assistant\n answer <|im_end|> \n
    return 1 + ASSIST_HDR + MAX_TOKENS + 2


GEN = 1 + ASSIST_HDR                  # generation prompt


class Req:
    __slots__ = ("g", "sid", "turn", "L", "keys", "nprompt", "t0", "t1", "worker")


def build(sizes: Sizes, seed: int, n_req: int, answer_match: bool = True, tag: str | None = None):
    """The closed loop's requests in start order plus the start/end event sequence (policy-free:
    service times do not depend on routing, so every policy sees the same order)."""
    tag = tag or f"overflow-rr-{seed}"
    sessions = plan("overflow", tag, sizes, seed)
    rng = random.Random(seed + 12345)
    sys_len: dict[str, int] = {}
    group_of: dict[str, int] = {}
    reqs: list[Req] = []
    events: list[tuple[int, Req]] = []  # (0 start | 1 end, req)
    heap = [(0.0, u) for u in range(USERS)]  # closed loop: a user is free at t
    user_state: dict[int, list] = {}
    sid_counter = 0
    t = 0.0
    pending_ends: list = []
    while len(reqs) < n_req:
        t, u = heapq.heappop(heap)
        while pending_ends and pending_ends[0][0] <= t:
            _, _, r = heapq.heappop(pending_ends)
            events.append((1, r))
        st = user_state.get(u)
        if st is None or st[2] >= len(st[1].questions):
            s = next(sessions)
            if s.system not in sys_len:
                sys_len[s.system] = 1 + ntok("system\n" + s.system) + 2
                group_of[s.system] = int(s.system.split(" group ")[1].split(".")[0])
            sid_counter += 1
            st = user_state[u] = [sid_counter, s, 0, sys_len[s.system], []]  # sid, session, turn, L, ends
        sid, s, turn, base, _ = st
        S = sys_len[s.system]
        g = group_of[s.system]
        shared = S + 1 + USER_HDR  # tokens common to every prompt of group g
        qt = ntok(s.questions[turn])
        L = base + user_msg(qt) + GEN
        r = Req()
        r.g, r.sid, r.turn, r.L = g, sid, turn, L
        nb_prompt = L // BLOCK
        nb_all = (L + MAX_TOKENS - 1) // BLOCK  # KV exists for prompt + 31 output tokens
        gb = shared // BLOCK
        keys = []
        for i in range(nb_all):
            if i < gb:
                keys.append(g * 100000 + i)
            elif i < nb_prompt or answer_match:
                keys.append(-(sid * 100000 + i))          # session block (prompts are prefixes of later turns)
            else:
                keys.append(-(10**12 + (sid * 10 + turn) * 100000 + i))  # output block, never reused
        r.keys, r.nprompt = keys, nb_prompt
        reqs.append(r)
        events.append((0, r))
        dur = rng.uniform(0.8, 1.2)
        heapq.heappush(pending_ends, (t + dur, len(reqs), r))
        st[2] += 1
        st[3] = L - GEN + answer_msg()  # next turn's history: this prompt less gen prompt + the answer msg
        heapq.heappush(heap, (t + dur, u))
    while pending_ends:
        events.append((1, heapq.heappop(pending_ends)[2]))
    return reqs, events


def greedy_partition(weights, workers=WORKERS, replicate=0):
    """Each group on one worker (the top `replicate` on two), greedily balancing expected load."""
    load = [0.0] * workers
    assign: dict[int, list[int]] = {}
    for g in sorted(range(len(weights)), key=lambda g: -weights[g]):
        k = 2 if g < replicate else 1
        share = weights[g] / k
        ws = []
        for _ in range(k):
            w = min((w for w in range(workers) if w not in ws), key=lambda w: load[w])
            load[w] += share
            ws.append(w)
        assign[g] = ws
    return assign, load


def simulate(reqs, events, policy, weights, warm_frac=0.2, pin=0, replicate=0, seed=0, tails=None):
    rng = random.Random(seed)
    lru = [OrderedDict() for _ in range(WORKERS)]
    pinned = [set() for _ in range(WORKERS)]
    cap = [KV_BLOCKS] * WORKERS
    inflight = [0] * WORKERS
    assign = None
    if policy.startswith("partition"):
        assign, _ = greedy_partition(weights, replicate=replicate)
        if pin:
            gb = {}
            for r in reqs:
                gb[r.g] = max(gb.get(r.g, 0), sum(1 for k in r.keys if k >= 0))
            for w in range(WORKERS):
                mine = sorted((g for g, ws in assign.items() if w in ws), key=lambda g: -weights[g])[:pin]
                for g in mine:
                    pinned[w].update(g * 100000 + i for i in range(gb.get(g, 94)))
                cap[w] = KV_BLOCKS - len(pinned[w])
    sess_worker: dict[int, int] = {}
    rr = 0
    warm = int(len(reqs) * warm_frac)
    idx = {id(r): i for i, r in enumerate(reqs)}
    hit = tot = 0
    uncached: list[int] = []  # per measured request: prompt tokens it must prefill
    for kind, r in events:
        if kind == 0:
            if policy == "rr":
                w = rr % WORKERS
                rr += 1
            elif policy == "least":
                m = min(inflight)
                w = rng.choice([i for i in range(WORKERS) if inflight[i] == m])
            else:
                ws = assign[r.g]
                if r.turn > 0 and r.sid in sess_worker:
                    w = sess_worker[r.sid]
                elif len(ws) == 1:
                    w = ws[0]
                else:
                    w = min(ws, key=lambda x: (inflight[x], rng.random()))
            sess_worker[r.sid] = w
            r.worker = w
            inflight[w] += 1
            c, p = lru[w], pinned[w]
            h = 0
            for k in r.keys[: r.nprompt]:
                if k in p or k in c:
                    h += 1
                else:
                    break
            if h * BLOCK >= r.L:
                h = (r.L - 1) // BLOCK
            if idx[id(r)] >= warm:
                hit += h * BLOCK
                tot += r.L
                uncached.append(r.L - h * BLOCK)
            _touch(c, p, r.keys[: r.nprompt], cap[w])  # allocated (and hashed) at start
        else:
            w = r.worker
            inflight[w] -= 1
            c, p = lru[w], pinned[w]
            _touch(c, p, reversed(r.keys), cap[w])  # freed tail-first: the head ends most recent
    if tails is not None:
        uncached.sort()
        tails.update(p90=uncached[int(0.9 * len(uncached))], p50=uncached[len(uncached) // 2],
                     missed=100 * sum(u >= MISS_TOKENS for u in uncached) / len(uncached))
    return 100 * hit / tot


#: A request that prefills at least this many prompt tokens missed its shared prefix (the
#: prefixes are ~2,000 tokens; a hit leaves the question and the last partial block, ~30).
MISS_TOKENS = 1000


def tail_of(reqs, events, policy, weights, **kw) -> dict:
    """What the slowest requests prefill under ``policy``: the P50 and P90 of each measured
    request's uncached prompt tokens, the share (%) that missed its prefix, and the hit rate."""
    tails: dict = {}
    tails["hit"] = simulate(reqs, events, policy, weights, tails=tails, **kw)
    return tails


def _touch(cache: OrderedDict, pinned: set, blocks, cap: int) -> None:
    """Mark ``blocks`` most recently used in ``cache`` (pinned ones stay out of it), then evict
    the least recently used past ``cap``."""
    for k in blocks:
        if k in pinned:
            continue
        if k in cache:
            cache.move_to_end(k)
        else:
            cache[k] = None
    while len(cache) > cap:
        cache.popitem(last=False)


def ceiling(reqs, warm_frac=0.2):
    """Static ceiling: prefixes cached once each, most valuable first, packed into 4 x 2,048 blocks
    (first-fit); a request hits its prefix's full blocks, later turns also their whole history
    (same worker). 'loose': every later turn hits its history even when its prefix is not cached."""
    warm = int(len(reqs) * warm_frac)
    rs = reqs[warm:]
    gb, value, count = {}, {}, {}
    for r in rs:
        n = sum(1 for k in r.keys if k >= 0)
        gb[r.g] = n
        value[r.g] = value.get(r.g, 0) + n
        count[r.g] = count.get(r.g, 0) + 1
    free = [KV_BLOCKS] * WORKERS
    chosen = set()
    for g in sorted(value, key=lambda g: -value[g] / gb[g]):
        for w in range(WORKERS):
            if free[w] >= gb[g]:
                free[w] -= gb[g]
                chosen.add(g)
                break
    tot = sum(r.L for r in rs)
    prev_len: dict[int, int] = {}
    strict = loose = inf = 0
    seen: set = set()
    first = warm
    for i, r in enumerate(reqs):
        if r.turn == 0:
            hg = sum(1 for k in r.keys if k >= 0)
            h = hg
        else:
            h = min(prev_len[r.sid], r.nprompt)
            hg = sum(1 for k in r.keys if k >= 0)
        if h * BLOCK >= r.L:
            h = (r.L - 1) // BLOCK
        prev_len[r.sid] = sum(1 for k in r.keys if k >= 0 or k > -10**12)
        new = r.turn == 0 and r.g not in seen
        seen.add(r.g)
        if i < first:
            continue
        if not new:
            inf += h * BLOCK
        if r.g in chosen:
            strict += h * BLOCK
            loose += h * BLOCK
        elif r.turn > 0:
            loose += h * BLOCK
    share = sum(count[g] for g in chosen) / len(rs)
    return 100 * strict / tot, 100 * loose / tot, len(chosen), 100 * share, 100 * inf / tot



def baseline(sizes, seeds, n_req, answer_match=True):
    groups = groups_of("overflow", sizes)
    weights = zipf_weights(groups, sizes.zipf_s)
    tw = sum(weights)
    weights = [w / tw for w in weights]
    rows = {}
    for seed in seeds:
        reqs, events = build(sizes, seed, n_req, answer_match)
        res = {"rr": simulate(reqs, events, "rr", weights),
               "least": simulate(reqs, events, "least", weights, seed=seed)}
        res["partition"] = simulate(reqs, events, "partition", weights)
        best_pin = max(((simulate(reqs, events, "partition", weights, pin=p), p) for p in (8, 12, 14, 16, 18, 19, 20)))
        res["partition+pin"] = best_pin[0]
        res["pin_p"] = best_pin[1]
        best_rep = max(((simulate(reqs, events, "partition", weights, replicate=k), k) for k in (1, 2, 4, 8)))
        res["partition+repl"] = best_rep[0]
        res["repl_k"] = best_rep[1]
        c = ceiling(reqs)
        res["ceiling"], res["ceiling_loose"], res["ceil_groups"], res["ceil_req_share"], res["infinite"] = c
        res["prompt_avg"] = sum(r.L for r in reqs) / len(reqs)
        res["shared_blocks"] = sum(1 for k in reqs[0].keys if k >= 0)
        rows[seed] = res
    return groups, weights, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=3000, help="per arm (H200 arms: 1,000-4,300); first 20%% left out")
    ap.add_argument("--long", type=int, default=20000, help="steady-state run length")
    args = ap.parse_args()
    base = Sizes(cache_tokens=KV_BLOCKS * BLOCK, prefix_words=PREFIX_WORDS, overflow_x=1.75, zipf_s=0.9)
    groups, weights, _ = baseline(base, [], 0)
    print(f"overflow: groups={groups} zipf_s={base.zipf_s} overflow_x={base.overflow_x} session_share={base.session_share} "
          f"turns={base.turns} question_words={base.question_words} prefix_words={base.prefix_words}; "
          f"top-1 share {100 * weights[0]:.1f}%, top-21 {100 * sum(weights[:21]):.1f}%, top-84 {100 * sum(weights[:84]):.1f}%")
    keys = ["rr", "least", "partition", "partition+pin", "partition+repl", "ceiling", "ceiling_loose", "infinite"]

    def show(label, rows):
        for seed, r in rows.items():
            best = max(r["partition"], r["partition+pin"], r["partition+repl"])
            print(f"{label} seed={seed}: " + " ".join(f"{k}={r[k]:.1f}" for k in keys)
                  + f" | pin_p={r['pin_p']} repl_k={r['repl_k']} ceil_groups={r['ceil_groups']} "
                  f"ceil_req_share={r['ceil_req_share']:.1f}% prompt_avg={r['prompt_avg']:.0f} "
                  f"shared_blocks={r['shared_blocks']} | partition/rr={r['partition'] / r['rr']:.2f} "
                  f"best_oracle/rr={best / r['rr']:.2f} ceiling/rr={r['ceiling'] / r['rr']:.2f} "
                  f"loose/rr={r['ceiling_loose'] / r['rr']:.2f} infinite/rr={r['infinite'] / r['rr']:.2f}", flush=True)

    show(f"arm({args.requests})", baseline(base, [0, 1, 2], args.requests)[2])
    if args.quick:
        return
    print("the slow tenth: prompt tokens each request prefills (P50 / P90) and the share that missed its "
          f"prefix (>= {MISS_TOKENS} tokens to prefill), {args.requests} requests, seeds 0-2", flush=True)
    for z in (0.6, 0.8, 0.9, 1.0, 1.2):
        sz = replace(base, zipf_s=z)
        g = groups_of("overflow", sz)
        w = zipf_weights(g, sz.zipf_s)
        total = sum(w)
        w = [v / total for v in w]
        for seed in (0, 1, 2):
            reqs, events = build(sz, seed, args.requests)
            arms = {"rr": tail_of(reqs, events, "rr", w), "oracle": tail_of(reqs, events, "partition", w),
                    "oracle+pin": max((tail_of(reqs, events, "partition", w, pin=p) for p in (16, 20)),
                                      key=lambda t: -t["missed"])}
            print(f"  zipf {z} seed {seed}: " + "  ".join(
                f"{k} {t['p50']}/{t['p90']} tokens, {t['missed']:.1f}% missed" for k, t in arms.items())
                + f"  | hit oracle/rr {arms['oracle']['hit'] / arms['rr']['hit']:.2f}x", flush=True)
    show(f"long({args.long})", baseline(base, [7], args.long)[2])
    show(f"arm({args.requests}) answers-not-reused", baseline(base, [0], args.requests, answer_match=False)[2])
    print("aside: sweeps (rr vs best oracle = max(partition LRU, partition+pin)), 6,000 requests, seed 3", flush=True)
    for label, sz in ([(f"z={z}", replace(base, zipf_s=z)) for z in (0.5, 0.6, 0.7, 0.8, 1.0, 1.2)]
                      + [(f"x={x}", replace(base, overflow_x=x)) for x in (1.0, 1.25, 1.5, 2.5, 3.5, 5.0)]):
        g = groups_of("overflow", sz)
        w = zipf_weights(g, sz.zipf_s)
        tw = sum(w)
        w = [v / tw for v in w]
        reqs, events = build(sz, 3, 6000)
        rr = simulate(reqs, events, "rr", w)
        part = simulate(reqs, events, "partition", w)
        pin = max(simulate(reqs, events, "partition", w, pin=p) for p in (12, 16, 19, 20))
        c = ceiling(reqs)
        best = max(part, pin)
        print(f"  {label:7s} groups={g:4d} rr={rr:5.1f} partition={part:5.1f} partition+pin={pin:5.1f} "
              f"ceiling_loose={c[1]:5.1f} infinite={c[4]:5.1f} best/rr={best / rr:.2f} loose/rr={c[1] / rr:.2f}", flush=True)


if __name__ == "__main__":
    main()
