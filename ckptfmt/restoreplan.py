"""The one restore planner of every bridge: which target key reads which checkpoint tensors, what
is cast, what is kept, and every mismatch of the restore in one error (bridges/README.md, "The
restore semantics").

Call order (``bridges.torch.load``, ``bridges.jax.restore``): open a :class:`RestoreSource`
(``ckptfmt.interop.open_source``: a committed step or a safetensors source); describe each target
leaf as a :class:`TargetLeaf`; :func:`plan_restore` (pure: it reads the source's tensor entries,
never a byte of data); then per local box :meth:`TensorPlan.reads`, the source's batched reads
(``bridges._contract.read_batches``), and :meth:`TensorPlan.assemble` (layout and cast). The
bridge itself only turns leaves into boxes and blocks into values.

The semantics (``strict`` is ``None`` by default):

* a target key the checkpoint lacks is an error unless ``strict=False`` (then the target keeps its
  value, and the report names it) or the mapping's ``keep`` globs name it;
* a checkpoint key the target does not name is a partial restore, reported in
  ``RestoreReport.unexpected``; ``strict=True`` makes it an error (the mapping's ``ignore`` globs
  are never reported);
* a dtype that differs is cast to the target's when both are of one kind (float to float, int to
  int: signed and unsigned, complex to complex) and reported in ``RestoreReport.cast``; across
  kinds it is an error;
* quantized codes are never cast without their scales: a float8 checkpoint tensor that a target
  of another dtype would read by an implicit cast, not through a rule that reads its scale
  companion too (``bridges.mapping.Dequantize``; companions: :data:`SCALE_COMPANIONS`, block-FP8
  ``X.weight_scale_inv`` or a per-tensor ``X.weight_scale``), is a QuantizedWeightError naming
  the companion (or saying that the checkpoint lacks it); a float8 target of the same dtype takes
  the codes as they are, and an explicit ``Cast`` rule casts unscaled float8 values; a target
  key whose tensor the checkpoint holds as MXFP4 (``X_blocks`` and ``X_scales``, gpt-oss) is a
  QuantizedWeightError too, not a missing key (no rule dequantizes MXFP4 yet);
* every mismatch of one restore (missing and unexpected keys, shapes, dtypes, rules that do not
  fit) is raised as ONE error: KeyMismatchError when only keys differ, the mismatch itself when it
  is the only one, RestoreMismatchError (a KeyMismatchError and a ShapeMismatchError) otherwise.
  Its message starts with what to do and stays short; the full lists are its attributes and its
  ``to_json()``.

The mapping is any object with the methods of ``bridges.mapping.Mapping`` that the planner calls
(:class:`KeyMap`); what it resolves a key to is a :class:`Resolution`, and a resolution bound to
the source's shapes is a :class:`MappingChain` (``bridges.mapping.Chain`` is one), the
:attr:`TensorPlan.chain` that a restore reads through: ``ckptfmt`` never imports the bridges.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from ._types import Box
from .dtypes import numpy_dtype
from .errors import CheckpointError, KeyMismatchError, QuantizedWeightError, RestoreMismatchError, ShapeMismatchError

__all__ = ["is_optimizer_state", "RestoreSource", "RestoreManifest", "KeyMap", "Resolution", "MappingChain", "TargetLeaf", "TensorPlan",
           "RestorePlan", "RestoreReport", "plan_restore", "dtype_kind", "closest_key", "SCALE_COMPANIONS",
           "MXFP4_PARTS", "scale_companion"]

Request = tuple[str, Box]
_SHOWN = 5           # keys of each list the message shows
_MESSAGE_MAX = 1500  # characters of the message (the full lists are attributes)
_CLOSE_MAX = 4096    # checkpoints with more keys get no "closest key" hint (difflib is slow)
#: Optimizer slots (optax's and torch's): a key holding one is compared only with keys of the same slot.
_SLOTS = frozenset({"mu", "nu", "exp_avg", "exp_avg_sq", "count", "step", "momentum_buffer", "momentum", "trace"})
_OPTIMIZER_WORDS = _SLOTS | {"opt_state", "optimizer", "optim"}
#: Suffixes of a quantized tensor's scale companion (block-FP8 first: DeepSeek-V3, Qwen3-FP8).
SCALE_COMPANIONS = ("_scale_inv", "_scale")
#: gpt-oss's MXFP4 layout: ``X_blocks`` (two FP4 e2m1 codes a byte) and ``X_scales`` (e8m0, one per
#: 32 values) stand for ``X`` (transformers' integrations/mxfp4.py); recognised and refused.
MXFP4_PARTS = ("_blocks", "_scales")
_CODE_KINDS = ("float8_",)


class RestoreManifest(Protocol):
    """What a restore asks of a source's manifest: a committed step's :class:`ckptfmt.Manifest`,
    or a safetensors source's ``SourceManifest`` (no non-tensor state, one writer)."""

    @property
    def step(self) -> int: ...

    @property
    def writers(self) -> int: ...

    @property
    def tensors(self) -> Mapping[str, Any]: ...

    @property
    def state(self) -> Mapping[str, Any]: ...


