"""Disk full during a save.

First choice: move the repository onto a small tmpfs (``mount -t tmpfs -o size=...``, needs
root), fill it up to a few KiB and run a real save there, so the kernel returns ENOSPC to
tensorstore's file driver. Where mounting is not permitted, the writer process runs with
``RLIMIT_FSIZE`` below a shard object's size, so the same write path fails with EFBIG (the
lowest level we own without a mount: the process's own write limit); the table says which.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["enospc_save", "try_mount_tmpfs"]

#: Free space left on the tmpfs before the save: enough for the lease and a few small objects,
#: not for the whole step.
SLACK_BYTES = 24 << 10


def try_mount_tmpfs(mnt: Path, size: str) -> bool:
    mnt.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def umount(mnt: Path) -> None:
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)


def enospc_save(s: Any, ctx: Any) -> Any:
    from ckptfmt_tools.faults._catalogue import SaveAttempt
    from ckptfmt_tools.faults._procs import start_writers, wait_writers

    mnt = s.root.parent / "tmpfs"
    fsize_limit = None
    if not ctx.force_fsize_fallback and try_mount_tmpfs(mnt, "1m"):
        repo = mnt / "repo"
        shutil.copytree(s.root, repo)
        s.root = repo
        st = os.statvfs(mnt)
        free = st.f_bavail * st.f_frsize
        if ctx.enospc_fill:
            with open(mnt / "filler", "wb") as f:
                f.write(b"\0" * max(0, free - SLACK_BYTES))
        st = os.statvfs(mnt)
        where = f"tmpfs of 1 MiB at <workdir>/tmpfs, filled to {st.f_bavail * st.f_frsize} bytes free"
        cleanup = lambda: umount(mnt)  # noqa: E731
    else:
        fsize_limit = 2048
        where = "RLIMIT_FSIZE=2048 in the writer (tmpfs mount not permitted): write() fails with EFBIG"
        cleanup = None
    if not ctx.enospc_fill:
        fsize_limit = None
    run = wait_writers(start_writers(s.url, [3], 1, s.seed, timeout_s=ctx.save_timeout_s,
                                     fsize_limit=fsize_limit, weaken=ctx.writer_weaken), ctx.save_timeout_s + 10)
    a = SaveAttempt(run.results, where, hung=run.hung, returncodes=run.returncodes)
    for r in run.results:
        if not r.get("ok") and r.get("object"):
            a.where += f"; failed writing {r['object']}"
        found = str(r.get("found") or r.get("message") or "")
        if "No space left" in found or "ENOSPC" in found or "errno=28" in found:
            a.notes.append("the storage error carries ENOSPC")
        if "File too large" in found or "errno=27" in found:
            a.notes.append("the storage error carries EFBIG")
    a.cleanup = cleanup
    if fsize_limit is not None:  # EFBIG is not "disk full": the error must still name the storage failure
        a.names = ("StorageError",)
    return a
