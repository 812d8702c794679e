"""bridges.mapping._pattern: the one-pass matcher of key patterns, pinned to its regex twin.

Random patterns (literals, plain, integer, repeated and known placeholders, adjacent ones
included) against random keys over a small alphabet, so that literals recur and placeholders
have many ways to split a key: the matcher and the anchored lazy regex agree on every key,
groups included. The long failing key that made the regex backtrack for tens of seconds is
answered (no timing is asserted; the figure is in bridges/mapping/_pattern.py).
"""
from __future__ import annotations

import random

import pytest

from bridges.mapping._pattern import Pattern, pattern_regex

ALPHABET = "ab1./"


def _pattern(rng: random.Random) -> tuple[str, dict[str, str], set[str]]:
    names = ["p", "q", "r", "s"]
    parts, used = [], []
    for _ in range(rng.randint(0, 4)):
        if rng.random() < 0.6:
            parts.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 3))))
        if used and rng.random() < 0.15:
            parts.append("{" + rng.choice(used) + "}")  # a repeated placeholder
        else:
            name = names[len(used) % len(names)] if len(used) < len(names) else rng.choice(names)
            used.append(name)
            parts.append("{" + name + "}")
    parts.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 3))))
    ints = {n for n in set(used) if rng.random() < 0.3}
    known = {n: rng.choice(["a", "1", "b.a"]) for n in set(used) - ints if rng.random() < 0.2}
    return "".join(parts), known, ints


@pytest.mark.parametrize("seed", range(4))
def test_matcher_agrees_with_the_regex(seed):
    rng = random.Random(seed)
    checked = matched = 0
    for _ in range(300):
        pattern, known, ints = _pattern(rng)
        fast, slow = Pattern(pattern, known, ints), pattern_regex(pattern, known, ints)
        for _ in range(40):
            key = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 12)))
            a, b = fast.match(key), slow.match(key)
            assert (a is None) == (b is None), (pattern, known, ints, key)
            if a is not None:
                assert a.groupdict() == b.groupdict(), (pattern, known, ints, key)
                matched += 1
            checked += 1
    assert matched > checked // 50  # the keys do exercise matches, not only refusals


def test_long_failing_key_is_answered_in_one_pass():
    """The key of the backtracking report: four placeholders, 400 characters, no ``.weight``
    suffix; control: the same key with the suffix matches with the lazy groups' split."""
    p = Pattern("{a}.{b}.{c}.{d}.weight")
    key = ".".join(["x"] * 200)
    assert p.match(key + ".bias") is None
    assert p.match(key + ".weight").groupdict() == {"a": "x", "b": "x", "c": "x", "d": ".".join(["x"] * 197)}
    assert pattern_regex("{a}.{b}.{c}.{d}.weight").match("x.x.x.x.x.weight").groupdict() == \
        Pattern("{a}.{b}.{c}.{d}.weight").match("x.x.x.x.x.weight").groupdict()