@runtime_checkable
class RestoreSource(Protocol):
    """What a restore reads: a committed step (:class:`ckptfmt.Checkpoint`) or a safetensors source
    (:class:`ckptfmt.interop.SafetensorsSource`), both opened by ``ckptfmt.interop.open_source``.

    ``tensor(key)`` has ``shape`` and ``dtype`` (a format dtype name); ``manifest.state`` names the
    state objects (``rank/...`` ones are per-rank); ``iter_read_boxes`` yields each batch's arrays
    once every byte is verified; ``stats`` counts ``bytes_read``, ``requests`` and ``objects``.
    """

    manifest: RestoreManifest
    stats: Any

    @property
    def step(self) -> int: ...

    @property
    def saved_world(self) -> int: ...

    def keys(self) -> list[str]: ...

    def tensor(self, key: str) -> Any: ...

    def state(self) -> Any: ...

    def rank_state(self, rank: int, *, world: int | None = None, policy: str | None = None) -> Any: ...

    def read_boxes(self, requests: Sequence[Request]) -> list[np.ndarray]: ...

    def iter_read_boxes(self, batches: Sequence[Sequence[Request]]) -> Iterator[list[np.ndarray]]: ...


class MappingChain(Protocol):
    """A mapping's transforms for one target key, bound to the source tensors' shapes and dtypes
    (``bridges.mapping.Chain`` is one): what :class:`TensorPlan` and the planner call on it."""

    @property
    def target_shape(self) -> tuple[int, ...]: ...

    @property
    def target_dtype(self) -> np.dtype: ...

    def reads(self, box: Box) -> list[Request]:
        """The (source key, source box) reads that the target block at ``box`` needs."""
        ...

    def assemble(self, box: Box, blocks: Sequence[np.ndarray]) -> np.ndarray:
        """The target block at ``box`` from the blocks of :meth:`reads`, in order."""
        ...


class Resolution(Protocol):
    """Where the mapping says a target key reads from (``bridges.mapping.Resolved`` is one)."""

    @property
    def source_keys(self) -> Sequence[str]: ...

    @property
    def transforms(self) -> Sequence[Any]: ...

    @property
    def where(self) -> str: ...

    def chain(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any]) -> MappingChain:
        """Bound to the source tensors' shapes and dtypes; raises a CheckpointError when the rule does not fit."""
        ...


class KeyMap(Protocol):
    """The mapping the planner asks (``bridges.mapping.Mapping`` is one)."""

    def resolve(self, target_key: str, ndim: int, source_keys: Collection[str] | None = None) -> Resolution: ...

    def is_kept(self, target_key: str) -> bool: ...

    def is_ignored(self, source_key: str) -> bool: ...


