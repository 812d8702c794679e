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
