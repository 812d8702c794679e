"""bridges.dcp: torch.distributed.checkpoint loads a ckptfmt checkpoint through its own planner."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bridges import torch as bt  # noqa: E402
import bridges.dcp  # noqa: E402
from bridges.dcp import CkptfmtStorageReader, CkptfmtStorageWriter, unwrap  # noqa: E402
from ckptfmt.errors import CheckpointError, ChecksumMismatchError, StepAlreadyCommittedError  # noqa: E402
from torchproc.launch import run_world  # noqa: E402


def test_metadata_translation(tmp_path):
    url = str(tmp_path / "repo")
    bt.save(url, {"model": {"fc.weight": torch.ones(6, 4), "fc.bias": torch.ones(6).bfloat16()},
                  "s": torch.tensor(1.0)}, step=3)
    md = CkptfmtStorageReader(url).read_metadata()
    assert sorted(md.state_dict_metadata) == ["model.fc.bias", "model.fc.weight", "s"]
    w = md.state_dict_metadata["model.fc.weight"]
    assert tuple(w.size) == (6, 4) and w.properties.dtype == torch.float32
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in w.chunks] == [((0, 0), (6, 4))]
    assert md.state_dict_metadata["model.fc.bias"].properties.dtype == torch.bfloat16
    assert tuple(md.state_dict_metadata["s"].size) == ()
    assert CkptfmtStorageReader.validate_checkpoint_id(url)
    assert not CkptfmtStorageReader.validate_checkpoint_id(str(tmp_path / "nothing"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_load_single_process(tmp_path):
    url = str(tmp_path / "repo")
    src = {"model": {"fc.weight": torch.randn(6, 4), "fc.bias": torch.randn(6).bfloat16()}, "s": torch.tensor(2.0)}
    bt.save(url, src, step=1)
    target = {"model": {"fc.weight": torch.zeros(6, 4), "fc.bias": torch.zeros(6, dtype=torch.bfloat16)},
              "s": torch.tensor(0.0)}
    dcp.load(target, storage_reader=CkptfmtStorageReader(url), no_dist=True)
    for k in ("fc.weight", "fc.bias"):
        assert torch.equal(target["model"][k], src["model"][k])
    assert float(target["s"]) == 2.0


def _docs_pattern() -> str:
    """The except pattern bridges/dcp/_reader.py's docstring shows (the API reference renders it)."""
    blocks = re.findall(r"```python\n(.*?)```", bridges.dcp.__doc__, re.S)
    assert len(blocks) == 1 and "unwrap(e)" in blocks[0], "bridges/dcp/_reader.py lost its except pattern"
    return blocks[0]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_ckptfmt_errors_arrive_wrapped_by_dcp_and_unwrap_finds_them(tmp_path):
    """Issue 47 D: through dcp.save / dcp.load a ckptfmt refusal arrives inside DCP's
    CheckpointException, a BaseException, so ``except ckptfmt.CheckpointError`` and ``except
    Exception`` miss it. ``unwrap`` returns the typed error inside: a refused save (the step is
    already committed), a corrupted repository's load, an async_save's future; the docstring's
    pattern, run verbatim, re-raises it as a CheckpointError. Broken controls: the clean save and
    load succeed; DCP's own refusal (a target of another shape) and plain errors unwrap to None."""
    from torch.distributed.checkpoint.api import CheckpointException

    url = str(tmp_path / "repo")
    w = torch.arange(64, dtype=torch.float32)
    dcp.save({"w": w}, storage_writer=CkptfmtStorageWriter(url, step=1), no_dist=True)
    target = {"w": torch.zeros(64)}
    dcp.load(target, storage_reader=CkptfmtStorageReader(url), no_dist=True)
    assert torch.equal(target["w"], w)

    with pytest.raises(CheckpointException) as e:
        dcp.save({"w": torch.ones(64)}, storage_writer=CkptfmtStorageWriter(url, step=1), no_dist=True)
    assert not isinstance(e.value, Exception)  # the trap the docs describe
    err = unwrap(e.value)
    assert isinstance(err, StepAlreadyCommittedError) and err is e.value.failures[0][0]

    scope = {"dcp": dcp, "CkptfmtStorageWriter": CkptfmtStorageWriter, "state": {"w": torch.ones(64)},
             "url": url, "step": 1}
    with pytest.raises(CheckpointError) as typed:  # the documented pattern makes it catchable
        exec(compile(_docs_pattern(), "bridges/dcp/_reader.py docstring", "exec"), scope)
    assert isinstance(typed.value, StepAlreadyCommittedError) and isinstance(typed.value.__cause__, CheckpointException)

    fut = dcp.async_save({"w": torch.ones(64)}, storage_writer=CkptfmtStorageWriter(url, step=1))
    with pytest.raises(CheckpointException) as e:
        fut.result(timeout=60)
    assert isinstance(unwrap(e.value), StepAlreadyCommittedError)

    with pytest.raises(CheckpointException) as e:  # control: DCP's own refusal is no ckptfmt error
        dcp.load({"w": torch.zeros(65)}, storage_reader=CkptfmtStorageReader(url), no_dist=True)
    assert unwrap(e.value) is None

    shard = next(p for p in Path(url).rglob("*") if p.is_file() and "/p/" in str(p))  # the pack (FORMAT.md 5.15)
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0x40
    shard.write_bytes(bytes(raw))
    target = {"w": torch.zeros(64)}
    with pytest.raises(CheckpointException) as e:
        dcp.load(target, storage_reader=CkptfmtStorageReader(url), no_dist=True)
    err = unwrap(e.value)
    assert isinstance(err, ChecksumMismatchError) and err.key == "w"
    assert float(target["w"].sum()) == 0  # nothing copied in

    assert unwrap(err) is err and unwrap(ValueError("x")) is None
    try:
        raise RuntimeError("wrapped by a caller") from err
    except RuntimeError as chained:
        assert unwrap(chained) is err


