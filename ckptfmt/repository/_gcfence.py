"""The fence between collectors and incremental saves: leases, claims and the last look
(FORMAT.md 4.4, 8.4, 10.3).

A collector (``Repository.delete``, gc, another process's retention) removes the objects of a
save X that it judged unreferenced and unpinned only in this order:

1. **claim** X: X's lease says ``collected`` (gc rewrites a stale lease conditionally on the
   generation it judged; a save without a lease gets one created, only if absent), so that from
   here on every save that pins X sees the claim (:func:`excluded`) and references nothing of X;
2. list ``saves/`` again and read **every** lease (:func:`lease_pins`): a lease not marked
   ``collected`` that pins X keeps X;
3. only then list ``manifests/`` and scan every manifest (the caller's scan): one that names or
   mentions X keeps X;
4. delete X's objects, its lease last (:func:`remove_save`), so that the claim stays visible
   until nothing of X is left to reference.

A claim is never taken back: a claimed save that step 2 or 3 keeps stays claimed (later saves
write its shards instead of referencing them). FORMAT.md 10.3 proves the order for every
interleaving with saves and other collectors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol

from ckptfmt import layout
from ckptfmt.storage._localfs import Entry
from ckptfmt.errors import CheckpointError, StorageError
from ckptfmt.layout import (LEASE_NAME, SAVES, arrays_prefix, is_save_id, lease_key, parse_writer_save_id, save_prefix,
                            state_prefix)
from ckptfmt.storage import NO_VALUE, Storage


__all__ = ["StoredLease", "stored_lease", "pinned_by_leases", "collected_lease", "scan_saves", "SaveNames", "list_saves",
           "lease_pins", "claim", "excluded", "remove_save"]

LEASE_MAX_BYTES = layout.LEASE_MAX_BYTES


@dataclass(frozen=True)
class StoredLease:
    """A lease as a collector read it: what :class:`ckptfmt.layout.Lease` says, and the storage
    generation it was read at (a claim rewrites it conditionally on that generation)."""

    generation: bytes
    heartbeat_unix: float  # 0.0 when unreadable: such a lease is stale
    state: str             # "writing" | "committing" | "collected"
    step: int | None
    refs: frozenset[str] = frozenset()  # the saves it pins (FORMAT.md 10.1)


def stored_lease(value: bytes, generation: bytes) -> StoredLease:
    """The lease ``value`` read at ``generation`` (unreadable: stale, as :func:`ckptfmt.layout.parse_lease`)."""
    lease = layout.parse_lease(value)
    return StoredLease(generation, lease.heartbeat_unix, lease.state, lease.step, lease.refs)


def pinned_by_leases(leases: Iterable[StoredLease]) -> set[str]:
    """The save ids that leases not marked ``collected`` pin (FORMAT.md 10.1, 10.3 step 2)."""
    return {r for lease in leases if lease.state != "collected" for r in lease.refs}


def collected_lease(sid: str) -> bytes:
    return layout.lease_bytes({"save_id": sid, "state": "collected"})


def scan_saves(st: Storage, *, deep: bool = True) -> list[Entry]:
    """Every name under ``saves/``, judged without following links (the store's
    ``scan_children``); a directory's ``marker`` is the kind of its ``LEASE`` ("file", "link",
    ...; None when it has none). The store knows nothing of leases: the collector says what to
    look for. ``deep=False``: the leases only (no object counts or ages)."""
    return st.scan_children(SAVES, marker=LEASE_NAME, deep=deep)


@dataclass(frozen=True)
class SaveNames:
    """Step 2: the directories under saves/ gc may collect, and the reader-valid ids outside the
    writer form (committed, or foreign)."""

    candidates: dict[str, Entry]
    custom: dict[str, Entry]


class Findings(Protocol):
    """What a listing reports into (:class:`ckptfmt.repository._gc.GcReport` is one): without
    importing gc's module, which imports this one."""

    problems: list[str]
    foreign: list[str]


