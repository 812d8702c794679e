"""A writer process: ``python -m ckptfmt.faults._writer '<json task>'``.

It saves one or more steps of the deterministic state in :mod:`ckptfmt.faults._data` as one
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
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

__all__ = ["main", "KillingCoordinator", "WEAKEN"]

#: Broken controls (tests only): each name disables one guarantee of the core in this process.
WEAKEN = {
    # The commit becomes a plain write: a second save of the same step overwrites the first.
    "no_conditional_create": "ckptfmt._kvstore.KvStoreStorage.create_if_absent -> unconditional write",
    # The commit fence becomes the old check-then-create: read the lease, then create the manifest.
    "no_commit_fence": "ckptfmt.session._Heartbeat.begin_commit -> holds() (a check, not a conditional write)",
}


def _weaken(name: str) -> None:
    if name == "no_conditional_create":
        from ckptfmt._kvstore import KvStoreStorage

        def create_if_absent(self, key: str, data: bytes) -> bool:
            self.write(key, data)
            return True

        KvStoreStorage.create_if_absent = create_if_absent
    elif name == "no_commit_fence":
        from ckptfmt.session import _Heartbeat

        def begin_commit(self) -> bool:
            self._stop.set()
            return self.holds()

        _Heartbeat.begin_commit = begin_commit
    else:
        raise ValueError(f"unknown weakening {name!r}; known: {sorted(WEAKEN)}")


def _freeze() -> None:
    print(json.dumps({"event": "frozen", "pid": os.getpid()}), flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def _install_freeze(point: str, *, old_protocol: bool) -> None:
    """Stop this process at a commit moment (see the module docstring). ``old_protocol``: the
    ``no_commit_fence`` weakening is on, so the fence is the old check."""
    from ckptfmt.manifest import step_of_manifest_key
    from ckptfmt.session import _Heartbeat
    from ckptfmt._kvstore import KvStoreStorage as Storage

    if point == "before_fence":
        fence = _Heartbeat.begin_commit

        def begin_commit(self) -> bool:
            # Freeze only once no heartbeat write is in flight: a process stopped inside one holds
            # the lease's lock file, and gc's claim would wait on it for ever.
            self._stop.set()
            with self._lock:
                pass
            if old_protocol:  # the old protocol: check first, then stall before the create
                ok = fence(self)
                _freeze()
                return ok
            _freeze()
            return fence(self)

        _Heartbeat.begin_commit = begin_commit
    elif point == "before_create":
        create = Storage.create_if_absent

        def create_if_absent(self, key: str, data: bytes) -> bool:
            if step_of_manifest_key(key) is not None:
                _freeze()
            return create(self, key, data)

        Storage.create_if_absent = create_if_absent
    else:
        raise ValueError(f"unknown freeze point {point!r}")


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
    from ckptfmt.faults import _data

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
                time.sleep(0.03)
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
    from ckptfmt.faults import _data

    rank, world, seed = task["rank"], task["world"], task["seed"]
    if task.get("weaken"):
        _weaken(task["weaken"])
    if task.get("freeze") and rank == 0:
        _install_freeze(task["freeze"], old_protocol=task.get("weaken") == "no_commit_fence")
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
            shards = _data.local_shards(seed, step, rank, world, data_hook=hook)
            if task.get("announce"):
                print(json.dumps({"event": "start", "rank": rank, "step": step, "t": time.time()}), flush=True)
            t0 = time.perf_counter()
            try:
                if task.get("publish_first"):
                    m = _publish_first(task["url"], step, shards, seed, options)
                else:
                    m = ckptfmt.save(task["url"], step, shards,
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
