"""A small declarative mapping from checkpoint keys to restore-target keys, with layout transforms.

A :class:`Mapping` is an ordered list of :class:`Rule` s plus two glob lists. Each rule pairs one
or more *source* patterns (keys in the checkpoint) with a *target* pattern (a key in the state you
load into) and a chain of layout transforms. Patterns are literal text with ``{name}``
placeholders; a placeholder matches one or more characters (digits only when a transform uses it
as an index), and its text is carried from one side to the other with the separators translated
(``source_sep`` <-> ``target_sep``), so ``params/blocks/0/fc/kernel`` and ``blocks.0.fc.weight``
map onto each other.

Transforms (:mod:`bridges.mapping._transforms`, re-exported here) apply in GLOBAL coordinates, in order,
from the source layout to the target layout: :class:`Select` one index of a stacked axis (a
target-only placeholder such as ``layers.{i}`` names it), :class:`Merge` / :class:`Unmerge`
contiguous axes, :class:`Transpose`, :class:`Reorder` along an axis, :class:`Concat` several
sources or take a :class:`Part` of one, :class:`Stack` a key family, :class:`Scale`,
:class:`Cast`, and :class:`Dequantize` (block-FP8 codes with their per-block scales;
:func:`dequantized` adds it to a preset). Each maps a target box to the source box(es) it needs, so a sharded restore reads
only its own bytes, and has an exact inverse for saving the other way. The older
``permute={ndim: axes}`` table remains: a Transpose chosen by the tensor's ndim.

Keys that no rule matches map to themselves unchanged: equal keys need no rule.

:func:`with_moments` turns a parameter's rule into that rule plus its two Adam-moment rules (the
same transforms, the keys moved by a :class:`MomentLayout`: optax's ``mu``/``nu``, torch's
``exp_avg``/``exp_avg_sq``, torchtitan's flattened ``optimizer/state.<fqn>.<slot>``).
:func:`compose` runs two mappings in a row as one (A -> B then B -> C: A -> C), so two presets
that meet on the Hugging Face layout restore a torchtitan checkpoint into JAX directly.

This module is framework-free (numpy only). See ``bridges/MAPPING.md``; ready mappings for
real models are in :mod:`bridges.presets`.

Subpackage ``bridges.mapping`` owns the mapping language: rules and key patterns (``_rules``,
``_pattern``, ``_moments``, ``_compose``), transforms (``_transforms``, ``_joins``, ``_reshape``), chains (``_chain``) and
mapping files (``_mapfile``); the face is ``_mapping``'s. May import: ckptfmt's public faces only,
and no framework (tests/test_layering.py).
"""
from __future__ import annotations

from bridges.mapping._mapping import Rule as Rule
from bridges.mapping._mapping import Mapping as Mapping
from bridges.mapping._mapping import Resolved as Resolved
from bridges.mapping._mapping import IDENTITY as IDENTITY
from bridges.mapping._mapping import LoadReport as LoadReport
from bridges.mapping._mapping import MappingError as MappingError
from bridges.mapping._mapping import KeptValuesWarning as KeptValuesWarning
from bridges.mapping._mapping import flax_nnx_to_torch as flax_nnx_to_torch
from bridges.mapping._mapping import torch_to_flax_nnx as torch_to_flax_nnx
from bridges.mapping._mapping import torch_adamw_kwargs as torch_adamw_kwargs
from bridges.mapping._mapping import CONV_KERNEL_AXES as CONV_KERNEL_AXES
from bridges.mapping._mapping import DENSE_KERNEL_AXES as DENSE_KERNEL_AXES
from bridges.mapping._mapping import LAYER_LEAVES as LAYER_LEAVES
from bridges.mapping._mapping import Chain as Chain
from bridges.mapping._mapping import Transform as Transform
from bridges.mapping._mapping import Transpose as Transpose
from bridges.mapping._mapping import Select as Select
from bridges.mapping._mapping import Merge as Merge
from bridges.mapping._mapping import Unmerge as Unmerge
from bridges.mapping._mapping import Reorder as Reorder
from bridges.mapping._mapping import Concat as Concat
from bridges.mapping._mapping import Part as Part
from bridges.mapping._mapping import Stack as Stack
from bridges.mapping._mapping import Scale as Scale
from bridges.mapping._mapping import Shift as Shift
from bridges.mapping._mapping import Cast as Cast
from bridges.mapping._mapping import Dequantize as Dequantize
from bridges.mapping._mapping import dequantized as dequantized
from bridges.mapping._mapping import interleaved_to_halves as interleaved_to_halves
from bridges.mapping._mapping import halves_to_interleaved as halves_to_interleaved
from bridges.mapping._mapping import optimizer_step_rules as optimizer_step_rules
from bridges.mapping._mapping import InvalidRuleError as InvalidRuleError
from bridges.mapping._mapping import MomentLayout as MomentLayout
from bridges.mapping._mapping import OPTAX_ADAM as OPTAX_ADAM
from bridges.mapping._mapping import TORCH_ADAM as TORCH_ADAM
from bridges.mapping._mapping import TORCHTITAN_ADAM as TORCHTITAN_ADAM
from bridges.mapping._mapping import with_moments as with_moments
from bridges.mapping._mapping import compose as compose

__all__ = ["Rule", "Mapping", "Resolved", "IDENTITY", "LoadReport", "flax_nnx_to_torch", "torch_to_flax_nnx", "torch_adamw_kwargs", "CONV_KERNEL_AXES", "DENSE_KERNEL_AXES", "LAYER_LEAVES", "Chain", "Transform", "Transpose", "Select", "Merge", "Unmerge", "Reorder", "Concat", "Part", "Stack", "Scale", "Shift", "Cast", "Dequantize", "dequantized", "interleaved_to_halves", "halves_to_interleaved", "optimizer_step_rules", "MomentLayout", "OPTAX_ADAM", "TORCH_ADAM", "TORCHTITAN_ADAM", "with_moments", "compose", "MappingError", "KeptValuesWarning", "InvalidRuleError"]