@dataclass(frozen=True)
class TargetLeaf:
    """One leaf of a restore target. ``kind``: ``"array"`` (a tensor of ``shape`` and ``dtype``),
    ``"object"`` (a saved non-tensor value only) or ``"any"`` (a saved non-tensor value, else the
    tensor of that key whole, at its own shape and dtype). ``cast=False``: the dtype must match."""

    key: str
    kind: str = "array"
    shape: tuple[int, ...] = ()
    dtype: Any = None
    cast: bool = True


@dataclass(frozen=True)
class TensorPlan:
    """Where one target tensor's data comes from. ``chain`` is a mapping's bound transforms (a
    :class:`MappingChain`; None: the checkpoint tensor ``source_keys[0]`` as is); ``dtype`` the
    target's numpy dtype."""

    key: str
    source_keys: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    source_dtype: np.dtype
    chain: MappingChain | None = None

    @property
    def cast(self) -> bool:
        return self.source_dtype != self.dtype

    def reads(self, box: Box) -> list[Request]:
        """The (checkpoint key, box) reads that target ``box`` needs (none for an empty box)."""
        if box.is_empty():
            return []
        return self.chain.reads(box) if self.chain is not None else [(self.source_keys[0], box)]

    def assemble(self, box: Box, blocks: Sequence[np.ndarray]) -> np.ndarray:
        """The target block at ``box`` from the verified blocks of :meth:`reads`, in the target's dtype."""
        out = self.chain.assemble(box, blocks) if self.chain is not None else blocks[0]
        return out.astype(self.dtype) if out.dtype != self.dtype else out


@dataclass(frozen=True)
class RestoreReport:
    """What a restore did, key by key (target keys unless said otherwise); the same in every bridge.

    ``loaded``: filled from the checkpoint. ``kept``: keep the target's own value (``missing``
    ones, and those a ``keep`` glob names). ``missing``: the checkpoint lacks them (only with
    ``strict=False``; otherwise the restore raises). ``unexpected``: CHECKPOINT keys nothing read
    (a partial restore; ``ignore`` globs excluded). ``notes``: why matching rules did not apply,
    per missing key. ``cast``: ``"key: from -> to"`` for each value cast to the target's dtype.
    """

    loaded: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    cast: tuple[str, ...] = ()

    def warning(self) -> str | None:
        """The text the bridges warn with when keys keep their initial values, else None."""
        if not self.missing:
            return None
        shown = ", ".join(self.missing[:8]) + (f", ... ({len(self.missing)} in all)" if len(self.missing) > 8 else "")
        why = ("; " + "; ".join(self.notes[:4])) if self.notes else ""
        return (f"{len(self.missing)} target keys keep their initial values because the checkpoint "
                f"does not provide them: {shown}{why}")


@dataclass(frozen=True)
class RestorePlan:
    """A restore, planned: ``tensors`` to read (target order), ``objects`` (target key -> the saved
    non-tensor key it takes), ``kept`` target keys, and the :class:`RestoreReport`."""

    step: int
    tensors: tuple[TensorPlan, ...]
    objects: Mapping[str, str]
    kept: frozenset[str]
    report: RestoreReport
    by_key: Mapping[str, TensorPlan] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_key", {t.key: t for t in self.tensors})


def dtype_kind(dtype: Any) -> str:
    """``float`` (ml_dtypes' too), ``int`` (signed or unsigned), ``complex``, ``bool``, else the name."""
    name = np.dtype(dtype).name
    if name.startswith(("float", "bfloat")):
        return "float"
    if name.startswith(("int", "uint")):
        return "int"
    if name.startswith("complex"):
        return "complex"
    return name


def _category(key: str) -> tuple[str, str]:
    """(``optimizer`` or ``tensor``, the optimizer slot the key holds or "")."""
    parts = key.replace(".", "/").split("/")
    slot = next((p for p in parts if p in _SLOTS), "")
    return ("optimizer" if slot or any(p in _OPTIMIZER_WORDS for p in parts) else "tensor"), slot


