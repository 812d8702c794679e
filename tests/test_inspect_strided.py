"""``ckptfmt inspect`` shows strided shardings (issue 51, item 6): FSDP2 over tensor parallelism
(``_StridedShard`` on dp, ``Shard`` on tp of one dimension) saved through DCP's
CkptfmtStorageWriter records the partition it is, tp major (``P(("tp", "dp"))``), and a strided
layout no partition describes says so."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ckptfmt  # noqa: E402
from ckptfmt_tools.cli import app  # noqa: E402
from torchproc.launch import run_world  # noqa: E402


@pytest.mark.multiprocess
def test_inspect_shows_fsdp_over_tp_strided_sharding(tmp_path):
    """The recorded partition is checked against the stored boxes (writer = rank = (dp, tp)):
    rows start at (tp * 2 + dp) * 3. Controls: the plain (dp, tp) weight shows no strided mark;
    the uneven strided weight records no partition and inspect counts its boxes instead."""
    from typer.testing import CliRunner

    url = str(tmp_path / "repo")
    res = run_world("strided:fsdp_tp_dcp_save", 4, tmp_path, {"url": url}, timeout=200)
    assert "_StridedShard" in res[0]["placements"]["0.weight"], res[0]
    ckpt = ckptfmt.Repository(url).open(1)
    t = ckpt.tensor("model/0.weight")
    assert t.sharding is not None and t.sharding["partition"] == [["tp", "dp"], None], t.sharding
    for (row, _), writer in zip(t.shards.offset.tolist(), t.shards.writer.tolist()):
        dp, tp = divmod(int(writer), 2)
        assert row == (tp * 2 + dp) * 3, (row, writer)

    runner = CliRunner()
    r = runner.invoke(app, ["inspect", url, "--step", "1", "--json"])
    assert r.exit_code == 0, r.stdout
    rows = {d["key"]: d for d in json.loads(r.stdout)["tensors"]}
    assert rows["model/0.weight"]["sharding_text"] == "torch mesh dp=2xtp=2 P(tp+dp, None) strided (tp major)"
    assert rows["model/2.weight"]["sharding_text"] == "torch mesh dp=2xtp=2 P(dp, tp)"  # control: plain
    odd = rows["odd/0.weight"]
    assert odd["sharding"] is None and odd["sharding_text"].endswith("no partition recorded"), odd
    table = runner.invoke(app, ["inspect", url, "--step", "1", "--wide"], env={"COLUMNS": "220"})
    assert "strided (tp major)" in table.stdout, table.stdout
