"""Two mappings in a row as one: A -> B then B -> C gives A -> C, so two presets that meet on one
layout (torchtitan -> Hugging Face, Hugging Face -> JAX) restore straight from A into C, each rank
reading only the boxes of A its part of C needs (no process in layout B)."""
from __future__ import annotations

from dataclasses import replace

from bridges.mapping._chain import InvalidRuleError
from bridges.mapping._pattern import PLACEHOLDER, pattern_regex
from bridges.mapping._rules import Mapping, Rule

__all__ = ["compose"]


def _through(ra: Rule, rb: Rule) -> Rule | None:
    """``ra`` (A -> B) followed by ``rb`` (B -> C) when ``rb`` reads the key ``ra`` writes: the same
    pattern, or a pattern of ``rb`` that matches ``ra``'s target as text (``optim/state/{p}/step``
    matches ``optim/state/model.layers.{i}.mlp.up_proj.weight/step``); None otherwise."""
    if rb.source == ra.target:
        target = rb.target
    else:
        m = pattern_regex(rb.source).fullmatch(ra.target)
        if m is None:
            return None
        values = m.groupdict()
        target = PLACEHOLDER.sub(lambda p: values.get(p.group(1), p.group(0)), rb.target)
    return Rule(ra.source, target, transforms=ra.transforms + rb.transforms, also=rb.also)


def compose(first: Mapping, second: Mapping) -> Mapping:
    """The mapping A -> C of ``first`` (A -> B) followed by ``second`` (B -> C).

    Each rule of ``second`` is joined to the rules of ``first`` that write the key it reads: the
    same pattern (every such rule), or else the first rule whose target its pattern matches; the
    joined rule reads ``first``'s source and applies ``first``'s transforms, then ``second``'s
    (a Stack of ``second`` becomes the join, after the per-source transforms). A rule of ``second``
    that no rule of ``first`` feeds reads its key as it is (``first`` maps it to itself), and a
    rule of ``first`` that ``second`` does not read is kept (``second`` maps its key to itself).
    ``ignore`` is ``first``'s (keys of A), ``keep`` is ``second``'s (keys of C).

    Raises InvalidRuleError naming the rule when a rule cannot be joined: a ``permute`` table
    (give transforms), or a rule of ``second`` with several sources (a Concat over keys of B);
    and when the joined transforms do not compose (two joins). Neither mapping is changed.
    """
    if first.target_sep != second.source_sep:  # placeholder text crosses the middle layout unchanged
        raise InvalidRuleError("the mappings do not meet on one layout", object="compose",
                               expected=f"second's source separator {first.target_sep!r}",
                               found=repr(second.source_sep))
    for r in first.rules + second.rules:
        if r.permute is not None:
            raise InvalidRuleError("compose needs transforms, not a permute table", key=r.target,
                                   object=r.describe(), expected="Rule(..., transforms=(Transpose(...),))",
                                   found=f"permute={r.permute}")
    rules: list[Rule] = []
    fed: set[int] = set()
    for rb in second.rules:
        if len(rb.sources) != 1:
            raise InvalidRuleError("compose joins rules of one source; this rule concatenates keys of the "
                                   "middle layout", key=rb.target, object=rb.describe(), expected="one source",
                                   found=list(rb.sources))
        exact = [i for i, ra in enumerate(first.rules) if ra.target == rb.source]
        if not exact:
            exact = next(([i] for i, ra in enumerate(first.rules) if _through(ra, rb) is not None), [])
        for i in exact:
            joined = _through(first.rules[i], rb)
            assert joined is not None
            rules.append(joined)
            fed.add(i)
        if not exact:
            rules.append(replace(rb))
    rules += [ra for i, ra in enumerate(first.rules) if i not in fed]
    return Mapping(tuple(rules), ignore=first.ignore, keep=second.keep, source_sep=first.source_sep,
                   target_sep=second.target_sep)