def is_optimizer_state(key: str) -> bool:
    """Whether key path ``key`` names optimizer state (an optimizer slot such as ``mu``, ``nu``,
    ``exp_avg``, ``count``, or a path through ``opt_state``/``optimizer``/``optim``), by the same
    test the restore's "closest key" uses; a model parameter otherwise."""
    return _category(key)[0] == "optimizer"


def closest_key(key: str, keys: Collection[str], ndim: int | None = None, shapes: Any = None) -> str | None:
    """The key of ``keys`` most like ``key`` AND of its kind (a model tensor for a model tensor, an
    optimizer slot for the same slot: never optax's ``count`` for an NNX ``optimizer/step``; of
    ``ndim`` dims when ``shapes(k)`` gives shapes), or None. Slow (difflib): call it for a few keys."""
    if len(keys) > _CLOSE_MAX:
        return None
    kind = _category(key)
    pool = [k for k in keys if _category(k) == kind
            and (ndim is None or shapes is None or len(shapes(k)) == ndim)]
    close = difflib.get_close_matches(key, pool, n=1)
    return close[0] if close else None


class _Planner:
    """The state of one :func:`plan_restore` call (a function of it would run past 80 lines)."""

    def __init__(self, source: RestoreSource, mapping: KeyMap | None, objects: Collection[str]) -> None:
        self.source, self.mapping = source, mapping
        self.keys = set(source.keys())
        self.objects = set(objects)
        self.used: set[str] = set()
        self.tensors: list[TensorPlan] = []
        self.taken: dict[str, str] = {}
        self.loaded: list[str] = []
        self.kept: list[str] = []
        self.missing: list[str] = []
        self.notes: dict[str, str] = {}
        self.lookfor: dict[str, str] = {}  # missing target key -> the checkpoint key it wanted
        self.casts: list[str] = []
        self.mismatches: list[CheckpointError] = []

    def leaf(self, leaf: TargetLeaf) -> None:
        if leaf.kind != "array":
            if leaf.key in self.objects:
                self.taken[leaf.key] = leaf.key
                self.used.add(leaf.key)
                self.loaded.append(leaf.key)
                return
            res = self.mapping.resolve(leaf.key, 0, self.keys) if self.mapping is not None and leaf.kind == "any" else None
            if res is not None and (res.transforms or tuple(res.source_keys) != (leaf.key,)) \
                    and all(k in self.keys for k in res.source_keys):
                self.used.update(res.source_keys)
                self.mismatches.append(ShapeMismatchError(
                    "a mapped key needs an array target", key=leaf.key, expected="an array", found=leaf.kind))
                return
            if leaf.kind == "object" or leaf.key not in self.keys:
                return self._lacking(leaf.key, None, [leaf.key])
            e = self.source.tensor(leaf.key)  # a scalar placeholder for a saved array: the tensor whole
            return self._plan(leaf.key, (leaf.key,), None, tuple(int(n) for n in e.shape), numpy_dtype(e.dtype), True)
        res = self.mapping.resolve(leaf.key, len(leaf.shape), self.keys) if self.mapping is not None else None
        mapped = res is not None and (bool(res.transforms) or tuple(res.source_keys) != (leaf.key,))
        sources = tuple(res.source_keys) if mapped else (leaf.key,)
        lacking = [k for k in sources if k not in self.keys]
        packed = [k for k in lacking if all(k + x in self.keys for x in MXFP4_PARTS)]
        if packed:  # gpt-oss: X_blocks (packed FP4) and X_scales (e8m0) instead of X
            self.used.update(k + x for k in packed for x in MXFP4_PARTS)
            self.mismatches.append(QuantizedWeightError(
                f"the checkpoint holds {packed[0]!r} as MXFP4 ({packed[0] + MXFP4_PARTS[0]!r} packed FP4 codes, "
                f"{packed[0] + MXFP4_PARTS[1]!r} per-32-value e8m0 scales): no ckptfmt rule dequantizes MXFP4 yet; "
                "dequantize it with transformers (from_pretrained dequantizes gpt-oss on CPU) and save that",
                key=leaf.key, object=packed[0] + MXFP4_PARTS[1], expected="a dequantized tensor", found="MXFP4"))
            return
        if lacking:
            return self._lacking(leaf.key, res, lacking)
        chain = None
        if mapped:
            entries = [self.source.tensor(k) for k in sources]
            try:
                chain = res.chain([tuple(int(n) for n in e.shape) for e in entries], [numpy_dtype(e.dtype) for e in entries])
            except CheckpointError as e:  # MappingError: the rule matched but does not fit
                self.mismatches.append(e)
                self.used.update(sources)
                return
            found_shape, found_dtype = tuple(chain.target_shape), np.dtype(chain.target_dtype)
        else:
            e = self.source.tensor(leaf.key)
            found_shape, found_dtype = tuple(int(n) for n in e.shape), numpy_dtype(e.dtype)
        self.used.update(sources)
        where = f" (source {list(sources)[:3]} through {res.where})" if mapped else ""
        want = numpy_dtype(leaf.dtype) if isinstance(leaf.dtype, str) else np.dtype(leaf.dtype)
        if found_shape != tuple(leaf.shape):
            self.mismatches.append(ShapeMismatchError(f"target shape does not match the checkpoint{where}",
                                                      key=leaf.key, expected=tuple(leaf.shape), found=found_shape))
        elif found_dtype != want and (quant := self._unscaled(leaf.key, want, sources, res if mapped else None)):
            self.mismatches.append(quant)
        elif found_dtype != want and not (leaf.cast and dtype_kind(found_dtype) == dtype_kind(want)):
            how = "a cast across kinds is not done" if leaf.cast else "the dtype must match exactly"
            self.mismatches.append(ShapeMismatchError(f"target dtype does not match the checkpoint ({how}){where}",
                                                      key=leaf.key, expected=want.name, found=found_dtype.name))
        else:
            self._plan(leaf.key, sources, chain, found_shape, want, found_dtype == want, found_dtype)

    def _unscaled(self, key: str, want: np.dtype, sources: tuple[str, ...],
                  res: Resolution | None) -> QuantizedWeightError | None:
        """The refusal of a cast of float8 codes to ``want`` without their scale companion (the
        resolution does not read it, or the checkpoint lacks it), or None when no source is such."""
        for src in sources:
            code = numpy_dtype(self.source.tensor(src).dtype).name
            companion = scale_companion(src, self.keys)
            if not code.startswith(_CODE_KINDS) or (companion is not None and companion in sources):
                continue
            via = f" through {res.where}" if res is not None else ""
            named = companion or src + SCALE_COMPANIONS[0]
            rule = f"Rule(({src!r}, {named!r}), <target>, transforms=(Dequantize(block=(128, 128)),))"
            if companion is not None:
                self.used.add(companion)  # reported here, not again as unexpected
                what = f"holds {code} codes scaled by {companion!r}{via}"
                todo = (f"dequantize with a mapping rule {rule} (bridges.mapping.Dequantize; "
                        "bridges.mapping.dequantized(mapping) adds it to a preset)")
            else:
                what = (f"holds {code} values and the checkpoint has no scale companion "
                        f"({' or '.join(repr(src + x) for x in SCALE_COMPANIONS)}){via}")
                todo = (f"restore from a checkpoint that has the companion (a quantized checkpoint without it is "
                        f"incomplete; then {rule}), or, for unscaled float8 values, cast with an explicit Cast rule")
            return QuantizedWeightError(
                f"checkpoint tensor {src!r} {what}: a cast to {want.name} would give the raw codes, not the "
                f"weights; {todo}, or restore into a {code} target to keep the codes",
                key=key, object=named, expected=f"{code} target, or a Dequantize rule", found=want.name)
        return None

    def _plan(self, key: str, sources: tuple[str, ...], chain: MappingChain | None, shape: tuple[int, ...], dtype: np.dtype,
              same: bool, source_dtype: np.dtype | None = None) -> None:
        self.used.update(sources)
        self.loaded.append(key)
        src = dtype if source_dtype is None else source_dtype
        if not same:
            self.casts.append(f"{key}: {src.name} -> {dtype.name}")
        self.tensors.append(TensorPlan(key, sources, shape, dtype, src, chain))

    def _lacking(self, key: str, res: Resolution | None, lacking: list[str]) -> None:
        self.kept.append(key)
        if self.mapping is not None and self.mapping.is_kept(key):
            return
        self.missing.append(key)
        self.lookfor[key] = lacking[0]
        notes = tuple(getattr(res, "notes", ()) or ())
        if notes:
            self.notes[key] = "; ".join(notes)
        elif res is not None and getattr(res, "rule", None) is not None:
            self.notes[key] = f"{res.where}: the checkpoint lacks {lacking[:3]}"

    def unexpected(self) -> list[str]:
        ignored = self.mapping.is_ignored if self.mapping is not None else (lambda k: False)
        return sorted(k for k in (self.keys | self.objects) - self.used if not ignored(k))

    def hints(self, unexpected: list[str]) -> dict[str, str]:
        """The closest checkpoint key of the first few missing ones, compared like with like."""
        pool = set(unexpected) & self.keys or self.keys
        out: dict[str, str] = {}
        for key in self.missing[:3]:
            hint = closest_key(self.lookfor.get(key, key), pool)
            if hint is not None:
                out[key] = hint
        return out


