"""ckptfmt.shard's answer to where each byte of a shard lies (ckptfmt/shard/_bytes.py, issue 49
item 3), against real saved shards: its ranges equal what the manifest and the index say, the
bytes at them verify, and together they cover the shard exactly once. Then the rule that keeps it
the one answer: no module outside ckptfmt/shard/ computes with the trailer or index sizes, with its
broken controls."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from ckptfmt import Box, LocalShard, Repository, SaveOptions, save, shard
from ckptfmt.checksum import crc32c
from ckptfmt.manifest import TensorEntry
from ckptfmt.plan import TensorGeometry
from ckptfmt.shard import NOT_STORED, index_entries

ROOT = Path(__file__).resolve().parents[1]


def _saved(tmp_path: Path, codec: str = "raw") -> tuple[Path, object]:
    """x (10, 8) float32 in shards of (8, 8) and chunks of (4, 4): shard 0 stores its 4 inner
    chunks, the edge shard 1 only the top 2 of them (the other two lie outside the array)."""
    x = (np.arange(80, dtype=np.float32).reshape(10, 8) % 5) if codec == "zstd" else np.arange(80, dtype=np.float32).reshape(10, 8)
    root = tmp_path / "r"
    save(str(root), 1, [LocalShard("x", x.shape, x.dtype, Box((0, 0), (8, 8)), x[:8]),
                        LocalShard("x", x.shape, x.dtype, Box((8, 0), (2, 8)), x[8:])],
         options=SaveOptions(chunk_target_bytes=64, codec=codec))
    t = Repository(str(root)).manifest(1).tensors["x"]
    assert t.geometry.inner == (2, 2) and t.array.codec == codec
    return root, t


def _check_every_byte(root: Path, t) -> None:
    """Each shard's ranges against its object's bytes, the manifest and its index."""
    for s in range(len(t.shards)):
        obj = (root / t.object_key(s)).read_bytes()
        sb = shard.shard_bytes(t, s)
        c0, c1 = int(t.chunk_start[s]), int(t.chunk_start[s + 1])
        # Its whole object, or its range of a pack (FORMAT.md 5.15): every other range moves with it.
        assert sb.start == t.shard_start(s) and sb.stop <= len(obj) == t.object_nbytes(s)
        assert sb.whole == (sb.start, sb.stop) and sb.nbytes == int(t.shards.nbytes[s])
        if t.packed is None:
            assert sb.whole == (0, len(obj))
        lo, hi = sb.index
        assert hi == sb.stop and hi - lo == sb.index_len
        shard.check_index(t, s, "o", memoryview(obj[lo:hi]))  # the bytes there are the index
        tlo, thi = sb.index_trailer
        assert (tlo, thi) == (hi - shard.TRAILER_BYTES, hi)
        assert int.from_bytes(obj[tlo:thi], "little") == int(t.shards.index_crc32c[s])
        entries = index_entries(shard.data_and_trailer(obj[lo:hi])[0])
        starts, stops = sb.chunks(slice(c0, c1))
        ranges = []
        for i, c in enumerate(range(c0, c1)):
            a, b = sb.chunk(c)
            off, n = int(t.chunks.offset[c]), int(t.chunks.nbytes[c])
            assert (a, b) == (sb.start + off, sb.start + off + n) == (int(starts[i]), int(stops[i]))
            assert [a - sb.start, b - a] in entries.tolist()  # the index says the same (shard-relative)
            d0, d1 = sb.data(c)
            r0, r1 = sb.trailer(c)
            assert sb.chunk_bounds(c) == (a, d1, b) and (d0, r0, r1) == (a, d1, b) and r1 - r0 == shard.TRAILER_BYTES
            assert crc32c(obj[d0:d1]) == int(t.chunks.crc32c[c]) == int.from_bytes(obj[r0:r1], "little")
            shard.check_chunk(t, c, "o", memoryview(obj[a:b]))
            data, trailer = shard.data_and_trailer(memoryview(obj[a:b]))
            assert bytes(data) == obj[d0:d1] and bytes(trailer) == obj[r0:r1]
            ranges.append((a, b))
        # every byte of the shard lies in exactly one range: the chunks back to back, then the index
        ranges = sorted(ranges) + [(lo, hi)]
        assert ranges[0][0] == sb.start and all(p[1] == q[0] for p, q in zip(ranges, ranges[1:]))
        # the inner chunks that are not stored: the not-stored marker, as many as are missing
        assert int(np.sum(np.all(entries == NOT_STORED, axis=1))) == int(np.prod(t.geometry.inner)) - (c1 - c0)
        # a whole shard's buffer, cut by local(): the same bytes
        mv = memoryview(obj)[slice(*sb.whole)]
        assert bytes(mv[sb.local(sb.index)]) == obj[lo:hi]


def test_ranges_of_raw_shards_one_with_missing_inner_chunks(tmp_path):
    root, t = _saved(tmp_path)
    assert [int(t.chunk_start[s + 1] - t.chunk_start[s]) for s in range(2)] == [4, 2]  # shard 1 lacks 2 of 4
    _check_every_byte(root, t)
    # raw shards are the encoder's layout: the length raw_shard_nbytes gives, scalar and vectorized
    counts = np.diff(t.chunk_start)
    assert np.array_equal(shard.raw_shard_nbytes(t.geometry, counts), t.shards.nbytes)
    assert shard.raw_shard_nbytes(t.geometry, 2) == int(t.shards.nbytes[1])
    enc = shard.encode(0, (1, 0), np.zeros((2, 8), np.float32), t.geometry, (8, 0))
    assert enc.nbytes == shard.raw_shard_nbytes(t.geometry, 2)


def test_ranges_of_a_zstd_tensor(tmp_path):
    root, t = _saved(tmp_path, "zstd")
    assert len(set(t.chunks.nbytes.tolist())) > 1  # encoded chunks differ in size
    _check_every_byte(root, t)
    x = np.arange(80, dtype=np.float32).reshape(10, 8) % 5
    assert np.array_equal(Repository(str(root)).open(1).read("x"), x)


def test_a_range_off_by_one_does_not_verify(tmp_path):
    """Broken control of the byte checks above: the same checks on a range one byte off fail."""
    root, t = _saved(tmp_path)
    obj = (root / t.object_key(0)).read_bytes()
    sb = shard.shard_bytes(t, 0)
    d0, d1 = sb.data(1)
    assert crc32c(obj[d0:d1]) == int(t.chunks.crc32c[1])  # control
    assert crc32c(obj[d0 + 1:d1 + 1]) != int(t.chunks.crc32c[1])
    lo, hi = sb.index
    with pytest.raises(Exception, match="checksum"):
        shard.check_index(t, 0, "o", memoryview(obj[lo - 1:hi - 1]))


def test_a_shard_at_an_offset_shifts_every_range():
    """The ranges are object offsets: a shard starting at byte 100 of its object (what issue 48's
    packed objects need) moves every range by 100, and local() maps them back into its buffer."""
    off, nb = np.array([0, 68], np.int64), np.array([68, 68], np.int64)
    at0, at100 = shard.ShardBytes(0, 204, 68, off, nb), shard.ShardBytes(100, 204, 68, off, nb)
    assert at100.whole == (100, 304) and at100.index == (236, 304) and at100.index_trailer == (300, 304)
    assert at100.chunk(1) == (168, 236) and at100.data(1) == (168, 232) and at100.trailer(1) == (232, 236)
    assert [a.tolist() for a in at100.chunks(slice(0, 2))] == [[100, 168], [168, 236]]
    assert at100.local(at100.chunk(1)) == at0.local(at0.chunk(1)) == slice(68, 136)


# ------------------------------------------------------------------ the one place that knows (issue 49 item 3)
#: Names whose use is a computation of a shard's byte positions or sizes.
_SIZES = frozenset({"index_nbytes", "CRC_BYTES"})
#: The trailer size as shard/ exports it: fine to size a buffer with, not to compute a position.
_TRAILER = "TRAILER_BYTES"
#: Modules outside ckptfmt/shard/ that still compute with them: path -> why. None: the sizes are
#: defined in shard/ (shard_sizes), the manifest's parser sits above it and asks it, and so do the
#: writers. An entry must still offend, so that the list shrinks when the code improves.
ALLOWED: dict[str, str] = {}


def _uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each use of a size name, and of the trailer size inside arithmetic or a
    comparison."""
    out: list[tuple[int, str]] = []
    in_math: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.BinOp, ast.AugAssign, ast.Compare, ast.UnaryOp)):
            in_math |= {id(n) for n in ast.walk(node)}
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else \
            node.name if isinstance(node, ast.FunctionDef) else node.name.split(".")[-1] if isinstance(node, ast.alias) \
            else None  # an import counts by what it imports, whatever it is bound to
        if name in _SIZES or (name == _TRAILER and id(node) in in_math):
            out.append((getattr(node, "lineno", 0), name))
    return out


