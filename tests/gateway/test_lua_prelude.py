"""The assembly of admission's Lua scripts: each part gets the prelude's functions it calls,
before it, once (gateway/admission/lua_prelude.py)."""

from __future__ import annotations

import re

import pytest

from gateway.admission import scripts
from gateway.admission.lua_prelude import Prelude

SOURCE = """local A = KEYS[1]
-- leaf: no calls
local function leaf()
  return A
end
local function unused()
  return 2
end
local function middle()
  return leaf() + 1  -- unused() named in a comment is no call
end
local K = 3
local function top()
  return middle() * K
end
"""


def defined(script: str) -> list[str]:
    return re.findall(r"^local function (\w+)", script, re.M)


def test_a_part_gets_what_it_calls_with_theirs_in_the_preludes_order() -> None:
    script = Prelude(SOURCE).script("return top()\n")
    assert defined(script) == ["leaf", "middle", "top"]
    assert script.index("local K = 3") < script.index("local function leaf")  # plain statements first
    assert "-- leaf: no calls" in script  # a function's comments go with it


def test_a_later_part_gets_only_what_earlier_parts_did_not() -> None:
    script = Prelude(SOURCE).script("if x then return leaf() end\n", "return top()\n")
    early, late = script.split("if x then return leaf() end")
    assert defined(early) == ["leaf"]
    assert defined(late) == ["middle", "top"]


def test_a_part_that_calls_nothing_gets_nothing() -> None:
    assert defined(Prelude(SOURCE).script("return 1\n")) == []


@pytest.mark.parametrize("source", [
    "local function f()\n  return 1\n",  # no end
    "local x = f()\nlocal function f()\nend\n",  # a plain statement that calls a function
    "local function f()\n  return 1\nlocal function g()\nend\n",  # a definition inside one
    "local function f() if x then return 1 end\n  return 2\nend\n",  # taken for one line: its end is stray
])
def test_a_prelude_it_cannot_split_is_refused(source: str) -> None:
    with pytest.raises(ValueError):
        Prelude(source)


def test_a_release_with_nobody_waiting_defines_three_functions_and_the_queue_path_the_rest() -> None:
    """Regression: every script defined all ~45 prelude functions at each call (about 20 µs
    of Redis's time a script); a release with nobody waiting calls three."""
    common, busy = scripts.RELEASE.split("if not busy then return freed end")
    assert defined(common) == ["prefill_done", "free_lease", "waiting"]
    assert "pump" in defined(busy) and "live_workers" in defined(busy)
    granted, queued = scripts.ACQUIRE.split("    meta.blocks = nil\n  end\nend\n")
    assert "pump" not in defined(granted) and "pump" in defined(queued)


def test_a_function_in_one_line_is_one_function() -> None:
    """Regression: ``local function is_urgent(p) return p <= urgent_max end`` took every line
    up to the next function's ``end``, and a script calling only that next one lacked it."""
    source = "local function one(x) return x end  -- short\nlocal function two()\n  return 2\nend\n"
    assert Prelude(source).functions == ["one", "two"]
    assert defined(Prelude(source).script("return two()\n")) == ["two"]


SCRIPTS = [name for name, value in vars(scripts).items() if name.isupper() and isinstance(value, str)
           and "redis.call" in value]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_prelude_function_a_script_names_is_defined_in_it(name: str) -> None:
    """A function left out would be a nil global, an error only on the path that calls it."""
    source = getattr(scripts, name)
    code = re.sub(r"--.*$", "", source, flags=re.M)
    named = {f for f in scripts.PRELUDE.functions if re.search(rf"\b{f}\b", code)}
    assert named <= set(defined(source))
