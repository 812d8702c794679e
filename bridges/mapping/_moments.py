"""Adam moments follow their parameter: one parameter rule gives the rules of its two moments.

A parameter's first and second moments have the parameter's shape and layout, so they take the
parameter's transforms unchanged; only their keys differ, and each framework spells those keys its
own way. A :class:`MomentLayout` says how (a parameter prefix, and a template for a moment's key),
and :func:`with_moments` turns ``Rule(param source, param target, transforms)`` into that rule plus
the rule of each moment, between the source's layout and the target's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from bridges.mapping._chain import InvalidRuleError
from bridges.mapping._rules import Rule

__all__ = ["MomentLayout", "OPTAX_ADAM", "TORCH_ADAM", "TORCHTITAN_ADAM", "with_moments"]


@dataclass(frozen=True)
class MomentLayout:
    """Where one framework keeps a parameter's Adam moments, as checkpoint or target keys.

    ``params``: the prefix of the parameter keys (``"model"``; ``""`` for keys at the root).
    ``template``: a moment's key, with ``{path}`` (the parameter's key below ``params``) and
    ``{slot}`` (the moment's name) in it. ``slots``: the first and second moments' names.
    """

    params: str
    template: str
    slots: tuple[str, str]

    def __post_init__(self) -> None:
        if "{path}" not in self.template or "{slot}" not in self.template:
            raise InvalidRuleError("a moment template needs {path} and {slot}", object=self.template,
                                   expected="a template such as 'optim/state/{path}/{slot}'", found=self.template)
        if len(self.slots) != 2 or not all(isinstance(s, str) and s for s in self.slots):
            raise InvalidRuleError("a moment layout names two slots", object=self.template,
                                   expected="(first moment, second moment)", found=repr(self.slots))

    def moment_key(self, param_key: str, slot: int, where: str) -> str:
        """The key of moment ``slot`` (0 or 1) of the parameter ``param_key`` (a pattern: its
        placeholders are kept). InvalidRuleError when the key is not under :attr:`params`."""
        if self.params and not param_key.startswith(self.params + "/"):
            raise InvalidRuleError(f"{where}: the parameter key is not under the layout's parameter prefix",
                                   key=param_key, object=where, expected=f"a key under {self.params}/",
                                   found=param_key)
        path = param_key[len(self.params) + 1:] if self.params else param_key
        return self.template.replace("{slot}", self.slots[slot]).replace("{path}", path)


#: optax's ``scale_by_adam`` state as ``nnx.Optimizer`` saves it (element 0 of an adamw chain).
OPTAX_ADAM = MomentLayout("model", "optimizer/opt_state/0/{slot}/{path}", ("mu", "nu"))
#: torch's ``Adam``/``AdamW`` as ``get_state_dict`` returns it (FQN-keyed), saved as
#: ``{"model": ..., "optim": ...}``.
TORCH_ADAM = MomentLayout("model", "optim/state/{path}/{slot}", ("exp_avg", "exp_avg_sq"))
#: torchtitan's checkpoint: the model's FQNs at the root, its ``OptimizersContainer`` flattened
#: under ``optimizer`` as ``state.<fqn>.<slot>``.
TORCHTITAN_ADAM = MomentLayout("", "optimizer/state.{path}.{slot}", ("exp_avg", "exp_avg_sq"))


def with_moments(rule: Rule, source: MomentLayout = OPTAX_ADAM, target: MomentLayout = TORCH_ADAM) -> tuple[Rule, Rule, Rule]:
    """``rule`` (a parameter's) and the rules of its first and second Adam moments.

    Each moment rule has the parameter rule's transforms, and its keys are the parameter's keys
    in ``source``'s and ``target``'s moment layouts (a Concat rule's every source moves).
    Raises InvalidRuleError naming the rule when a key is not under the layout's parameter prefix
    (nothing is returned then); ``rule`` is never changed.
    """
    where = rule.describe()
    out = [rule]
    for slot in (0, 1):
        srcs = tuple(source.moment_key(s, slot, where) for s in rule.sources)
        out.append(replace(rule, source=srcs[0] if isinstance(rule.source, str) else srcs,
                           target=target.moment_key(rule.target, slot, where), also=False))
    return out[0], out[1], out[2]
