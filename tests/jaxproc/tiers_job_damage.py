"""Damage for the local-tier jobs (tests/jaxproc/tiers_job.py, tests/torchproc/tiers_job.py)."""
from __future__ import annotations

import os

from ckptfmt.repository import Repository


def corrupt_own_box(local_dir: str, host: int, step: int) -> str:
    """Flip one data byte of the first own box of ``host``'s local step; return its tensor."""
    repo = Repository(os.path.join(local_dir, f"host-{host}"))
    m = repo.manifest(step)
    key = next(k for k in sorted(m.tensors) if k.startswith(f"h{host}/"))
    t = m.tensors[key]
    path = os.path.join(repo.url, t.object_key(0))
    with open(path, "r+b") as f:  # the shard's first byte, in its pack or its own object
        f.seek(t.shard_start(0))
        b = f.read(1)
        f.seek(t.shard_start(0))
        f.write(bytes([b[0] ^ 0xFF]))
    return key