def scale_companion(key: str, keys: Collection[str]) -> str | None:
    """The checkpoint key holding ``key``'s quantization scales (:data:`SCALE_COMPANIONS`), or None."""
    for suffix in SCALE_COMPANIONS:
        if key + suffix in keys:
            return key + suffix
    return None


def plan_restore(source: RestoreSource, leaves: Sequence[TargetLeaf], mapping: KeyMap | None = None,
                 strict: bool | None = None, *, objects: Collection[str] = (),
                 mismatches: Sequence[CheckpointError] = ()) -> RestorePlan:
    """Plan a restore of ``leaves`` from ``source`` through ``mapping`` (None: keys equal).

    ``objects``: the keys of the source's saved non-tensor values (a bridge's profile record).
    ``mismatches``: what the bridge found itself about its leaves (a typed PRNG key of another
    implementation), reported in the same one error.
    Pure: reads tensor entries, never data. Raises ONE CheckpointError listing every mismatch (see
    the module docstring); returns the plan otherwise (the caller warns with
    ``report.warning()`` when keys keep their values)."""
    p = _Planner(source, mapping, objects)
    p.mismatches.extend(mismatches)
    for leaf in leaves:
        p.leaf(leaf)
    unexpected = p.unexpected()
    missing = p.missing if strict is not False else []
    extra = unexpected if strict is True else []
    if missing or extra or p.mismatches:
        raise _one_error(p, missing, unexpected, strict)
    notes = tuple(f"{k}: {p.notes[k]}" for k in p.missing if k in p.notes)
    report = RestoreReport(loaded=tuple(p.loaded), kept=tuple(p.kept), missing=tuple(p.missing),
                           unexpected=tuple(unexpected), notes=notes, cast=tuple(p.casts))
    return RestorePlan(int(source.step), tuple(p.tensors), dict(p.taken), frozenset(p.kept), report)


