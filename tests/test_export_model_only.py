"""``ckptfmt export`` without a mapping (issue 52 item 9): the files hold the model, not the
optimizer's moments and counts (``--optimizer`` keeps them), and ``--ignore`` leaves keys out
without a mapping too; one writer process or two write the same files. Control: a preset-less
export of a checkpoint with no optimizer state writes every tensor."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import ckptfmt
from ckptfmt.restoreplan import is_optimizer_state
from ckptfmt_tools.cli import app

safetensors_numpy = pytest.importorskip("safetensors.numpy")
runner = CliRunner()
MODEL = {"params/dense/kernel": (4, 3), "params/dense/bias": (3,), "params/embed/embedding": (5, 4)}
OPT = {"opt/0/mu/dense/kernel": (4, 3), "opt/0/nu/dense/kernel": (4, 3), "opt/0/count": ()}


def _save(url: str, arrays: dict[str, tuple]) -> None:
    shards = []
    for i, (k, shape) in enumerate(arrays.items()):
        a = np.full(shape, float(i), np.float32)
        shards.append(ckptfmt.LocalShard(k, a.shape, a.dtype, ckptfmt.Box.full(a.shape), a))
    ckptfmt.save(url, 1, shards)


def _written(out: Path) -> set[str]:
    names: set[str] = set()
    for f in out.glob("*.safetensors"):
        names |= set(safetensors_numpy.load_file(str(f)))
    return names


def _export(url: str, out: Path, *args: str) -> dict:
    r = runner.invoke(app, ["export", url, str(out), "--json", *args])
    assert r.exit_code == 0, r.stdout
    return json.loads(r.stdout)["report"]


@pytest.mark.parametrize("processes", ["1", "2"])
def test_export_without_a_mapping_leaves_the_optimizer_out(tmp_path, processes):
    url = str(tmp_path / "repo")
    _save(url, {**MODEL, **OPT})
    report = _export(url, tmp_path / "out", "--processes", processes, "--max-shard-size", "64B")
    assert _written(tmp_path / "out") == set(MODEL) and sorted(report["unmapped"]) == sorted(OPT)
    both = _export(url, tmp_path / "both", "--optimizer")  # asked for: everything
    assert _written(tmp_path / "both") == set(MODEL) | set(OPT) and both["unmapped"] == []


def test_ignore_works_without_a_mapping(tmp_path):
    url = str(tmp_path / "repo")
    _save(url, {**MODEL, **OPT})
    report = _export(url, tmp_path / "out", "--ignore", "params/embed/*", "--optimizer")
    assert _written(tmp_path / "out") == (set(MODEL) | set(OPT)) - {"params/embed/embedding"}
    assert report["unmapped"] == ["params/embed/embedding"]
    human = runner.invoke(app, ["export", url, str(tmp_path / "h"), "--ignore", "opt/*"]).stdout
    assert "not exported (optimizer state or --ignore" in human


def test_a_model_only_checkpoint_exports_every_tensor(tmp_path):
    url = str(tmp_path / "repo")
    _save(url, MODEL)
    assert _export(url, tmp_path / "out")["unmapped"] == [] and _written(tmp_path / "out") == set(MODEL)
    assert all(is_optimizer_state(k) for k in OPT) and not any(is_optimizer_state(k) for k in MODEL)
