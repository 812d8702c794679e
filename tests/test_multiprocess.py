"""Real processes, real files with fsync: 8 writers commit, 4 readers restore; a SIGKILLed writer never publishes."""
import hashlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ckptfmt import Repository
from ckptfmt.coord import free_port
from _layouts import grid_boxes

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
pytestmark = pytest.mark.multiprocess


def start_writers(url, step, world, stall=-1):
    addr = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, os.path.join(HERE, "mp_writer.py"), url, str(step), str(r), str(world), addr, str(stall)],
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]


def expected_digest(step, rank, world):
    sys.path.insert(0, HERE)
    from mp_writer import arrays
    h = hashlib.sha256()
    for key, a in sorted(arrays(step).items()):
        if a.ndim:
            h.update(key.encode() + np.ascontiguousarray(a[grid_boxes(a.shape, [world])[rank].slices()]).tobytes())
        else:
            h.update(key.encode() + a.tobytes())
    return h.hexdigest()


def test_8_writers_4_readers_then_killed_writer(tmp_path):
    url = str(tmp_path / "repo")
    procs = start_writers(url, 10, 8)
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    repo = Repository(url)
    assert repo.steps() == [10]
    m = repo.manifest(10)
    assert m.writers == 8 and len(m.tensors["layer/w"].shards) == 8
    assert sorted(n for n in m.state if n.startswith("rank/")) == [f"rank/{r}" for r in range(8)]

    readers = [subprocess.Popen([sys.executable, os.path.join(HERE, "mp_reader.py"), url, str(r), "4"], env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(4)]
    for r, p in enumerate(readers):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        _, step, nbytes, digest = out.split()
        assert int(step) == 10 and digest == expected_digest(10, r, 4)

    # Step 11: rank 3 stalls in its device->host copy and is SIGKILLed mid-save.
    procs = start_writers(url, 11, 8, stall=3)
    deadline = time.time() + 60
    saves_dir = tmp_path / "repo" / "saves"
    while time.time() < deadline:
        written = [f for f in saves_dir.rglob("*") if "000000000011" in str(f) and ("/p/" in str(f) or "/c/" in str(f))]
        if len(written) >= 4:
            break
        time.sleep(0.1)
    assert written, "other writers never wrote"
    procs[3].send_signal(signal.SIGKILL)
    rcs = [p.wait(timeout=90) for p in procs]
    assert rcs[3] == -signal.SIGKILL
    assert all(rc != 0 for rc in rcs), rcs               # nobody reports success
    errs = " ".join(p.stderr.read() for i, p in enumerate(procs) if i != 3)
    assert "CoordinatorLostError" in errs or "CoordinatorTimeoutError" in errs
    assert repo.steps() == [10] and repo.latest() == 10  # never listed
    repo.verify(10)
    ck = repo.open()
    from mp_writer import arrays
    for k, a in arrays(10).items():
        assert ck.read(k).tobytes() == a.tobytes()
    rep = repo.gc(grace_s=0)
    assert not any("000000000011" in str(f) for f in saves_dir.iterdir()), rep
    repo.verify(10)


def test_coordinator_killed_between_writes_and_commit(tmp_path):
    """Rank 0 (coordinator, lease holder) dies mid-save: nothing listed; gc honours the lease grace, then collects."""
    url = str(tmp_path / "repo")
    procs = start_writers(url, 1, 4)
    assert all(p.wait(timeout=120) == 0 for p in procs)
    procs = start_writers(url, 2, 4, stall=0)
    saves_dir = tmp_path / "repo" / "saves"
    deadline = time.time() + 60
    written = []
    while time.time() < deadline:
        written = [f for f in saves_dir.rglob("*") if "000000000002" in str(f) and ("/p/" in str(f) or "/c/" in str(f))]
        if len(written) >= 3:
            break
        time.sleep(0.1)
    assert written
    procs[0].send_signal(signal.SIGKILL)
    rcs = [p.wait(timeout=60) for p in procs]
    assert rcs[0] == -signal.SIGKILL and all(rc != 0 for rc in rcs[1:])
    assert any("CoordinatorLostError" in p.stderr.read() for p in procs[1:])
    repo = Repository(url)
    assert repo.steps() == [1]
    leftovers = [d.name for d in saves_dir.iterdir() if "000000000002" in d.name]
    assert leftovers and (saves_dir / leftovers[0] / "LEASE").exists()
    rep = repo.gc(grace_s=3600)          # control: a fresh lease means "in progress": untouched
    assert rep.in_progress == leftovers and not rep.removed_saves
    assert (saves_dir / leftovers[0]).exists()
    rep = repo.gc(grace_s=0)             # the lease is now older than the grace period
    assert rep.removed_saves == leftovers
    assert not (saves_dir / leftovers[0]).exists()
    repo.verify(1)
    from mp_writer import arrays
    ck = repo.open()
    assert all(ck.read(k).tobytes() == a.tobytes() for k, a in arrays(1).items())