@pytest.mark.multiprocess
def test_dcp_reshards_and_fails_closed(tmp_path):
    res = run_world("dcp_world", 4, tmp_path, {"url": str(tmp_path / "repo")})
    for r in res:
        assert all(r["ok"].values()), r["ok"]
        assert "ChecksumMismatchError" in r["corrupt"], r["corrupt"][:500]
    assert all(r["bytes_read"] > 0 for r in res)
    # bridges.torch._coord.TorchCoordinator, exercised in the same ranks (saves use it too)
    for rank, r in enumerate(res):
        c = r["coord"]
        assert c["broadcast"] == "from-2" and c["mismatch"] == "CheckpointError", c
        assert c["after_error"] == "unusable", c
        assert c.get("timeout") == (None if rank == 3 else "missing [3]"), c


@pytest.mark.multiprocess
def test_dcp_writer_saves_every_kind_of_state_and_loads_at_another_world(tmp_path):
    """Issue 26: dcp.save / dcp.async_save with CkptfmtStorageWriter on 4 ranks write committed
    ckptfmt steps (no pickle in storage); dcp.load on 2 ranks restores tensors, param groups, the
    LR scheduler and a Stateful loader. Control: an unencodable value commits nothing."""
    import pickletools  # noqa: F401  (the scan below looks for pickle protocol headers)

    url = str(tmp_path / "repo")
    saved = run_world("dcp_writer_save", 4, tmp_path, {"url": url})
    for r in saved:
        assert r["steps"] == [1, 2], r
        assert "InvalidStateError" in r["bad"] and "bad/fn" in r["bad"], r["bad"][:500]
    for p in Path(url).rglob("*"):
        if p.is_file():
            head = p.read_bytes()[:2]
            assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), p
    assert not list(Path(url).rglob(".metadata"))
    for r in run_world("dcp_writer_load", 2, tmp_path, {"url": url}):
        assert r["tensors_ok"], r
        assert r["lr"] == saved[0]["lr"] and r["bt_lr"] == saved[0]["lr"], (r, saved[0]["lr"])
        assert r["groups"][0]["betas"] == [0.9, 0.99] or tuple(r["groups"][0]["betas"]) == (0.9, 0.99), r
        assert r["groups"][0]["weight_decay"] == 0.05, r
        assert r["sched"]["last_epoch"] == saved[0]["sched"]["last_epoch"] == 3, (r, saved[0])
        assert r["cursor"] == 38, r
