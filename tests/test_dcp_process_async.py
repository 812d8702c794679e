"""DCP's process-based async save (``async_checkpointer_type=PROCESS``) through
CkptfmtStorageWriter: the writer pickles to DCP's checkpoint process as its destination and
options only, and a training process SIGKILLed once the staging has returned leaves the committed
step or none (issue 51, item 2)."""
from __future__ import annotations

import json
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ckptfmt  # noqa: E402
from bridges.dcp import CkptfmtStorageReader, CkptfmtStorageWriter  # noqa: E402
from ckptfmt.errors import InvalidOptionError  # noqa: E402
from torchproc.launch import run_world  # noqa: E402


def test_writer_pickles_its_destination_and_options_only(tmp_path):
    """A pickled writer carries url, step, extra, metadata and SaveOptions, never the manifest of
    a previous save; broken controls: a non-JSON extra, an object in metadata, SaveOptions.timings
    and a forged state are refused with InvalidOptionError."""
    url = str(tmp_path / "repo")
    w = CkptfmtStorageWriter(url, step=4, extra={"loss": 1.5}, metadata={"run": "a"},
                             options=ckptfmt.SaveOptions(chunk_target_bytes=1 << 20))
    w.manifest = object()  # what a finished save leaves; must not travel
    copy = pickle.loads(pickle.dumps(w))
    assert (copy.url, copy.step, copy.extra, copy.metadata) == (url, 4, {"loss": 1.5}, {"run": "a"})
    assert copy.options == w.options and copy.manifest is None
    assert set(w.__getstate__()) == {"url", "step", "extra", "options", "metadata"}

    with open(tmp_path / "f", "w") as handle:
        for bad, key in ((CkptfmtStorageWriter(url, step=1, extra={"f": handle}), "extra"),
                         (CkptfmtStorageWriter(url, step=1, metadata={"x": object()}), "metadata"),
                         (CkptfmtStorageWriter(url, step=1, options=ckptfmt.SaveOptions(timings={})), "options.timings"),
                         (CkptfmtStorageWriter(url, step=1, options={"timeout_s": 1}), "options")):
            with pytest.raises(InvalidOptionError) as e:
                pickle.dumps(bad)
            assert e.value.key == key, e.value
    forged = CkptfmtStorageWriter.__new__(CkptfmtStorageWriter)
    with pytest.raises(InvalidOptionError):
        forged.__setstate__({"url": url, "step": 1, "hook": "x"})


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.2)
    return alive


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _restore(url: str, step: int, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A fresh process (this one) loads ``step`` through dcp.load and CkptfmtStorageReader into
    a nested state dict of the shapes in ``like`` (keys: the saved key paths, ``/`` as ``|``)."""
    target: dict = {}
    leaves = {}
    for key, arr in like.items():
        *parents, name = key.split("|")
        node = target
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = leaves[key] = torch.zeros(arr.shape, dtype=torch.float32)
    dcp.load(target, storage_reader=CkptfmtStorageReader(url, step=step), no_dist=True)
    return {key: t.numpy().copy() for key, t in leaves.items()}


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return sorted(got) == sorted(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)


def _kill_run(tmp_path: Path, kill_checkpointer: bool) -> tuple[str, list[dict], dict[str, dict]]:
    url = str(tmp_path / "repo")
    run_world("asyncproc:train_and_kill", 2, tmp_path, {"url": url, "kill_checkpointer": kill_checkpointer,
                                                      "write_bytes_per_s": 150 if kill_checkpointer else 400},
              timeout=150, check=False)
    markers = [json.loads((tmp_path / f"killed-{r}.json").read_text()) for r in range(2)]
    for m in markers:
        assert not _alive(m["pid"]), m
        assert m["steps_at_kill"] == [1], m  # killed before step 2's commit
        assert len(m["children"]) == 1, m  # DCP's checkpoint process
    stuck = _wait_gone([c for m in markers for c in m["children"]], timeout=90)
    for pid in stuck:
        os.kill(pid, 9)
    assert not stuck, f"DCP checkpoint processes outlived the save: {stuck}"
    npz = {name: dict(np.load(tmp_path / f"{name}.npz")) for name in ("step1", "step2", "after")}
    return url, markers, npz


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_process_async_save_survives_the_training_process(tmp_path):
    """2 gloo ranks, async staging (AsyncSaveResponse): the training processes are SIGKILLed once
    staging_completion has returned, before step 2 is listed; DCP's checkpoint processes (their
    own gloo group) finish the two-phase commit, and a fresh process restores step 2 bit for bit:
    the staged values, not the step trained after staging. Control: step 1 restores as saved,
    and the comparison tells steps 1, 2 and the later state apart."""
    url, markers, npz = _kill_run(tmp_path, kill_checkpointer=False)
    assert all(m["response"] == "AsyncSaveResponse" for m in markers), markers
    assert ckptfmt.Repository(url).steps() == [1, 2]
    got = _restore(url, 2, npz["step2"])
    assert _same(got, npz["step2"])
    assert not _same(got, npz["after"]) and not _same(got, npz["step1"])  # control: the check discriminates
    assert _same(_restore(url, 1, npz["step1"]), npz["step1"])


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_process_async_save_killed_with_its_checkpoint_process_lists_the_previous_step(tmp_path):
    """Synchronous staging (a Future), throttled writes; each rank SIGKILLs its checkpoint
    process and then itself before the commit: step 2 is never listed, step 1 restores bit for
    bit in a fresh process, and the next save of step 2 commits over the leftovers."""
    url, markers, npz = _kill_run(tmp_path, kill_checkpointer=True)
    assert all(m["response"] == "Future" for m in markers), markers
    assert ckptfmt.Repository(url).steps() == [1]
    assert _same(_restore(url, 1, npz["step1"]), npz["step1"])
    with pytest.raises(ckptfmt.CheckpointError):
        CkptfmtStorageReader(url, step=2).read_metadata()
    w = torch.arange(8, dtype=torch.float32)
    dcp.save({"w": w}, storage_writer=CkptfmtStorageWriter(url, step=2), no_dist=True)
    assert ckptfmt.Repository(url).steps() == [1, 2]
