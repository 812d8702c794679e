"""bridges.dcp: torch.distributed.checkpoint loads a ckptfmt checkpoint through its own planner."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bridges import torch as bt  # noqa: E402
from bridges.dcp import CkptfmtStorageReader  # noqa: E402
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


@pytest.mark.multiprocess
def test_dcp_reshards_and_fails_closed(tmp_path):
    res = run_world("dcp_world", 4, tmp_path, {"url": str(tmp_path / "repo")})
    for r in res:
        assert all(r["ok"].values()), r["ok"]
        assert "ChecksumMismatchError" in r["corrupt"], r["corrupt"][:500]
    assert all(r["bytes_read"] > 0 for r in res)
    # bridges._torchcoord.TorchCoordinator, exercised in the same ranks (saves use it too)
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
