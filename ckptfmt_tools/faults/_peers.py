"""What Orbax and torch DCP do for the same faults, measured on this machine in the same run.

Only faults with an honest equivalent in the peer's own default format are measured: bytes
flipped in the middle of the largest data file, a data file deleted or truncated, a data file
replaced by the same file of an earlier save (stale), and the metadata file deleted, truncated
or replaced by non-JSON text. Each peer runs in its own process
(``python -m ckptfmt_tools.faults._peers orbax|dcp WORKDIR``): it saves the same arrays as the fixture
(steps 1 and 2), applies one fault per fresh copy, restores step 2 into zeroed targets, and
classifies what came back: ``WRONG VALUES, no error``, ``raised <Type>`` (and whether that is
an ``Exception`` at all), or ``restored correctly`` (the fault missed live bytes).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

__all__ = ["peer_outcome", "run_peers", "PEER_FAULTS"]

PEER_FAULTS = ("shard-missing", "shard-truncated", "shard-stale", "data-bitflip", "data-64-bytes",
               "manifest-missing", "manifest-truncated", "manifest-not-json")
_PKG_ROOT = str(Path(__file__).resolve().parents[2])
_cache: dict[str, dict[str, dict[str, str]]] = {}  # workdir -> {fault: {peer: outcome}}


def run_peers(workdir: Path, timeout_s: float = 300) -> dict[str, dict[str, str]]:
    """Run both peers once (results are cached per workdir); {fault: {peer: outcome}}."""
    key = str(workdir)
    if key in _cache:
        return _cache[key]
    out: dict[str, dict[str, str]] = {f: {} for f in PEER_FAULTS}
    env = dict(os.environ, PYTHONPATH=_PKG_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    for peer in ("orbax", "dcp"):
        d = Path(workdir) / f"_peer_{peer}"
        try:
            r = subprocess.run([sys.executable, "-m", "ckptfmt_tools.faults._peers", peer, str(d)], capture_output=True,
                               text=True, timeout=timeout_s, env=env)
            res = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            res = None
        for f in PEER_FAULTS:
            out[f][peer] = res.get(f, "-") if res else "not measured (peer run failed)"
    _cache[key] = out
    return out


def peer_outcome(fault: str, run_dir: Path) -> dict[str, str]:
    """The peers' outcome for ``fault`` (measured once per table run, in ``run_dir``'s parent)."""
    if fault not in PEER_FAULTS:
        return {"orbax": "-", "dcp": "-"}
    return run_peers(Path(run_dir).parent)[fault]


# ------------------------------------------------------------------------ child side


def _largest(root: Path, pattern: Callable[[Path], bool]) -> Path:
    files = [p for p in root.rglob("*") if p.is_file() and pattern(p)]
    return max(files, key=lambda p: p.stat().st_size)


def _classify(restore: Callable[[], dict[str, Any]], truth: dict[str, Any]) -> str:
    import numpy as np

    try:
        got = restore()
    except BaseException as exc:  # noqa: BLE001 - DCP raises a BaseException subclass
        kind = "" if isinstance(exc, Exception) else " (BaseException)"
        return f"raised {type(exc).__name__}{kind}"
    wrong = [k for k in truth if np.asarray(got[k]).tobytes() != truth[k].tobytes()]
    return "WRONG VALUES, no error" if wrong else "restored correctly"


def _inject(fault: str, step1: Path, step2: Path, data: Callable[[Path], bool], meta: Path) -> None:
    if fault == "shard-missing":
        _largest(step2, data).unlink()
    elif fault == "shard-truncated":
        p = _largest(step2, data)
        os.truncate(p, p.stat().st_size // 2)
    elif fault == "shard-stale":
        p = _largest(step2, data)
        shutil.copyfile(step1 / p.relative_to(step2), p) if (step1 / p.relative_to(step2)).exists() else \
            shutil.copyfile(_largest(step1, data), p)
    elif fault in ("data-bitflip", "data-64-bytes"):
        p = _largest(step2, data)
        b = bytearray(p.read_bytes())
        mid = len(b) // 2
        if fault == "data-bitflip":
            b[mid] ^= 0x10
        else:
            for i in range(mid, min(len(b), mid + 64)):
                b[i] ^= 0xFF
        p.write_bytes(bytes(b))
    elif fault == "manifest-missing":
        meta.unlink()
    elif fault == "manifest-truncated":
        meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    elif fault == "manifest-not-json":
        meta.write_text("format: ckptfmt\nstep: 2\n")


def _run_orbax(work: Path) -> dict[str, str]:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from ckptfmt_tools.faults import _data

    ckptr = ocp.StandardCheckpointer()
    truth = {s: _data.truth(7, s) for s in (1, 2)}
    for s in (1, 2):
        ckptr.save((work / f"clean{s}").absolute(), {k.replace("/", "."): jax.numpy.asarray(v)
                                                     for k, v in truth[s].items()})
        ckptr.wait_until_finished()
    flat = {k.replace("/", "."): v for k, v in truth[2].items()}
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in flat.items()}
    out = {}
    for fault in PEER_FAULTS:
        s1, s2 = work / fault / "s1", work / fault / "s2"
        shutil.copytree(work / "clean1", s1)
        shutil.copytree(work / "clean2", s2)
        _inject(fault, s1, s2, lambda p: "/d/" in str(p), s2 / "_METADATA")
        out[fault] = _classify(lambda: {k: np.asarray(v) for k, v in ckptr.restore(s2.absolute(), target).items()},
                               flat)
    return out


def _run_dcp(work: Path) -> dict[str, str]:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from ckptfmt_tools.faults import _data

    warnings.filterwarnings("ignore")
    truth = {s: _data.truth(7, s) for s in (1, 2)}
    for s in (1, 2):
        dcp.save({k: torch.from_numpy(v.copy()) for k, v in truth[s].items()}, checkpoint_id=str(work / f"clean{s}"))
    out = {}
    for fault in PEER_FAULTS:
        s1, s2 = work / fault / "s1", work / fault / "s2"
        shutil.copytree(work / "clean1", s1)
        shutil.copytree(work / "clean2", s2)
        _inject(fault, s1, s2, lambda p: p.suffix == ".distcp", s2 / ".metadata")

        def restore(s2: Path = s2) -> dict[str, Any]:
            target = {k: torch.zeros(v.shape, dtype=torch.from_numpy(v[:0]).dtype) for k, v in truth[2].items()}
            dcp.load(target, checkpoint_id=str(s2))
            return {k: v.numpy() for k, v in target.items()}

        out[fault] = _classify(restore, truth[2])
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    peer, work = argv[0], Path(argv[1])
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res = _run_orbax(work) if peer == "orbax" else _run_dcp(work)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
