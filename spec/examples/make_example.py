"""Regenerate the worked example of spec/FORMAT.md section 12, deterministically.

    .venv/bin/python spec/examples/make_example.py            # rewrites spec/examples/repo/
    .venv/bin/python spec/examples/make_example.py --out DIR  # writes a fresh repository at DIR

Two writers (two threads, each with its own TcpCoordinator on 127.0.0.1) save step 7:

  opt/count      int32    []     replicated on both writers; written once, by rank 0
  params/b       bfloat16 [3]    rank 0 holds [0:2], rank 1 holds [2:3]   (padded edge chunk)
  params/w       float32  [5, 3] rank 0 holds rows [0:3], rank 1 rows [3:5] (torch.chunk split;
                                 one inner chunk lies wholly outside the tensor)

plus a small global msgpack state. The save id, creation time, versions and chunk target
are fixed, so every byte of the output is reproducible; tests/test_golden.py regenerates it
and compares it with the committed files byte for byte.

The revision 1.1 example (spec/examples/repo-1.1/, FORMAT.md 5.13 and 8.4) is one writer saving
step 1 and step 2 of a frozen base and a trained adapter: step 2 references step 1's object of
``base/w`` (extension ``ckptfmt.references``) and writes only ``adapter/a``.

    .venv/bin/python spec/examples/make_example.py --v11 --out DIR  # a fresh 1.1 repository at DIR

The revision 1.2 example (spec/examples/repo-1.2/, FORMAT.md 5.14) is the section 12 example saved
with ``SaveOptions(manifest_columns="derived")``: the same objects byte for byte, and a manifest
whose tensor entries leave out the five columns their geometry determines.

    .venv/bin/python spec/examples/make_example.py --v12 --out DIR  # a fresh 1.2 repository at DIR

Revision 1.2.7 adds three more (spec/examples/README.md):

- spec/examples/repo-zstd/: the section 12 example saved with ``SaveOptions(codec="zstd")``
  (FORMAT.md 6.3, extension ``ckptfmt.zstd``): ``--zstd``.
- spec/examples/verified/: the verification record (FORMAT.md 10.4) of the section 12 example's
  step 7, with fixed POSIX stamps, and the stamp list it digests: ``--verified``.
- spec/examples/profiles/: the state objects of the PyTorch profile (FORMAT.md 13.3, written by
  ``bridges.torch.save``) and of a local-tier step (8.5, 13.1, written by the local tier's own
  save) for a small fixed state: ``--profiles`` (needs torch).

Revision 1.3 adds spec/examples/repo-packed/: the section 12 example saved with the default
``SaveOptions(layout="packed")`` (FORMAT.md 5.15, extension ``ckptfmt.packs``): each writer's
shards back to back in one pack object, the same shard bytes as repo/: ``--packed``. The other
examples are saved with ``layout="arrays"`` (one object per shard), as before revision 1.3.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a plain checkout
import ckptfmt  # noqa: E402
from ckptfmt import Box, LocalShard, SaveOptions, TcpCoordinator, TensorSharding  # noqa: E402
from ckptfmt.coord import free_port  # noqa: E402

STEP = 7
SAVE_ID = "000000000007-20260101T000000-0badcafe"
CREATED_UNIX = 1767225600.0  # 2026-01-01T00:00:00Z, the time in SAVE_ID
CHUNK_TARGET_BYTES = 12      # small on purpose: gives params/w inner chunks of one row
# Fixed, so that the manifest does not change with the interpreter or library patch level.
VERSIONS = {"ckptfmt": "0.1.0", "python": "3.11", "numpy": "2.4.6", "tensorstore": "0.1.86"}
METADATA = {"note": "ckptfmt spec/FORMAT.md worked example"}
WORLD = 2

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "repo"
DEFAULT_OUT_V11 = HERE / "repo-1.1"
DEFAULT_OUT_V12 = HERE / "repo-1.2"
DEFAULT_OUT_ZSTD = HERE / "repo-zstd"
DEFAULT_OUT_PACKED = HERE / "repo-packed"
DEFAULT_OUT_VERIFIED = HERE / "verified"
DEFAULT_OUT_PROFILES = HERE / "profiles"
#: The run identity the tier-profile example records (FORMAT.md 8.5: 32 lowercase hex digits).
PROFILE_RUN = "0123456789abcdef0123456789abcdef"
#: The record's time, a fixed verification time (2026-01-01T00:01:00Z).
VERIFIED_UNIX = 1767225660.0
#: The revision 1.1 example: two steps of one writer, save ids and times fixed.
V11_SAVES = {1: ("000000000001-20260101T000000-0000beef", 1767225601.0),
             2: ("000000000002-20260101T000000-0001beef", 1767225602.0)}
V11_METADATA = {"note": "ckptfmt spec/FORMAT.md 5.13 example (revision 1.1)"}


def tensors() -> dict[str, np.ndarray]:
    """The global values of the example's tensors."""
    return {
        "opt/count": np.array(7, dtype=np.int32),
        "params/b": np.array([1.0, -2.0, 0.5], dtype=ml_dtypes.bfloat16),
        "params/w": np.arange(15, dtype=np.float32).reshape(5, 3),
    }


