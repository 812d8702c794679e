"""Our tensor arrays are plain zarr v3: tensorstore's zarr3 driver opens and reads them unaided."""
import json
import os

import ml_dtypes
import numpy as np
import tensorstore as ts

from ckptfmt import Repository, SaveOptions
from _layouts import save_threads


def test_tensorstore_reads_our_arrays(tmp_path):
    url = str(tmp_path / "repo")
    arrays = {"a": np.arange(60, dtype=np.float32).reshape(10, 6),
              "b": np.linspace(0, 1, 16).astype(ml_dtypes.bfloat16).reshape(4, 4),
              "c": np.asarray(5, np.int64)}
    # The unpacked layout (FORMAT.md 6.1): zarr opens each array directly. A packed save goes through
    # the reference map (14.4): tests/test_packs.py.
    res = save_threads(url, 3, arrays, {"a": "rows", "b": "grid", "c": "replicated"}, 4,
                       options=SaveOptions(layout="arrays"))
    assert not any(isinstance(r, Exception) for r in res)
    m = Repository(url).manifest(3)
    for key, arr in arrays.items():
        path = os.path.join(url, m.tensors[key].array.path)
        meta = json.load(open(os.path.join(path, "zarr.json")))
        assert meta["codecs"][0]["name"] == "sharding_indexed"
        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path + "/"},
                         "fill_missing_data_reads": False}).result()
        got = store.read().result()
        assert got.dtype == arr.dtype and np.array_equal(got, arr), key


def _file_zarr_json(path, metadata) -> bytes:
    ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path) + "/"}, "metadata": metadata},
            create=True).result()
    return (path / "zarr.json").read_bytes()


def test_the_zarr_json_a_save_writes_is_the_one_tensorstore_writes_on_files(tmp_path):
    """FORMAT.md 14.2, revision 1.2.6: a raw array's zarr.json is written by the save itself, with
    the bytes tensorstore's zarr3 driver writes; compared with an array created on the file
    driver, for dtypes whose fill values are written differently and both codecs. The control: a
    different shape gives different bytes (the comparison can fail)."""
    from ckptfmt import layout
    from ckptfmt.storage._kvstore import zarr_json

    cases = [((10, 6), "float32", (5, 6), (5, 6), "raw"), ((4, 4), "bfloat16", (4, 4), (2, 4), "raw"),
             ((3,), "bool", (3,), (3,), "raw"), ((7, 2), "int64", (7, 2), (7, 2), "raw"),
             ((2,), "complex64", (2,), (2,), "raw"), ((), "uint8", (), (), "raw"),
             ((8, 8), "float16", (4, 8), (2, 8), "zstd")]
    for i, (shape, dtype, shard, chunk, codec) in enumerate(cases):
        md = layout.zarr_array_metadata(shape, dtype, shard, chunk, codec)
        assert zarr_json(md) == _file_zarr_json(tmp_path / str(i), md), (dtype, codec)
    md = layout.zarr_array_metadata((10, 6), "float32", (5, 6), (5, 6))
    assert zarr_json(layout.zarr_array_metadata((10, 7), "float32", (5, 7), (5, 7))) != _file_zarr_json(tmp_path / "x", md)
    # And a save writes exactly those bytes.
    url = str(tmp_path / "repo")
    x = np.arange(60, dtype=np.float32).reshape(10, 6)
    res = save_threads(url, 1, {"a": x}, {"a": "rows"}, 2, options=SaveOptions(layout="arrays"))
    assert not any(isinstance(r, Exception) for r in res)
    t = Repository(url).manifest(1).tensors["a"]
    path = os.path.join(url, t.array.path, "zarr.json")
    saved = json.load(open(path))
    md = layout.zarr_array_metadata(saved["shape"], saved["data_type"], saved["chunk_grid"]["configuration"]["chunk_shape"],
                                    saved["codecs"][0]["configuration"]["chunk_shape"])
    assert open(path, "rb").read() == _file_zarr_json(tmp_path / "y", md)
