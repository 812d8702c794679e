"""A writer process: ``python -m ckptfmt_tools.faults._writer '<json task>'``.

It saves one or more steps of the deterministic state in :mod:`ckptfmt_tools.faults._data` as one
rank of a real multi-process save (TcpCoordinator; LocalCoordinator when world is 1), and
prints one JSON line per step: ``{"rank", "step", "ok", "save_id"}`` or the typed error.

Kill points (the process SIGKILLs itself, so the kill lands at a known protocol moment):

``"during_write"``   while the save materializes this rank's second tensor block, i.e. after
                     the plan was agreed and possibly after some of its shards were written,
                     before its acknowledgement (so before publication);
``"before_commit"``  right after the acknowledgement all-gather returns on this rank, i.e.
                     every writer has written and acknowledged, and the commit is next.

Freeze points (the process prints ``{"event": "frozen"}`` and SIGSTOPs itself; the parent
resumes it with SIGCONT, as a SLURM suspend or a paused VM would):

``"before_fence"``   rank 0, right before its commit fence (the switch of its lease to
                     ``committing``, FORMAT.md 8.3). With the ``no_commit_fence`` weakening, right
                     after the old pre-commit lease check, i.e. between the check and the create;
``"before_create"``  rank 0, right before the conditional create of the manifest (after the fence).

Other task keys: ``heartbeat_s`` (the lease refresh interval), ``go_file`` (wait until this file exists before saving), ``rendezvous`` (a
directory: the first block's data callable waits until ``rendezvous_n`` writers reached it, so
concurrent saves are all past the start of ``save()`` before any commits), ``announce`` (print
``{"event": "start"}`` right before ``save()``, for the soak's kill timer), ``fsize_limit``
(RLIMIT_FSIZE, the ENOSPC fallback when a tmpfs cannot be mounted), ``publish_first`` and
``weaken`` (broken controls, see :data:`WEAKEN` and :func:`_publish_first`).

Weakenings and freeze points act through a storage wrapper
(:class:`ckptfmt_tools.faults._storage.FaultyStorage`) handed to the save's Repository; the
library is never patched.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from ckptfmt_tools.faults._storage import WEAKEN as WEAKEN

__all__ = ["main", "KillingCoordinator", "WEAKEN"]


def _freeze() -> None:
    print(json.dumps({"event": "frozen", "pid": os.getpid()}), flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class KillingCoordinator:
    """Delegates to a real coordinator; SIGKILLs this process after the all-gather of the acks."""

    def __init__(self, inner: Any, ack_name: str = "save/ack") -> None:
        self._inner = inner
        self._ack = ack_name
        self.rank, self.world = inner.rank, inner.world

    def barrier(self, name: str, timeout_s: float | None = None) -> None:
        self._inner.barrier(name, timeout_s)

    def allgather(self, name: str, payload: bytes, timeout_s: float | None = None) -> list[bytes]:
        out = self._inner.allgather(name, payload, timeout_s)
        if name == self._ack:
            _die()
        return out

    def broadcast(self, name: str, payload: bytes | None, root: int = 0,
                  timeout_s: float | None = None) -> bytes:
        return self._inner.broadcast(name, payload, root, timeout_s)

    def close(self) -> None:
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()


def _publish_first(url: str, step: int, shards: list, seed: int, options: Any) -> Any:
    """Broken control for the soak: a commit protocol that publishes the manifest first.

    It saves correctly into a private scratch repository, then copies into ``url`` in the wrong
    order: the manifest, then the objects one by one (so a kill in between leaves a listed,
    partial step). Single writer only.
    """
    import shutil
    import tempfile
    from pathlib import Path

    import ckptfmt
    from ckptfmt_tools.faults import _data

    with tempfile.TemporaryDirectory() as scratch:
        m = ckptfmt.save(scratch, step, shards, state=_data.global_state(seed, step),
                         rank_state=_data.rank_state(seed, step, 0), metadata={"seed": seed}, options=options)
        src, dst = Path(scratch), Path(url)
        (dst / "manifests").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / "manifests" / f"{step:020d}.json", dst / "manifests" / f"{step:020d}.json")
        for p in sorted((src / "saves").rglob("*")):
            if p.is_file():
                out = dst / p.relative_to(src)
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, out)
                time.sleep(0.1)  # the copy is most of the save: kills land in it under any load
    return m


def _rendezvous(directory: str, n: int, timeout_s: float = 20.0) -> None:
    """Wait until ``n`` processes reached this point (each leaves a file in ``directory``).

    Called from inside a save (while it materializes its first block), so that every
    participant is past the save's start before any of them can commit.
    """
    from pathlib import Path

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(d.glob("ready-*"))) < n and time.monotonic() < deadline:
        time.sleep(0.002)


def run(task: dict[str, Any]) -> list[dict[str, Any]]:
    import ckptfmt
    from ckptfmt import LocalCoordinator, SaveOptions, TcpCoordinator
    from ckptfmt.errors import CheckpointError
    from ckptfmt_tools.faults import _data
    from ckptfmt_tools.faults._storage import FaultyStorage

    rank, world, seed = task["rank"], task["world"], task["seed"]
    repo: Any = task["url"]
    freeze = task.get("freeze") if rank == 0 else None
    if task.get("weaken") or freeze:
        repo = ckptfmt.Repository(task["url"], storage=FaultyStorage(
            ckptfmt.Repository(task["url"]).storage, weaken=task.get("weaken"), freeze=freeze, on_freeze=_freeze))
    kill = task.get("kill") if task.get("kill_rank", 0) == rank else None
    if task.get("fsize_limit"):
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write(), not a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (task["fsize_limit"], task["fsize_limit"]))
    if task.get("go_file"):
        deadline = time.monotonic() + 60
        while not os.path.exists(task["go_file"]) and time.monotonic() < deadline:
            time.sleep(0.002)
    timeout_s = float(task.get("timeout_s", 30))
    if world == 1:
        coord: Any = LocalCoordinator()
    else:
        coord = TcpCoordinator(task["address"], rank, world, timeout_s=timeout_s)
    if kill == "before_commit":
        coord = KillingCoordinator(coord)

    def hook(i: int, block):
        if kill == "during_write" and i >= 1:
            def data():
                _die()
            return data
        if task.get("rendezvous") and i == 0:
            def data():
                _rendezvous(task["rendezvous"], int(task.get("rendezvous_n", 2)))
                return block
            return data
        return block

    results = []
    options = SaveOptions(timeout_s=timeout_s, chunk_target_bytes=_data.CHUNK_TARGET_BYTES,
                          heartbeat_s=float(task.get("heartbeat_s") or 10.0))
    try:
        for step in task["steps"]:
            shards = _data.local_shards(seed, step, rank, world, data_hook=hook,
                                        incremental=bool(task.get("incremental")))
            if task.get("announce"):
                print(json.dumps({"event": "start", "rank": rank, "step": step, "t": time.time()}), flush=True)
            t0 = time.perf_counter()
            try:
                if task.get("publish_first"):
                    m = _publish_first(task["url"], step, shards, seed, options)
                else:
                    m = ckptfmt.save(repo, step, shards,
                                 state=_data.global_state(seed, step) if rank == 0 else None,
                                 rank_state=_data.rank_state(seed, step, rank),
                                 metadata={"seed": seed}, coordinator=coord, options=options)
                results.append({"rank": rank, "step": step, "ok": True, "save_id": m.save_id,
                                "seconds": time.perf_counter() - t0})
            except CheckpointError as exc:
                results.append({"rank": rank, "step": step, "ok": False, **exc.to_json()})
            except BaseException as exc:  # an untyped error is a finding, report it as such
                results.append({"rank": rank, "step": step, "ok": False, "error": type(exc).__name__,
                                "message": str(exc)[:500], "untyped": True})
            print(json.dumps(results[-1], default=str), flush=True)
    finally:
        close = getattr(coord, "close", None)
        if close is not None:
            close()
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    results = run(json.loads(argv[0]))
    return 0 if all(r["ok"] for r in results) else 3


if __name__ == "__main__":
    sys.exit(main())
