"""Test helpers: two manifests' tensor tables compared column by column; a random edit of one
column of a manifest document (hypothesis)."""
from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import numpy as np
from hypothesis import strategies as st


def same_tables(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """Assert that two ``{key: TensorEntry}`` maps hold the same entries, every column equal."""
    assert list(a) == list(b)
    for k in a:
        x, y = a[k], b[k]
        assert (x.shape, x.dtype, x.sharding, x.array) == (y.shape, y.dtype, y.sharding, y.array), k
        assert x.shards.key == y.shards.key, k
        for f in ("offset", "writer", "nbytes", "index_crc32c"):
            assert np.array_equal(getattr(x.shards, f), getattr(y.shards, f)), (k, f)
        for f in ("offset", "nbytes", "crc32c"):
            assert np.array_equal(getattr(x.chunks, f), getattr(y.chunks, f)), (k, f)
        assert np.array_equal(x.chunk_start, y.chunk_start), k


def mutate(d: dict, data: Any, columns: Sequence[tuple[str, ...]], values: Any) -> None:
    """Replace one drawn column of one drawn tensor of the document ``d`` (or one of its elements,
    or one element of a row) by a drawn value."""
    key = data.draw(st.sampled_from(sorted(d["tensors"])), label="tensor")
    path = data.draw(st.sampled_from(list(columns)), label="column")
    parent = d["tensors"][key]
    for p in path[:-1]:
        parent = parent[p]
    # A copy: a strategy's sampled literal (a list) is one object shared by every example, and a
    # second edit of the same column could otherwise put that list inside itself.
    col, value = parent[path[-1]], copy.deepcopy(data.draw(values, label="value"))
    if isinstance(col, list) and col and data.draw(st.booleans(), label="element"):
        i = data.draw(st.integers(0, len(col) - 1), label="index")
        if isinstance(col[i], list) and col[i] and data.draw(st.booleans(), label="inner"):
            col[i][data.draw(st.integers(0, len(col[i]) - 1), label="inner index")] = value
        else:
            col[i] = value
    else:
        parent[path[-1]] = value