def _shown(keys: Sequence[str]) -> str:
    head = ", ".join(repr(k) for k in keys[:_SHOWN])
    return head + (f", ... ({len(keys)} in all)" if len(keys) > _SHOWN else "")


def _ignore_glob(keys: Sequence[str]) -> str:
    tops = sorted({k.split("/")[0] for k in keys})
    return ", ".join(f"'{t}/*'" if any("/" in k for k in keys if k.startswith(t)) else repr(t) for t in tops[:3])


#: A key of one tensor per expert (``...experts.0.w1.weight``), and a rule's note naming the experts
#: fused in one tensor (``...experts.gate_up_proj``): a MoE preset built for the other layout.
_PER_EXPERT = re.compile(r"[./]experts[./]\d+[./]")
_FUSED_EXPERTS = re.compile(r"[./]experts[./][A-Za-z_]")


def _one_error(p: _Planner, missing: list[str], unexpected: list[str], strict: bool | None) -> CheckpointError:
    extra = unexpected if strict is True else []
    if not missing and not extra and len(p.mismatches) == 1:
        return p.mismatches[0]
    todo: list[str] = []
    level = [p.notes[k] for k in missing if p.notes.get(k, "").startswith("TARGET LEVEL")]
    per_expert = next((k for k in unexpected if _PER_EXPERT.search(k)), None)
    if per_expert and any(_FUSED_EXPERTS.search(p.notes.get(k, "")) for k in missing):
        todo.append(f"a mapping for one tensor per expert, as the checkpoint holds ({per_expert!r}): the MoE "
                    "presets take experts=\"per_expert\" (ckptfmt export/import: --preset-arg experts=per_expert)")
    if level:  # the mapping's keys are there one level down: the target, not the mapping, is off
        todo.append(f"a target with the level the mapping expects ({level[0].split(': ', 1)[1]})")
    elif missing:
        todo.append("a mapping that names where they come from (a preset's names= with your model's names), "
                    "or strict=False to keep the target's values for them")
    if extra:
        todo.append(f"ignore=({_ignore_glob(extra)},) in the mapping, or drop strict=True for a partial restore")
    ruled = [m for m in p.mismatches  # a rule's transforms did not fit, or gave another shape
             if type(m).__name__ == "MappingError" or "rule " in (m.message or "")]
    if ruled:
        todo.append("a mapping whose rules fit this checkpoint (the preset's config and arguments: rope=, "
                    "scan_axis=, experts=, names=; bridges/MAPPING.md explains each rule error)")
    if len(ruled) < len(p.mismatches):
        todo.append("a target of the checkpoint's shapes and dtypes (a cast is done within one kind only)")
    counts = [f"{n} {what}" for n, what in ((len(missing), "missing keys"), (len(extra), "unexpected keys"),
                                              (len(p.mismatches), "mismatched values")) if n]
    parts = [f"the restore target does not fit the checkpoint ({', '.join(counts)}); to fix, pass " + "; or ".join(todo)]
    if missing:
        parts.append(f"missing (target keys the checkpoint lacks): {_shown(missing)}")
    if extra:
        parts.append(f"unexpected (checkpoint keys the target does not name): {_shown(extra)}")
    elif missing and unexpected:  # not an error without strict=True, but where the missing ones may be
        parts.append(f"the checkpoint also holds {len(unexpected)} keys the target does not name (the missing "
                     f"ones under other names?): {_shown(unexpected)}")
    hints = p.hints(unexpected)
    notes = [f"{k}: {p.notes[k]}" for k in missing if k in p.notes]
    notes += [f"{k}: closest checkpoint key {v!r}" for k, v in hints.items()]
    if notes:
        parts.append("notes: " + " | ".join(notes[:4]))
    parts += [f"{m.key}: {m.message} (expected {m.expected!r}, found {m.found!r})" for m in p.mismatches[:_SHOWN]]
    message = " -- ".join(parts)
    if len(message) > _MESSAGE_MAX:
        message = message[:_MESSAGE_MAX - 60] + " ... (the full lists: the error's missing / unexpected)"
    cls = KeyMismatchError if not p.mismatches else RestoreMismatchError
    first = (missing or extra or [m.key for m in p.mismatches])[0]
    err = cls(message, key=first, expected=missing[:_SHOWN] or None, found=extra[:_SHOWN] or None)
    err.missing, err.unexpected = list(missing), list(unexpected)
    err.notes = [f"{k}: {p.notes[k]}" for k in missing if k in p.notes]
    err.mismatches = [m.to_json() for m in p.mismatches]
    return err
