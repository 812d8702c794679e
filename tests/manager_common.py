"""Helpers shared by the manager tests and their JAX / torch worker processes (no framework imports)."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

from ckptfmt import Repository, TcpCoordinator
from ckptfmt.manager import CheckpointManager

__all__ = ["eval_loss", "flip_one_shard", "fork_children", "TwoRankManager"]


class TwoRankManager(CheckpointManager):
    """Rank ``rank`` of 2 in this process (threads), over TcpCoordinators: ``addrs[0]`` the
    manager's, ``addrs[1]`` its saves'. Subclasses give ``_save_verb``, saving through
    ``self._save_coord`` as rank ``self._r``."""

    def __init__(self, repo, rank: int, addrs: list[str], **kw) -> None:
        self._r, self._addrs = rank, addrs
        super().__init__(repo, **kw)
        self._save_coord = TcpCoordinator(addrs[1], rank, 2, timeout_s=30)

    def _process(self) -> tuple[int, int]:
        return self._r, 2

    def _new_coordinator(self) -> TcpCoordinator:
        return TcpCoordinator(self._addrs[0], self._r, 2, timeout_s=30)


def eval_loss(step: int) -> float:
    """A made-up eval loss that is not monotone in the step: of the saves at 5, 10, ..., 40 the two
    best are 15 (0.2) and 30 (0.3), and the newest (40) is not among them."""
    return round(((step * 7) % 13) / 10 + 0.1, 3)


def flip_one_shard(url: str, step: int, *, writer: int | None = None) -> dict:
    """Flip one data byte of one shard object of committed ``step`` (local repositories only).

    The shard is one of the largest tensor's, written by ``writer`` when given. Returns what was hit.
    """
    m = Repository(url).manifest(step)
    t = max(m.tensors.values(), key=lambda e: (e.nbytes, e.key))
    writers = [int(w) for w in t.shards.writer]
    s = writers.index(writer) if writer is not None else 0
    obj = t.object_key(s)
    with open(os.path.join(url, obj), "r+b") as f:
        f.seek(8)  # inside the first stored chunk's data
        b = f.read(1)
        f.seek(8)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    return {"tensor": t.key, "object": obj, "writer": writers[s]}


def fork_children(spec_path: str, run: Callable[[list[str]], None]) -> None:
    """Fork one child per entry of the spec (``[{"name", "argv"}]``) that calls ``run(argv)``.

    Beside the spec: ``<name>.pid`` (written right after the fork), ``<name>.err`` (the child's
    output) and ``<name>.rc`` (its exit code, negative for a signal). An entry with ``"wait_for":
    PATH`` is forked once PATH is a non-empty file (at most 120 s later). Returns when all have exited.
    """
    work = os.path.dirname(os.path.abspath(spec_path))
    children = {}
    for child in json.load(open(spec_path)):
        deadline = time.monotonic() + 120
        while child.get("wait_for") and time.monotonic() < deadline:
            if os.path.exists(child["wait_for"]) and os.path.getsize(child["wait_for"]) > 0:
                break
            time.sleep(0.05)
        pid = os.fork()
        if pid == 0:
            fd = os.open(os.path.join(work, child["name"] + ".err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = 0
            try:
                run(child["argv"])
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children[pid] = child["name"]
        with open(os.path.join(work, child["name"] + ".pid"), "w") as f:
            f.write(str(pid))
    while children:
        pid, status = os.waitpid(-1, 0)
        name = children.pop(pid, None)
        if name is not None:
            with open(os.path.join(work, name + ".rc"), "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
