"""Step 3 of the save protocol (see :mod:`ckptfmt.session`): write this rank's shards and state
privately, then verify them, and describe them in records the leader builds the manifest from.

A shard is verified by reading back its size, its index checksum, every index entry's byte range,
and every inner chunk's stored crc32c against the crc32c computed from the source bytes. Nothing
here decides whether the save commits: a failure raises, and the protocol reports it.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from . import layout
from ._kvstore import kv_errors
from ._types import Box, LocalShard
from .checksum import crc32c
from .dtypes import numpy_dtype
from .errors import IncompleteSaveError, StepMismatchError
from .manifest import StateEntry
from .plan import TensorWritePlan, WriteItem, stored_chunk_counts
from .storage import Pending, Storage

if TYPE_CHECKING:
    from .session import SaveOptions

__all__ = ["ShardRecord", "write_and_verify", "write_state", "state_to_wire", "state_from_wire"]


@dataclass(frozen=True)
class ShardRecord:
    """One written and verified shard, as its writer acknowledges it to the leader; or, with
    ``ref`` set, a shard this save references in an earlier save (:mod:`ckptfmt._reuse`)."""

    tensor: int                      # the plan's tensor index
    cell: tuple[int, ...]            # grid cell
    nbytes: int                      # object length
    index_crc32c: int
    chunk_offsets: tuple[int, ...]   # stored inner chunks, in C order of the inner grid
    chunk_crc32c: tuple[int, ...]
    ref: tuple[str, str] | None = None  # (save id, array path) of the earlier save holding the object
    chunk_nbytes: tuple[int, ...] = ()  # each stored chunk's length (codec zstd); () means chunk_nbytes each

    def to_wire(self) -> list[Any]:
        return [self.tensor, list(self.cell), self.nbytes, self.index_crc32c, list(self.chunk_offsets),
                list(self.chunk_crc32c), list(self.ref) if self.ref else None, list(self.chunk_nbytes)]

    @classmethod
    def from_wire(cls, v: Sequence[Any]) -> "ShardRecord":
        tensor, cell, nbytes, icrc, offs, crcs, ref, cnb = v
        return cls(int(tensor), tuple(cell), int(nbytes), int(icrc), tuple(offs), tuple(crcs),
                   (str(ref[0]), str(ref[1])) if ref else None, tuple(int(x) for x in cnb))


def state_to_wire(e: StateEntry) -> list[Any]:
    return [e.name, e.key, e.nbytes, e.crc32c, e.scope, e.rank]


def state_from_wire(v: Sequence[Any]) -> StateEntry:
    return StateEntry(*v)


@dataclass(frozen=True)
class _Written:
    """A shard this rank wrote, with the crc32c of each of its inner chunks from the source bytes."""

    plan: TensorWritePlan
    item: WriteItem
    crcs: list[int]


def _holder_order(s: LocalShard) -> tuple[bool, int]:
    return s.data is None, s.replica_id  # data-bearing, lowest replica id first


def _find_holder(shards: list[LocalShard], box: Box) -> LocalShard:
    for s in sorted(shards, key=_holder_order):
        if all(so <= bo and bo + bn <= so + sn for so, sn, bo, bn in zip(s.box.offset, s.box.shape, box.offset, box.shape)):
            return s
    raise StepMismatchError("this rank was assigned a shard it does not hold", key=shards[0].key if shards else None,
                            found=str(box))


def holders(mine: list[tuple[TensorWritePlan, WriteItem]], local: dict[str, list[LocalShard]]) -> list[LocalShard]:
    """The local shard each item is cut from (data-bearing, lowest replica id first), looked up
    once per item; an item whose box is exactly a held box (the usual case) needs no search."""
    exact: dict[str, dict[Box, LocalShard]] = {}
    out = []
    for p, it in mine:
        by_box = exact.get(p.key)
        if by_box is None:
            by_box = exact[p.key] = {}
            for s in sorted(local[p.key], key=_holder_order):
                by_box.setdefault(s.box, s)
        h = by_box.get(it.box)
        out.append(h if h is not None and h.data is not None else _find_holder(local[p.key], it.box))
    return out


#: The per-shard hook of an incremental save (:class:`ckptfmt._reuse.ReusePlanner`): called before
#: a shard is written with (plan, item, holder, materialize), where ``materialize()`` returns the
#: shard's source block (the very block then written) and its chunk crc32c (computed once, shared
#: with the write); ``materialize(False)`` may leave the crc32c out (None). It returns a
#: reference record (the shard is then not written) or None.
Materialize = Callable[..., tuple[np.ndarray, "list[int] | None"]]
ReuseHook = Callable[[TensorWritePlan, WriteItem, LocalShard, Materialize], "ShardRecord | None"]


def write_and_verify(storage: Storage, plans: list[TensorWritePlan], local: dict[str, list[LocalShard]],
                     save_id: str, rank: int, opts: "SaveOptions", reuse: ReuseHook | None = None) -> list[ShardRecord]:
    """Write this rank's shards through tensorstore (rank 0 also every array's zarr.json), then
    verify them; shards the ``reuse`` hook references are not written, and come back as its
    records. Raises StepMismatchError for source data that does not match its declaration,
    StorageError when a write fails, IncompleteSaveError when a shard does not read back as written."""
    if storage.vectored_writes and opts.codec == "raw":  # local files: written straight from the source arrays
        from ._vectorwrite import write_local
        return write_local(storage, plans, local, save_id, rank, opts, reuse=reuse)
    from .session import add_time
    t_begin = time.perf_counter()
    opened: dict[int, Any] = {}
    mine: list[tuple[TensorWritePlan, WriteItem]] = []
    for p in plans:
        items = p.items_for(rank)
        if rank == 0 or items:
            g = p.geometry
            opened[p.index] = storage.open_array(
                layout.array_path(save_id, p.index),
                layout.zarr_array_metadata(g.shape, p.dtype, g.shard_shape, g.chunk_shape, opts.codec, opts.codec_level),
                create=(rank == 0))
        mine.extend((p, it) for it in items)
    handles: dict[int, Any] = {}
    for idx, fut in opened.items():
        with kv_errors("cannot create the tensor array", key=plans[idx].key, object=layout.array_path(save_id, idx)):
            handles[idx] = fut.result()
    if opts.jitter_s > 0 and mine:
        time.sleep(secrets.SystemRandom().uniform(0, opts.jitter_s))
    pending: list[tuple[Any, int]] = []
    written: list[_Written] = []
    cache: dict[int, np.ndarray] = {}
    dt_cache: dict[str, np.dtype] = {}
    inflight, pace_start, paced = 0, time.monotonic(), 0
    # A block made by a callable (lazy data: device-to-host copies, an import's source reads) is
    # let go after its last write is issued, and counted as in flight until the writes drain
    # (they may view it): a save then holds about one such block plus the window, not all of them.
    found = holders(mine, local)
    lazy_last = {id(h): n for n, h in enumerate(found) if callable(h.data)}
    referenced: list[ShardRecord] = []
    for n_item, (p, it) in enumerate(mine):
        holder = found[n_item]
        made: list[tuple[np.ndarray, list[int]]] = []

        def materialize(crcs: bool = True, p: TensorWritePlan = p, it: WriteItem = it,
                        holder: LocalShard = holder) -> tuple[np.ndarray, list[int]]:
            if not made:  # the crc32c are always taken here: this path needs them for the write
                block = shard_block(holder, p, it, cache, dt_cache)
                made.append((block, _chunk_crcs(block, p.geometry.chunk_shape)))
            return made[0]

        ref = reuse(p, it, holder, materialize) if reuse is not None else None
        if ref is not None:
            referenced.append(ref)
            if lazy_last.get(id(holder)) == n_item:
                cache.pop(id(holder), None)
            continue
        block, crcs = materialize()
        written.append(_Written(p, it, crcs))
        with kv_errors("write failed", key=p.key, object=f"{it.cell}"):
            fut = handles[p.index][it.box.slices()].write(block, can_reference_source_data_indefinitely=True)
        pending.append((fut, p.index))
        inflight += block.nbytes
        if lazy_last.get(id(holder)) == n_item:
            inflight += cache.pop(id(holder)).nbytes
        if opts.max_write_bytes_per_s:
            paced += block.nbytes
            ahead = paced / opts.max_write_bytes_per_s - (time.monotonic() - pace_start)
            if ahead > 0:
                time.sleep(ahead)
        if inflight > opts.max_inflight_bytes:
            _drain(pending, plans, save_id)
            inflight = 0
    _drain(pending, plans, save_id)
    cache.clear()
    t = add_time(opts, "write", t_begin)
    try:
        if opts.codec != "raw":
            from ._codec import verify_encoded

            return verify_encoded(storage, written, save_id) + referenced
        return _verify_written(storage, written, save_id) + referenced
    finally:
        add_time(opts, "verify", t)


def shard_block(holder: LocalShard, p: TensorWritePlan, it: WriteItem, cache: dict[int, np.ndarray],
                dt_cache: dict[str, np.dtype]) -> np.ndarray:
    """The C-ordered block of ``it`` cut from its holder's data (materialized once into ``cache``);
    bool stored as 0x00/0x01 only. Raises StepMismatchError for data unlike its declaration."""
    src = cache.get(id(holder))
    if src is None:
        src = cache[id(holder)] = _source(holder, p.key)
    dt = dt_cache.setdefault(p.dtype, numpy_dtype(p.dtype))
    sl = it.box.slices(holder.box.offset)
    block = np.asarray(src[sl] if sl else src[...], dtype=dt, order="C")
    if dt.kind == "b":  # the format stores bool as 0x00/0x01 only; a reinterpreted byte may hold more
        block = np.not_equal(block.view(np.uint8), 0)
    return block


def _source(holder: LocalShard, key: str) -> np.ndarray:
    src = holder.materialize()
    if src.shape != holder.box.shape:
        raise StepMismatchError("shard data shape differs from its box", key=key, expected=holder.box.shape, found=src.shape)
    if src.dtype != holder.dtype:  # never cast silently: the manifest would lie about the bytes
        raise StepMismatchError("shard data dtype differs from the declared dtype", key=key,
                                expected=str(holder.dtype), found=str(src.dtype))
    return src


def _drain(pending: list[tuple[Any, int]], plans: list[TensorWritePlan], save_id: str) -> None:
    for fut, idx in pending:
        with kv_errors("write failed", key=plans[idx].key, object=layout.array_path(save_id, idx)):
            fut.result()
    pending.clear()


def padded_chunks(block: np.ndarray, chunk_shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    """The stored inner chunks of a shard block, in C order, edge chunks zero-padded (FORMAT.md 6.3)."""
    counts = tuple(-(-n // c) for n, c in zip(block.shape, chunk_shape))
    for idx in product(*(range(k) for k in counts)):
        sl = tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, chunk_shape))
        part = block[sl] if sl else block
        if part.shape != tuple(chunk_shape):
            pad = np.zeros(chunk_shape, dtype=block.dtype)
            pad[tuple(slice(0, n) for n in part.shape)] = part
            part = pad
        yield np.ascontiguousarray(part)


def _chunk_crcs(block: np.ndarray, chunk_shape: tuple[int, ...]) -> list[int]:
    """crc32c of each stored inner chunk of a shard block, in C order; edge chunks zero-padded."""
    return [crc32c(part) for part in padded_chunks(block, chunk_shape)]


@dataclass(frozen=True)
class _Readback:
    """The index of one written shard, being read back."""

    written: _Written
    key: str
    total: int           # the object's length, as written
    index: Pending[bytes]


def _verify_written(storage: Storage, written: list[_Written], save_id: str) -> list[ShardRecord]:
    """Read back each written shard's index and every chunk trailer; compare with the source crc32c."""
    reads = []
    for w in written:
        g = w.plan.geometry
        key = layout.shard_key(layout.array_path(save_id, w.plan.index), w.item.cell)
        total = len(w.crcs) * g.chunk_nbytes + g.index_nbytes
        reads.append(_Readback(w, key, total, storage.read_range(key, total - g.index_nbytes, None, tensor=w.plan.key)))
    records: list[ShardRecord] = []
    trailers: list[tuple[_Readback, list[Pending[bytes]]]] = []
    for r in reads:
        p, it, g = r.written.plan, r.written.item, r.written.plan.geometry
        index = r.index.result()
        if len(index) != g.index_nbytes:
            raise IncompleteSaveError("written shard has an unexpected size", key=p.key, object=r.key,
                                      expected=r.total, found=r.total - g.index_nbytes + len(index))
        body, stored = layout.split_trailer(index)
        if crc32c(body) != stored:
            raise IncompleteSaveError("written shard index fails its checksum", key=p.key, object=r.key)
        entries = layout.index_entries(body)
        offs = []
        for cell in product(*(range(k) for k in stored_chunk_counts(g, it.box.offset))):
            flat = int(np.ravel_multi_index(cell, g.inner)) if g.inner else 0
            off, nb = (int(x) for x in entries[flat])
            if nb != g.chunk_nbytes or off + nb > r.total - g.index_nbytes:
                raise IncompleteSaveError("written shard index points at an unexpected byte range", key=p.key,
                                          object=r.key, expected=f"{g.chunk_nbytes} bytes inside the data section",
                                          found=f"[{off}, {off + nb})")
            offs.append(off)
        end = [o + g.chunk_nbytes for o in offs]
        trailers.append((r, [storage.read_range(r.key, e - layout.CRC_BYTES, e, tensor=p.key) for e in end]))
        records.append(ShardRecord(p.index, it.cell, r.total, stored, tuple(offs), tuple(r.written.crcs)))
    for r, futs in trailers:
        for i, (c, f) in enumerate(zip(r.written.crcs, futs)):
            got = int.from_bytes(f.result(), "little")
            if got != c:
                raise IncompleteSaveError("written chunk does not match the source bytes", key=r.written.plan.key,
                                          object=r.key, expected=f"crc32c {c} (chunk {i})", found=f"crc32c {got}")
    return records


def write_state(storage: Storage, save_id: str, rank: int, state: Any, rank_state: Any) -> list[StateEntry]:
    """Write the global state (rank 0) and this rank's own state, then read each back."""
    from .state import encode_state
    items: list[tuple[int | None, bytes]] = []
    if rank == 0 and state is not None:
        items.append((None, encode_state(state)))
    if rank_state is not None:
        items.append((rank, encode_state(rank_state)))
    storage.write_many((layout.state_key(save_id, r), b) for r, b in items)
    out = []
    for r, data in items:
        key = layout.state_key(save_id, r)
        if storage.read(key) != data:
            raise IncompleteSaveError("written state object does not read back identically", object=key)
        out.append(StateEntry(layout.state_name(r), key, len(data), crc32c(data), "global" if r is None else "rank", r))
    return out
