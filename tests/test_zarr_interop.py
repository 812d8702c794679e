"""Our tensor arrays are plain zarr v3: tensorstore's zarr3 driver opens and reads them unaided."""
import json
import os

import ml_dtypes
import numpy as np
import tensorstore as ts

from ckptfmt import Repository
from _layouts import save_threads


def test_tensorstore_reads_our_arrays(tmp_path):
    url = str(tmp_path / "repo")
    arrays = {"a": np.arange(60, dtype=np.float32).reshape(10, 6),
              "b": np.linspace(0, 1, 16).astype(ml_dtypes.bfloat16).reshape(4, 4),
              "c": np.asarray(5, np.int64)}
    res = save_threads(url, 3, arrays, {"a": "rows", "b": "grid", "c": "replicated"}, 4)
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