def position_offenders(root: Path, allowed: dict[str, str], packages: tuple[str, ...] = ("ckptfmt", "ckptfmt_tools")) -> list[str]:
    """Every module under ``packages`` outside ckptfmt/shard/ and not in ``allowed`` that computes
    with a shard's byte sizes, as readable lines; then every allowed module that no longer does."""
    out, seen = [], set()
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            if rel.startswith("ckptfmt/shard/"):
                continue
            uses = _uses(ast.parse(p.read_text(), rel))
            if rel in allowed:
                seen.add(rel) if uses else None
                continue
            out += [f"{rel}:{line} uses {name}: ask ckptfmt.shard (shard_bytes, TRAILER_BYTES) instead"
                    for line, name in uses]
    out += [f"{rel} ({why}) no longer computes shard byte positions: remove it from ALLOWED"
            for rel, why in sorted(allowed.items()) if rel not in seen]
    return out


def test_only_shard_computes_shard_byte_positions():
    assert position_offenders(ROOT, ALLOWED) == []


def test_a_module_computing_positions_is_named(tmp_path):
    """Broken controls on a small tree: a reader that slices with the index size, a trailer sized
    from layout, arithmetic with the exported trailer size, and a stale allowance are each named;
    a module that only sizes a buffer with TRAILER_BYTES, or asks shard/, is not."""
    files = {"ckptfmt/shard/_bytes.py": "CRC_BYTES = 4\nx = CRC_BYTES - 1\n",
             "ckptfmt/reader/ok.py": "from ckptfmt.shard import TRAILER_BYTES, shard_bytes\n"
                                     "buf = bytearray(TRAILER_BYTES)\nlo, hi = shard_bytes(t, s).index\n",
             "ckptfmt_tools/ok.py": "d = {'index_nbytes': 1}\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert position_offenders(tmp_path, {}) == []  # control
    (tmp_path / "ckptfmt/reader/bad.py").write_text("def f(t, n):\n    return n - t.geometry.index_nbytes\n")
    (tmp_path / "ckptfmt_tools/bad.py").write_text("from ckptfmt.layout import CRC_BYTES as K\n")
    (tmp_path / "ckptfmt/reader/math.py").write_text("from ckptfmt.shard import TRAILER_BYTES\nk = 3 * TRAILER_BYTES\n")
    assert position_offenders(tmp_path, {}) == [
        "ckptfmt/reader/bad.py:2 uses index_nbytes: ask ckptfmt.shard (shard_bytes, TRAILER_BYTES) instead",
        "ckptfmt/reader/math.py:2 uses TRAILER_BYTES: ask ckptfmt.shard (shard_bytes, TRAILER_BYTES) instead",
        "ckptfmt_tools/bad.py:1 uses CRC_BYTES: ask ckptfmt.shard (shard_bytes, TRAILER_BYTES) instead"]
    assert position_offenders(tmp_path, {"ckptfmt/reader/ok.py": "why"})[-1] == (
        "ckptfmt/reader/ok.py (why) no longer computes shard byte positions: remove it from ALLOWED")


def test_sizes_of_a_geometry():
    """shard_sizes against FORMAT.md 5.7 and 6.4's arithmetic, written out here: a raw chunk is its
    data and a 4-byte trailer, an index 16 bytes an inner chunk and a trailer (a 0-d tensor: one
    entry); a zstd chunk lies between one byte and zstd's bound, each with the trailer."""
    g = TensorGeometry((10, 6), (4, 6), (2, 3), 4)  # inner (2, 2)
    sz = shard.shard_sizes(g)
    assert (sz.chunk_data, sz.chunk, sz.index) == (24, 2 * 3 * 4 + 4, 4 * 16 + 4)
    assert sz.full == 4 * sz.chunk + sz.index == sz.shard(4) and sz.shard(0) == sz.index
    assert np.array_equal(sz.shard(np.array([1, 4])), [sz.chunk + sz.index, sz.full])
    assert sz.data_stop(sz.full) == 4 * sz.chunk
    assert sz.stored_chunk("raw") == (28, 28)
    assert sz.stored_chunk("zstd") == (5, shard.max_encoded_chunk_nbytes(24)) and shard.max_encoded_chunk_nbytes(24) > 28
    assert shard.shard_sizes(TensorGeometry((), (), (), 8)).index == 20
    body = (5).to_bytes(8, "little") + (28).to_bytes(8, "little")
    data, crc = shard.split_trailer(body + (123).to_bytes(4, "little"))
    assert data == body and crc == 123
    assert index_entries(body).tolist() == [[5, 28]]


def test_a_manifest_entry_is_what_shard_reads():
    """The manifest sits above the shard (tests/test_layering.py): the shard reads a tensor entry
    through the ShardedTensor Protocol, which TensorEntry satisfies. Control: a member it lacks."""
    members = [n for n in vars(shard.ShardedTensor) if not n.startswith("_")] + \
        list(shard.ShardedTensor.__annotations__)
    assert {"geometry", "shards", "chunks", "chunk_start", "shard_start"} <= set(members)
    assert [n for n in members if not hasattr(TensorEntry, n) and n not in TensorEntry.__dataclass_fields__] == []
    assert [n for n in [*members, "trailer_bytes"] if not hasattr(TensorEntry, n)
            and n not in TensorEntry.__dataclass_fields__] == ["trailer_bytes"]