def global_state() -> dict:
    return {"epoch": 1, "data_cursor": 640, "rng_key": np.array([0, 42], dtype=np.uint32)}


# The informative sharding description: a 1-d mesh of the two writers, axis "data".
SPLIT = TensorSharding(framework="numpy", mesh_shape=(2,), axis_names=("data",), partition=(("data",),))
SPLIT_ROWS = TensorSharding(framework="numpy", mesh_shape=(2,), axis_names=("data",), partition=(("data",), None))
REPLICATED = TensorSharding(framework="numpy", mesh_shape=(2,), axis_names=("data",), partition=(),
                            replicated_axes=("data",))


def local_shards(rank: int) -> list[LocalShard]:
    """What each writer holds: boxes in global coordinates, plus replica ids."""
    t = tensors()
    rows = {0: (0, 3), 1: (3, 5)}[rank]     # torch.chunk(5 rows, 2) -> 3, 2
    bias = {0: (0, 2), 1: (2, 3)}[rank]
    return [
        LocalShard("opt/count", (), np.int32, Box((), ()), t["opt/count"], replica_id=rank, sharding=REPLICATED),
        LocalShard("params/b", (3,), ml_dtypes.bfloat16, Box((bias[0],), (bias[1] - bias[0],)),
                   t["params/b"][bias[0]:bias[1]], sharding=SPLIT),
        LocalShard("params/w", (5, 3), np.float32, Box((rows[0], 0), (rows[1] - rows[0], 3)),
                   t["params/w"][rows[0]:rows[1]], sharding=SPLIT_ROWS),
    ]


