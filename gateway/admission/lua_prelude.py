"""Admission's Lua scripts, each given only the prelude's functions it calls, each defined
where it is first needed.

Redis runs a script's whole text at every call, and each ``local function`` statement
makes a new closure then, capturing its upvalues (Lua 5.1 finds each one by walking the
list of the chunk's open upvalues). The shared prelude defines some 45 functions; every
script defined all of them, at every call: about 20 µs of a script's time, and a request runs
two (timed alone in Redis on this machine; a script returning at once took 5 µs). A release
with nobody waiting, the common one, calls three of them.

So a script is assembled in parts: the prelude's plain statements (keys, arguments,
Redis's clock, constants), then each part preceded by the definitions it calls
(transitively) that no earlier part defined, in the prelude's order. A part after an early
``return`` (the queue's machinery, reached only when someone waits) makes its closures
only when it runs.

>>> prelude = Prelude(source)                      # doctest: +SKIP
>>> RELEASE = prelude.script(common, when_busy)    # doctest: +SKIP
"""

from __future__ import annotations

import re

_DEFINITION = re.compile(r"^local function (\w+)")
#: A definition's last line: ``end`` at the start of a line (a comment may follow it).
_END = re.compile(r"^end\s*(--.*)?$")
#: A definition in one line: ``local function f(x) return x end``.
_ONE_LINE = re.compile(r"^local function \w+\(.*\).*\bend$")
_COMMENT = re.compile(r"--.*$", re.M)


class Prelude:
    """Lua source made of plain top-level statements and ``local function`` definitions,
    each ending with an ``end`` at the start of a line."""

    def __init__(self, source: str) -> None:
        self._head: list[str] = []
        #: name -> (its text with the comments above it, the prelude's functions it calls)
        self._functions: dict[str, tuple[str, set[str]]] = {}
        comments: list[str] = []
        lines = iter(source.splitlines())
        for line in lines:
            found = _DEFINITION.match(line)
            if found is None:
                if line.startswith("--") or not line.strip():
                    comments.append(line)
                elif _END.match(line):
                    raise ValueError(f"an 'end' outside the prelude's functions, after {self._head[-1:]!r}")
                else:
                    self._head.append(line)
                    comments = []
                continue
            body = [line]
            if not _ONE_LINE.match(_COMMENT.sub("", line).rstrip()):  # (its comment may say "end")
                for inner in lines:
                    if _DEFINITION.match(inner):
                        raise ValueError(f"the prelude's function {found[1]!r} has no 'end' at the start of a line "
                                         "before the next definition")
                    body.append(inner)
                    if _END.match(inner):
                        break
                else:
                    raise ValueError(f"the prelude's function {found[1]!r} has no 'end' at the start of a line")
            self._functions[found[1]] = ("\n".join([*comments, *body]), set())
            comments = []
        for name, (text, calls) in self._functions.items():
            calls.update(self._called(text) - {name})
        for line in self._head:
            if self._called(line):
                raise ValueError(f"a plain statement of the prelude calls one of its functions: {line!r}")

    @property
    def functions(self) -> list[str]:
        """The names of the prelude's functions, in its order."""
        return list(self._functions)

    def _called(self, code: str) -> set[str]:
        words = set(re.findall(r"\b\w+\b", _COMMENT.sub("", code)))
        return {name for name in self._functions if name in words}

    def needs(self, code: str) -> list[str]:
        """The prelude's functions ``code`` calls, with theirs, in the prelude's order."""
        wanted: set[str] = set()
        todo = list(self._called(code))
        while todo:
            name = todo.pop()
            if name not in wanted:
                wanted.add(name)
                todo.extend(self._functions[name][1])
        return [name for name in self._functions if name in wanted]

    def script(self, *parts: str) -> str:
        """The plain statements, then each part after the definitions it needs that no
        earlier part got."""
        out, defined = ["\n".join(self._head)], set()
        for part in parts:
            for name in self.needs(part):
                if name not in defined:
                    defined.add(name)
                    out.append(self._functions[name][0])
            out.append(part)
        return "\n".join(out) + "\n"