def list_saves(st: Storage, retired: Mapping[str, int], report: Findings, foreign: list[str]) -> SaveNames | None:
    """The names under saves/, judged without following links; None when saves/ cannot be listed."""
    candidates: dict[str, Entry] = {}
    custom: dict[str, Entry] = {}
    try:
        entries = scan_saves(st)
    except StorageError as e:
        report.problems.append(f"saves/ was not collected: {e.message} ({e.found})")
        report.foreign.append(SAVES)
        return None
    for e in entries:
        if e.kind != "dir":
            foreign.append(f"{SAVES}{e.name}" + ("" if e.kind == "file" else f" ({'symbolic link' if e.kind == 'link' else 'special file'})"))
        elif parse_writer_save_id(e.name) is not None or e.name in retired:
            candidates[e.name] = e
        elif is_save_id(e.name):
            custom[e.name] = e
        else:
            foreign.append(f"{SAVES}{e.name}")
    return SaveNames(candidates, custom)


def lease_pins(st: Storage, *, but: str | None = None) -> set[str] | None:
    """Every save id that the lease of any save under ``saves/`` (listed now, without following
    links; ``but``'s own lease aside) pins; None when a lease or the listing cannot be read, so
    that the caller keeps everything."""
    try:
        entries = [e for e in scan_saves(st, deep=False) if e.kind == "dir" and e.name != but]
    except StorageError:
        return None
    if any(e.error is not None for e in entries):
        return None  # a save folder that could not be looked into may hold a lease
    entries = [e for e in entries if e.marker is not None]
    if any(e.marker != "file" for e in entries):
        return None
    pins: set[str] = set()
    for g in st.read_each_with_generation([lease_key(e.name) for e in entries], LEASE_MAX_BYTES):
        if isinstance(g, StorageError):
            return None
        if g[0] is not None:
            pins |= pinned_by_leases([stored_lease(g[0], g[1])])
    return pins


def claim(st: Storage, sid: str, generation: bytes | None = None) -> str | None:
    """Claim a save that a collector has judged free: its lease says ``collected`` afterwards.
    ``generation``: the lease's generation as judged (NO_VALUE: judged without a lease), or None
    to take it as read now (a committed save's leftover lease). A lease that already says
    ``collected`` needs no claim. None on success, else why the save is kept."""
    try:
        got = st.read_each_with_generation([lease_key(sid)], LEASE_MAX_BYTES)[0]
        if isinstance(got, StorageError):
            return f"its lease could not be read ({got.found})"
        value, now = got
        if value is not None and stored_lease(value, now).state == "collected":
            return None
        want = (now if value is not None else NO_VALUE) if generation is None else generation
        if st.write_if(lease_key(sid), collected_lease(sid), want):
            return None
    except CheckpointError as e:
        return f"its lease could not be claimed ({e.found})"
    return "its lease changed since it was judged"


def excluded(st: Storage, save_ids: Iterable[str]) -> frozenset[str]:
    """A save's check, after its own lease pins ``save_ids`` (FORMAT.md 8.4): those whose lease
    says ``collected`` (or cannot be read) must not be referenced."""
    ids = sorted(set(save_ids))
    out = set()
    try:
        leases = st.read_each_with_generation([lease_key(s) for s in ids], LEASE_MAX_BYTES)
    except CheckpointError:
        return frozenset(ids)
    for sid, got in zip(ids, leases):
        if isinstance(got, StorageError) or (got[0] is not None and stored_lease(got[0], got[1]).state == "collected"):
            out.add(sid)
    return frozenset(out)


def remove_save(st: Storage, sid: str) -> None:
    """Delete a claimed save's objects, its lease last (its claim stays visible until then). A
    save folder that is a link is removed itself, never entered."""
    if st.plain_dir(save_prefix(sid)):
        st.delete_prefix(arrays_prefix(sid))
        st.delete_prefix(state_prefix(sid))
    st.delete_prefix(save_prefix(sid))