def generate(out: str | os.PathLike[str], manifest_columns: str = "explicit", codec: str = "raw",
             layout: str = "arrays") -> ckptfmt.Manifest:
    """Write the example repository at ``out`` (which must not exist yet) and return its manifest.
    ``manifest_columns="derived"`` gives the revision 1.2 example (FORMAT.md 5.14), ``codec="zstd"``
    the compressed one (6.3), ``layout="packed"`` the revision 1.3 one (5.15: each writer's shards
    in one pack object)."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a fresh directory")
    out.mkdir(parents=True)
    options = SaveOptions(save_id=SAVE_ID, created_unix=CREATED_UNIX, chunk_target_bytes=CHUNK_TARGET_BYTES,
                          timeout_s=60.0, manifest_columns=manifest_columns, codec=codec, layout=layout)
    address = f"127.0.0.1:{free_port()}"
    results: dict[int, object] = {}

    def writer(rank: int, coord: TcpCoordinator) -> None:
        try:
            with coord:
                # direct_writes off: a packed writer may leave gaps to align O_DIRECT runs where
                # the file system takes them (FORMAT.md 5.15); the example's bytes must not
                # depend on the file system it is generated on.
                repo = ckptfmt.Repository(str(out), options={"direct_writes": False})
                results[rank] = ckptfmt.save(repo, STEP, local_shards(rank), state=global_state(),
                                             metadata=METADATA, coordinator=coord, versions=VERSIONS,
                                             options=options)
        except BaseException as e:  # reported below, on the main thread
            results[rank] = e

    coord0 = TcpCoordinator(address, 0, WORLD, timeout_s=60.0)   # rank 0 listens first
    t0 = threading.Thread(target=writer, args=(0, coord0))
    t0.start()
    t1 = threading.Thread(target=lambda: writer(1, TcpCoordinator(address, 1, WORLD, timeout_s=60.0)))
    t1.start()
    t0.join()
    t1.join()
    for rank in range(WORLD):
        if isinstance(results.get(rank), BaseException):
            raise results[rank]  # type: ignore[misc]
    return results[0]  # type: ignore[return-value]


def v11_tensors(step: int) -> dict[str, np.ndarray]:
    """The revision 1.1 example's tensors at ``step``: ``base/w`` frozen, ``adapter/a`` trained."""
    return {"adapter/a": np.array([0.5, -1.0, 2.0], dtype=np.float32) * step,
            "base/w": np.arange(12, dtype=np.float32).reshape(4, 3)}


