"""Test helper: a flat ``{"a/b/c": array}`` dict as the nested dict of torch tensors a torch state
dict holds (the JAX layout's key paths, for ``bridges.torch.save``)."""
from __future__ import annotations

import numpy as np
import torch


def nest_tensors(flat: dict[str, np.ndarray], prefix: str = "") -> dict:
    """``flat`` nested by its ``/``-separated key paths (each under ``prefix`` when given), every
    leaf a torch tensor over a contiguous copy of the array."""
    root: dict = {}
    for key, value in flat.items():
        node = root
        *parts, last = (prefix + key).split("/")
        for part in parts:
            node = node.setdefault(part, {})
        node[last] = torch.from_numpy(np.ascontiguousarray(value))
    return root
