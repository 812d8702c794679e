"""A training loop whose repository's file system fails for a few saves, then recovers.

Run by tests/test_save_failures.py inside ``unshare -Urm`` (a user and mount namespace of its own,
so it may mount without privileges): it mounts a small tmpfs at ``<dir>/repo``, saves every step
with a checkpoint manager, breaks the file system for the saves of ``--broken`` steps for real
(``full``: a filler file takes every free page, ENOSPC; ``ro``: the tmpfs is remounted read-only,
EROFS), mends it, and prints one JSON line: the manager's history, the steps the repository
lists, what every step restores to, the metrics file's events, and the step at which the loop
stopped on an error (None: it never stopped).

    python savefail_job.py DIR --fault full|ro --framework core|jax|torch [--fail-fast N] [--blocking]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

STEPS = 8
BROKEN = (2, 3, 4)  # the 3 saves in a row the storage fails


def _state(framework: str, step: int):
    w = np.full((64, 256), step, np.float32)  # 64 KiB
    if framework == "jax":
        import jax.numpy as jnp
        return {"w": jnp.asarray(w)}
    if framework == "torch":
        import torch
        return {"w": torch.from_numpy(w.copy())}
    return {"w": w}


def _manager(framework: str, url: str, **kw):
    if framework == "jax":
        from bridges.jax import CheckpointManager
    elif framework == "torch":
        from bridges.torch import CheckpointManager
    else:
        from ckptfmt.manager import CheckpointManager
    return CheckpointManager(url, **kw)


def _break(fault: str, repo: str) -> None:
    if fault == "ro":
        subprocess.run(["mount", "-o", "remount,ro", repo], check=True)
        return
    fd = os.open(os.path.join(repo, "filler"), os.O_WRONLY | os.O_CREAT)  # every free page of the tmpfs
    try:
        for size in (1 << 20, 4096):
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError:
                pass
        # 16 KiB free again: a save's lease and small objects fit, its 64 KiB shard does not, so the
        # save fails in the middle of its writes and must remove what it wrote.
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - (16 << 10)))
    finally:
        os.close(fd)


def _mend(fault: str, repo: str) -> None:
    if fault == "ro":
        subprocess.run(["mount", "-o", "remount,rw", repo], check=True)
    else:
        os.remove(os.path.join(repo, "filler"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--fault", choices=("full", "ro"), required=True)
    ap.add_argument("--framework", choices=("core", "jax", "torch"), default="core")
    ap.add_argument("--fail-fast", type=int, default=None, help="max_consecutive_failures (the control)")
    ap.add_argument("--blocking", action="store_true")
    args = ap.parse_args()

    from ckptfmt import Box, Repository
    from ckptfmt.manager import SaveFailurePolicy

    repo = os.path.join(args.dir, "repo")
    os.makedirs(repo, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", repo], check=True)
    metrics = os.path.join(args.dir, "metrics.jsonl")  # outside the mount: a remount ro needs no open file there
    policy = SaveFailurePolicy(retries=2, backoff_s=0.01, max_backoff_s=0.05,
                               max_consecutive_failures=args.fail_fast if args.fail_fast else 5)
    m = _manager(args.framework, repo, save_every_steps=1, keep_last=2, metrics_file=metrics,
                 async_save=not args.blocking, failure_policy=policy)
    stopped = error = broken_listing = None
    try:
        for step in range(1, STEPS + 1):
            if step == BROKEN[0]:
                _break(args.fault, repo)
            if step == BROKEN[-1] + 1:
                broken_listing = Repository(repo).steps()  # the newest committed step, still there
                _mend(args.fault, repo)
            m.save(step, _state(args.framework, step))
            m.wait()  # each save ends before the file system changes under the next one
        m.close()
    except Exception as e:  # noqa: BLE001 - reported: the control's policy raises
        stopped, error = step, f"{type(e).__name__}: {e}"
        try:
            m.close()
        except Exception:  # noqa: BLE001
            pass
    r = Repository(repo)
    steps = r.steps()
    restored = {s: float(r.open(s).read("w", Box.full((64, 256)))[0, 0]) for s in steps}
    events = [json.loads(x) for x in open(metrics).read().splitlines()] if os.path.exists(metrics) else []
    print(json.dumps({"history": [h.to_json() for h in m.history], "steps": steps, "restored": restored,
                      "events": events, "stopped": stopped, "error": error,
                      "listed_while_broken": broken_listing, "save_dirs": len(os.listdir(os.path.join(repo, "saves")))}))


if __name__ == "__main__":
    main()