def generate_v11(out: str | os.PathLike[str]) -> ckptfmt.Manifest:
    """Write the revision 1.1 example at ``out`` (which must not exist yet); step 2's manifest."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a fresh directory")
    out.mkdir(parents=True)
    m = None
    for step, (save_id, created) in V11_SAVES.items():
        shards = [LocalShard(k, v.shape, v.dtype, Box.full(v.shape), v) for k, v in v11_tensors(step).items()]
        m = ckptfmt.save(str(out), step, shards, metadata=V11_METADATA, versions=VERSIONS,
                         options=SaveOptions(save_id=save_id, created_unix=created, reuse="compare", timeout_s=60.0,
                                             layout="arrays"))
    assert m is not None and m.must_understand == ("ckptfmt.references",), "step 2 must reference step 1"
    return m


def posix_stamps(objects: list[tuple[str, int]]) -> list[str]:
    """Fixed stamps in the POSIX form of FORMAT.md 10.4 (size:dev:ino:mtime_ns:ctime_ns), as if
    every object were written at 2026-01-01T00:00:00Z on device 2049 (8:1), inodes from 1000."""
    base = int(CREATED_UNIX) * 10**9
    return [f"{n}:2049:{1000 + i}:{base}:{base + 123456789 + i}" for i, (_, n) in enumerate(objects)]


def generate_verified(out: str | os.PathLike[str], repo: str | os.PathLike[str] = DEFAULT_OUT) -> bytes:
    """Write ``VERIFIED`` (the record of step 7 of ``repo``) and ``stamps.txt`` (the stamp list it
    digests) at ``out`` (which must not exist yet); return the record."""
    from ckptfmt.layout import manifest_key
    from ckptfmt.repository import _verified
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a fresh directory")
    data = (Path(repo) / manifest_key(STEP)).read_bytes()
    m = ckptfmt.parse_manifest(data)
    objects = _verified._objects(m)
    stamps = posix_stamps(objects)
    record = _verified.record_bytes(_verified._bindings(m, data, stamps), VERIFIED_UNIX, m.nbytes)
    out.mkdir(parents=True)
    (out / "stamps.txt").write_bytes(_verified.stamp_lines(objects, stamps))
    (out / "VERIFIED").write_bytes(record)
    return record


#: The small state of the profile examples: one tensor, one object, the caller's extra.
PROFILE_TOKEN = "0123456789abcdef-7"


def generate_profiles(out: str | os.PathLike[str]) -> None:
    """Write the state objects of the PyTorch profile and of a local-tier step at ``out`` (which
    must not exist yet): ``torch-global.msgpack`` and ``torch-rank-00000.msgpack`` as
    ``bridges.torch.save`` writes them (no RNG states), ``tier-global.msgpack`` as the local tier
    writes host 0 of 2's step 7 holding its own box and host 1's replica."""
    import tempfile

    import torch

    from bridges import torch as bt
    from ckptfmt.manager._tiers import write_local_step
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a fresh directory")
    with tempfile.TemporaryDirectory() as tmp:
        state = {"model": {"fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
                 "optim": {"param_groups": [{"lr": 0.01, "params": [0]}]}}
        m = bt.save(f"{tmp}/torch", state, step=STEP, extra={"epoch": 1}, rank_state={"cursor": 640},
                    save_rng=False, options=SaveOptions(save_id=SAVE_ID, created_unix=CREATED_UNIX))
        torch_global = Path(tmp, "torch", m.state["global"].key).read_bytes()
        torch_rank = Path(tmp, "torch", m.state["rank/0"].key).read_bytes()
        g = ckptfmt.state.decode_state(torch_global)
        w = state["model"]["fc.weight"].numpy()
        boxes = [(0, ("model/fc.weight", (4, 3), np.float32, Box((0, 0), (2, 3)), w)),
                 (1, ("model/fc.weight", (4, 3), np.float32, Box((2, 0), (2, 3)), w + 6))]
        lm = write_local_step(ckptfmt.Repository(f"{tmp}/local/host-0"), STEP, 0, 2, PROFILE_TOKEN, boxes, g, None,
                              run=PROFILE_RUN)
        tier_global = Path(tmp, "local", "host-0", lm.state["global"].key).read_bytes()
    out.mkdir(parents=True)
    (out / "torch-global.msgpack").write_bytes(torch_global)
    (out / "torch-rank-00000.msgpack").write_bytes(torch_rank)
    (out / "tier-global.msgpack").write_bytes(tier_global)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="a fresh directory (default: rewrite spec/examples/repo)")
    ap.add_argument("--v11", action="store_true", help="the revision 1.1 example (default out: spec/examples/repo-1.1)")
    ap.add_argument("--v12", action="store_true", help="the revision 1.2 example (default out: spec/examples/repo-1.2)")
    ap.add_argument("--zstd", action="store_true", help="the zstd example (default out: spec/examples/repo-zstd)")
    ap.add_argument("--packed", action="store_true", help="the revision 1.3 example (default out: spec/examples/repo-packed)")
    ap.add_argument("--verified", action="store_true", help="the verification record (default out: spec/examples/verified)")
    ap.add_argument("--profiles", action="store_true", help="the profile state objects (default out: spec/examples/profiles)")
    args = ap.parse_args(argv)
    default = (DEFAULT_OUT_V11 if args.v11 else DEFAULT_OUT_V12 if args.v12 else DEFAULT_OUT_ZSTD if args.zstd
               else DEFAULT_OUT_PACKED if args.packed
               else DEFAULT_OUT_VERIFIED if args.verified else DEFAULT_OUT_PROFILES if args.profiles else DEFAULT_OUT)
    if args.out is None:
        if default.exists():
            shutil.rmtree(default)
        out = default
    else:
        out = Path(args.out)
    if args.verified or args.profiles:
        generate_verified(out) if args.verified else generate_profiles(out)
        m = None
    else:
        m = (generate_v11(out) if args.v11 else generate(out, "derived") if args.v12
             else generate(out, codec="zstd") if args.zstd else generate(out, layout="packed") if args.packed
             else generate(out))
    for p in sorted(out.rglob("*")):
        if p.is_file():
            print(f"{p.stat().st_size:6d}  {p.relative_to(out)}")
    if m is not None:
        print(f"committed step {m.step}, save id {m.save_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
