"""Key patterns of the mapping language (``model.layers.{i}.mlp.{name}.weight``) and their matcher.

A placeholder matches one or more characters (digits only when it is an integer index; the same
text again when it repeats). The reference semantics is the anchored regular expression of
:func:`pattern_regex`, with lazy groups: the first placeholder takes the shortest text that lets
the rest match, and so on. A regex engine finds that by backtracking, which on a long key that
fails near its end costs a power of the key's length per placeholder (measured: 29 s for one
400-character key against ``{a}.{b}.{c}.{d}.weight``).

:class:`Pattern` finds the same match in one pass when every placeholder is a plain one (neither
an index nor repeated): the literal text between placeholders is searched left to right, each at
its first occurrence after at least one character (the earliest occurrence leaves the most room
for the rest, so it is the one the lazy groups settle on), and the last is anchored at the end.
Patterns with index or repeated placeholders check that their literals occur in that order
first (a necessary condition, one pass) and only then run the regex, whose digit and
back-reference groups cannot run past the literals. tests/test_mapping_pattern.py pins the fast
path to the regex on random patterns and keys.
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping as TMapping

__all__ = ["Pattern", "PLACEHOLDER", "pattern_regex"]

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def pattern_regex(pattern: str, known: TMapping[str, str] | None = None, ints: Iterable[str] = ()) -> re.Pattern[str]:
    """Anchored regex for ``pattern``; placeholders in ``known`` must equal the given text, those in
    ``ints`` match decimal digits only, a repeated one the same text again."""
    ints = set(ints)
    out, pos, seen = [], 0, set()
    for m in PLACEHOLDER.finditer(pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        name = m.group(1)
        if known is not None and name in known:
            out.append(re.escape(known[name]))
        elif name in seen:
            out.append(f"(?P={name})")
        else:
            out.append(f"(?P<{name}>[0-9]+)" if name in ints else f"(?P<{name}>.+?)")
            seen.add(name)
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out) + r"\Z")


class _Match:
    """The groups of a fast-path match (the part of ``re.Match`` the mapping uses)."""

    __slots__ = ("_groups",)

    def __init__(self, groups: dict[str, str]) -> None:
        self._groups = groups

    def groupdict(self) -> dict[str, str]:
        return dict(self._groups)

    def group(self, name: str) -> str:
        return self._groups[name]


class Pattern:
    """A compiled key pattern: :meth:`match` returns the groups (``groupdict()``, ``group(name)``)
    of the regex of :func:`pattern_regex`, or None, in time linear in the key for plain
    placeholders."""

    def __init__(self, pattern: str, known: TMapping[str, str] | None = None, ints: Iterable[str] = ()) -> None:
        ints = set(ints)
        self.regex = pattern_regex(pattern, known, ints)
        names: list[str] = []
        literals: list[str] = []
        text, pos = "", 0
        for m in PLACEHOLDER.finditer(pattern):
            text += pattern[pos:m.start()]
            name = m.group(1)
            pos = m.end()
            if known is not None and name in known:
                text += known[name]
                continue
            literals.append(text)
            names.append(name)
            text = ""
        literals.append(text + pattern[pos:])
        self._names = names
        self._literals = literals  # literals[k] precedes names[k]; the last one ends the key
        self._plain = len(set(names)) == len(names) and not (set(names) & ints)

    def _in_order(self, key: str) -> list[int] | None:
        """Where each middle literal first occurs (each at least one character after the previous
        text), or None when they cannot all fit with the anchored ends."""
        lits = self._literals
        if not key.startswith(lits[0]):
            return None
        pos, starts = len(lits[0]), []
        for lit in lits[1:-1]:
            j = key.find(lit, pos + 1) if lit else pos + 1
            if j < 0:
                return None
            starts.append(j)
            pos = j + len(lit)
        last = lits[-1]
        if not key.endswith(last) or len(key) - len(last) < pos + (1 if self._names else 0):
            return None
        return starts

    def match(self, key: str) -> re.Match[str] | _Match | None:
        if not self._names:
            return _Match({}) if key == self._literals[0] else None
        starts = self._in_order(key)
        if starts is None:
            return None
        if not self._plain or "\n" in key:  # the regex's '.' does not match a line feed
            return self.regex.match(key)
        groups, pos = {}, len(self._literals[0])
        for name, j, lit in zip(self._names, starts + [len(key) - len(self._literals[-1])], self._literals[1:]):
            groups[name] = key[pos:j]
            pos = j + len(lit)
        return _Match(groups)
