"""The routing bench's workloads: the conversations a closed loop of users sends.

Sizes are in words (about one token each with the default model's tokenizer, see
``loadtest/prefix_vllm.py``'s WORDS) and relative to the fleet's KV cache: ``cache_tokens``
is one worker's cache, so the four caches hold ``4 * cache_tokens``.

- easy: ``groups`` system prefixes together about half the fleet's caches, every group
  asked in turn, round after round (the issue's first regime);
- overflow: prefixes together ``overflow_x`` times the fleet's caches, Zipf popularity,
  a share of requests continuing multi-turn sessions (their history grows turn by turn);
- w5: no shared prefix (every prompt new): the control, where routing can only balance;
- chat: multi-turn sessions on one short system prompt, each turn adds the answer and a
  new question.

A name may carry its own settings: ``overflow-z0.6`` is overflow with Zipf exponent 0.6,
``overflow-x1.5`` with prefixes 1.5 times the caches (:func:`resolve`), so one fleet runs
several shapes of a workload.

A plan is an endless stream of sessions (a single-turn request is a session of one
turn), drawn as users pick them up: an arm runs for a time, not a count. For multi-turn
sessions the client appends the model's answer before the session's next turn is sent
(:class:`Session`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from loadtest.prefix_vllm import WORDS


def text(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


@dataclass
class Session:
    """A conversation whose turns are sent one after another by the same user."""

    system: str
    questions: list[str]
    history: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, *self.history,
                {"role": "user", "content": self.questions[self.turn]}]

    def answered(self, answer: str) -> None:
        self.history += [{"role": "user", "content": self.questions[self.turn]},
                         {"role": "assistant", "content": answer}]
        self.turn += 1

    @property
    def done(self) -> bool:
        return self.turn >= len(self.questions)


@dataclass(frozen=True)
class Sizes:
    cache_tokens: int
    prefix_words: int = 1000
    overflow_x: float = 1.75
    easy_share: float = 0.5
    zipf_s: float = 0.9
    session_share: float = 0.25
    turns: int = 4
    question_words: int = 24


def zipf_weights(n: int, s: float) -> list[float]:
    return [1 / (k + 1) ** s for k in range(n)]


def resolve(name: str, sizes: Sizes) -> tuple[str, Sizes]:
    """A workload's name less its settings, and the sizes with them applied:
    ``overflow-z0.6-x1.5`` -> ("overflow", zipf_s=0.6, overflow_x=1.5)."""
    base, *opts = name.split("-")
    fields = {"z": "zipf_s", "x": "overflow_x"}
    for opt in opts:
        if opt[:1] not in fields:
            raise ValueError(f"unknown workload setting {opt!r} in {name!r} (z: Zipf exponent, x: overflow factor)")
        sizes = replace(sizes, **{fields[opt[0]]: float(opt[1:])})
    return base, sizes


def groups_of(name: str, sizes: Sizes) -> int:
    """How many shared prefixes the workload draws from (0: none shared)."""
    name, sizes = resolve(name, sizes)
    fleet = 4 * sizes.cache_tokens
    share = {"easy": sizes.easy_share, "overflow": sizes.overflow_x}.get(name)
    return max(2, round(share * fleet / sizes.prefix_words)) if share else 0


def plan(name: str, tag: str, sizes: Sizes, seed: int) -> Iterator[Session]:
    """The workload as an endless stream of sessions, in the order users pick them up."""
    rng = random.Random(seed)
    groups = groups_of(name, sizes)
    name, sizes = resolve(name, sizes)

    @cache
    def prefix(g: int) -> str:  # one text per group: drawn once, not per request
        return f"{tag} group {g}. " + text(random.Random(f"{tag}-{g}"), sizes.prefix_words)

    def question() -> str:
        return text(rng, sizes.question_words) + "?"

    if name == "easy":  # every group in turn, round after round, each round shuffled
        while True:
            order = list(range(groups))
            rng.shuffle(order)
            yield from (Session(prefix(g), [question()]) for g in order)
    elif name == "overflow":
        weights = zipf_weights(groups, sizes.zipf_s)
        while True:
            (g,) = rng.choices(range(groups), weights)
            turns = sizes.turns if rng.random() < sizes.session_share else 1
            yield Session(prefix(g), [question() for _ in range(turns)])
    elif name == "w5":
        i = 0
        while True:
            yield Session(f"{tag} unique {i}. " + text(rng, sizes.prefix_words), [question()])
            i += 1
    elif name == "chat":
        system = f"{tag}. You are a helpful assistant. " + text(random.Random(tag), 64)
        while True:
            yield Session(system, [text(rng, 4 * sizes.question_words) + "?" for _ in range(sizes.turns)])
    else:
        raise ValueError(f"unknown workload {name}")


def describe(name: str, sizes: Sizes) -> dict[str, Any]:
    """What the workload's shared prefixes weigh against the fleet's caches."""
    groups = groups_of(name, sizes)
    name, sizes = resolve(name, sizes)
    if not groups:
        return {"groups": 0, "prefix_x_fleet_cache": 0.0}
    out = {"groups": groups, "prefix_words": sizes.prefix_words,
           "prefix_x_fleet_cache": round(groups * sizes.prefix_words / (4 * sizes.cache_tokens), 2)}
    return out | ({"zipf_s": sizes.zipf_s} if name == "overflow" else {})
