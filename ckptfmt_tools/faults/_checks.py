"""The terminal-outcome checks shared by the fault fixture and the soak.

* :func:`restore_into` - all-or-nothing restore into the caller's existing numpy buffers and
  state dict; the live values change only after every byte was verified.
* :func:`same` - bit-for-bit comparison of nested state (numpy arrays by dtype and bytes).
* :func:`inventory` - what the committed manifests reference, and what else lies under saves/.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

__all__ = ["restore_into", "same", "snapshot", "Inventory", "inventory", "describe_leftovers", "prior_intact"]


def restore_into(ckpt: Any, arrays: dict[str, np.ndarray], state: dict[str, Any]) -> None:
    """Restore every tensor of ``arrays`` and the global state from ``ckpt`` in place.

    Nothing is written into ``arrays`` or ``state`` unless every read (``read_boxes`` verifies
    everything before it returns anything) and the state decode succeeded. On failure the
    CheckpointError propagates and the live values are untouched.
    """
    from ckptfmt import Box
    from ckptfmt.errors import ShapeMismatchError

    requests = [(k, Box.full(a.shape)) for k, a in arrays.items()]
    values = ckpt.read_boxes(requests)
    new_state = ckpt.state()
    for (k, _), v in zip(requests, values):
        if v.shape != arrays[k].shape or v.dtype != arrays[k].dtype:
            raise ShapeMismatchError("restore target differs from the checkpoint", key=k,
                                     expected=(arrays[k].shape, str(arrays[k].dtype)), found=(v.shape, str(v.dtype)))
    for (k, _), v in zip(requests, values):
        np.copyto(arrays[k], v)
    state.clear()
    state.update(new_state)


def same(a: Any, b: Any) -> bool:
    """True when two nested values are equal bit for bit (arrays: dtype, shape and bytes)."""
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    return type(a) is type(b) and a == b


def snapshot(arrays: Mapping[str, np.ndarray], state: Mapping[str, Any]) -> tuple[dict, dict]:
    return {k: v.copy() for k, v in arrays.items()}, copy.deepcopy(dict(state))


@dataclass
class Inventory:
    """Objects under a file repository, split by what the manifests say about them."""

    committed: set[str] = field(default_factory=set)        # referenced by a parseable manifest
    committed_ids: set[str] = field(default_factory=set)    # save_ids of parseable manifests
    referenced_ids: set[str] = field(default_factory=set)   # earlier saves they reference (kept whole, FORMAT.md 4.4)
    manifest_files: set[str] = field(default_factory=set)
    unreadable_steps: set[int] = field(default_factory=set)  # manifest present but not parseable
    save_files: set[str] = field(default_factory=set)        # every file under saves/

    def private(self) -> set[str]:
        """Files under saves/ that no committed manifest accounts for.

        Files of a save whose step has an unreadable manifest are left out: a conservative gc
        keeps them, since it cannot tell what that manifest references.
        """
        out = set()
        for k in self.save_files:
            if k in self.committed:
                continue
            save_id = k.split("/")[1]
            if save_id in self.referenced_ids and save_id not in self.committed_ids:
                continue
            step = save_id.split("-", 1)[0]
            if step.isdigit() and int(step) in self.unreadable_steps and save_id not in self.committed_ids:
                continue
            out.add(k)
        return out


def describe_leftovers(inv: Inventory) -> list[str]:
    """Group private leftovers by kind, for messages."""
    left = inv.private()
    locks = sorted(k for k in left if k.endswith(".__lock"))
    leases = sorted(k for k in left if k.endswith("/LEASE") and k.split("/")[1] in inv.committed_ids)
    other = sorted(left - set(locks) - set(leases))
    out = []
    if locks:
        out.append(f"{len(locks)} tensorstore lock file(s) of killed writes, invisible to kvstore list: {locks[:2]}")
    if leases:
        out.append(f"{len(leases)} stale LEASE object(s) of committed saves: {leases[:2]}")
    if other:
        out.append(f"{len(other)} private object(s): {other[:3]}")
    return out


def inventory(root: str | os.PathLike) -> Inventory:
    from ckptfmt.repository._verified import record_key
    from ckptfmt.errors import CheckpointError
    from ckptfmt.manifest import parse_manifest

    root = Path(root)
    inv = Inventory()
    mdir = root / "manifests"
    for p in sorted(mdir.glob("*.json")) if mdir.is_dir() else []:
        inv.manifest_files.add(f"manifests/{p.name}")
        try:
            m = parse_manifest(p.read_bytes())
        except CheckpointError:
            stem = p.stem
            if stem.isdigit():
                inv.unreadable_steps.add(int(stem))
            continue
        inv.committed_ids.add(m.save_id)
        inv.referenced_ids |= m.referenced_saves
        inv.committed.add(record_key(m.save_id))  # its verification record, if any (FORMAT.md 10.4)
        for t in m.tensors.values():
            if t.packed is None:  # a packed tensor has no zarr.json (FORMAT.md 6.1, 5.15)
                inv.committed.add(f"{t.array.path}/zarr.json")
            for s in range(len(t.shards)):
                inv.committed.add(t.object_key(s))
        for s in m.state.values():
            inv.committed.add(s.key)
    sdir = root / "saves"
    if sdir.is_dir():
        for dirpath, _, files in os.walk(sdir):
            for f in files:
                inv.save_files.add(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"))
    return inv


def prior_intact(repo: Any, step: int, expect_arrays: Mapping[str, np.ndarray], expect_state: Any) -> tuple[bool, str]:
    """Is ``step`` listed, does it verify, and does it restore bit for bit? (ok, why-not)."""
    from ckptfmt.errors import CheckpointError

    try:
        if step not in repo.steps():
            return False, f"step {step} is no longer listed"
        repo.verify(step)
        arrays = {k: np.zeros_like(v) for k, v in expect_arrays.items()}
        state: dict[str, Any] = {}
        restore_into(repo.open(step), arrays, state)
    except CheckpointError as exc:
        return False, f"step {step}: {type(exc).__name__}: {exc}"
    bad = [k for k in expect_arrays if not same(arrays[k], expect_arrays[k])]
    if bad:
        return False, f"step {step} restored different values for {bad}"
    if not same(state, expect_state):
        return False, f"step {step} restored different state"
    return True, ""
