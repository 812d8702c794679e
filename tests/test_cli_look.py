"""``ckptfmt diff``, ``ckptfmt show``, metrics in ``ls``, and the tables that name what they found
(verify's key path and object, inspect's uncut key paths). Each with its broken control."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import ckptfmt
from ckptfmt._types import Box, LocalShard
from ckptfmt.manager import CheckpointManager
from ckptfmt_tools.cli import app
from ckptfmt_tools.faults._scene import flip

runner = CliRunner()
SMALL_CHUNKS = ckptfmt.SaveOptions(chunk_target_bytes=256)


def _save(url: str, step: int, arrays: dict[str, np.ndarray]) -> None:
    shards = [LocalShard(k, a.shape, a.dtype, Box.full(a.shape), a) for k, a in arrays.items()]
    ckptfmt.save(url, step, shards, options=SMALL_CHUNKS)


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": np.arange(8, dtype=np.int64)}


def _json(args: list[str]) -> tuple[int, dict]:
    r = runner.invoke(app, args)
    return r.exit_code, json.loads(r.stdout)


@pytest.fixture
def steps(tmp_path) -> str:
    """Step 1; step 2 the same (referenced); step 3 with w[5, 7] += 0.5; step 4 with b removed and c added."""
    url, a = str(tmp_path / "repo"), _arrays()
    _save(url, 1, a)
    _save(url, 2, a)
    flipped = dict(a, w=a["w"].copy())
    flipped["w"][5, 7] += 0.5
    _save(url, 3, flipped)
    _save(url, 4, {"w": flipped["w"], "c": np.zeros(3, np.float32)})
    return url


def test_diff_identical_steps_shows_no_change(steps):
    for extra in ([], ["--values"]):
        code, doc = _json(["diff", steps, "1", "2", "--json", *extra])
        assert code == 0 and doc["ok"]
        assert doc["added"] == doc["removed"] == doc["changed"] == [] and doc["unchanged"] == 2
    assert doc["referenced_from_a"] and doc["referenced_bytes"] > 0  # step 2 wrote no tensor bytes
    r = runner.invoke(app, ["diff", steps, "1", "2"])
    assert r.exit_code == 0 and "no change" in r.stdout


def test_diff_names_exactly_the_flipped_tensor(steps):
    code, doc = _json(["diff", steps, "2", "3", "--json"])
    assert code == 0 and [(c["key"], c["change"]) for c in doc["changed"]] == [("w", "bytes")]
    assert doc["unchanged"] == 1 and not doc["added"] and not doc["removed"]
    assert doc["changed"][0]["written_bytes"] > 0
    code, doc = _json(["diff", steps, "2", "3", "--json", "--values"])
    (w,) = doc["changed"]
    assert w["change"] == "values" and w["max_abs_diff"] == pytest.approx(0.5, abs=1e-6)
    code, doc = _json(["diff", steps, "3", "4", "--json"])
    assert [t["key"] for t in doc["added"]] == ["c"] and [t["key"] for t in doc["removed"]] == ["b"]
    assert doc["changed"] == [] and doc["unchanged"] == 1
    r = runner.invoke(app, ["diff", steps, "2", "3", "--values"])
    assert r.exit_code == 0 and "values" in r.stdout and "0.5" in r.stdout
    code, doc = _json(["diff", steps, "2", "9", "--json"])
    assert code == 1 and doc["error"] == "StepNotFoundError"


def test_show_reads_only_the_slice(steps):
    want = _arrays()["w"]
    code, part = _json(["show", steps, "w", "--step", "1", "--slice", "0:2,:", "--json"])
    assert code == 0 and part["slice"] == {"text": "0:2,:", "offset": [0, 0], "shape": [2, 32]}
    assert np.array_equal(np.asarray(part["values"], np.float32), want[0:2])
    st = part["stats"]
    assert st["count"] == 64 and st["nan_count"] == 0
    assert st["min"] == pytest.approx(want[0:2].min()) and st["max"] == pytest.approx(want[0:2].max())
    assert st["mean"] == pytest.approx(want[0:2].mean(dtype=np.float64), rel=1e-6)
    code, whole = _json(["show", steps, "w", "--step", "1", "--stats", "--json"])  # control: the whole tensor
    assert code == 0 and "values" not in whole and whole["stats"]["count"] == want.size
    assert part["slice_bytes"] <= part["bytes_read"] < whole["bytes_read"] / 4
    assert whole["bytes_read"] >= want.nbytes
    code, one = _json(["show", steps, "b", "--step", "1", "--slice", "-1", "--json"])
    assert code == 0 and one["values"] == 7 and one["bytes_read"] > 0


def test_show_counts_nans_and_rejects_a_slice_that_does_not_fit(tmp_path):
    url = str(tmp_path / "r")
    _save(url, 1, {"x": np.array([1.0, np.nan, 3.0, np.nan], np.float32)})
    code, doc = _json(["show", url, "x", "--json"])
    assert code == 0 and doc["stats"]["nan_count"] == 2 and doc["stats"]["mean"] == 2.0
    assert doc["values"] == [1.0, None, 3.0, None]
    for bad in ("0:9", "2:1", "0:2:1", "0,0", "a"):
        code, doc = _json(["show", url, "x", "--slice", bad, "--json"])
        assert code == 1 and doc["error"] == "ShapeMismatchError" and doc["key"] == "x", bad
    code, doc = _json(["show", url, "nosuch", "--json"])
    assert code == 1 and not doc["ok"]


def test_ls_shows_the_metrics_each_step_recorded(tmp_path):
    url = str(tmp_path / "r")
    with CheckpointManager(url, async_save=False) as m:
        m.save(1, {"w": np.ones(4, np.float32)}, metrics={"loss": 0.25}, force=True)
        m.save(2, {"w": np.ones(4, np.float32)}, force=True)  # control: no metrics
    code, doc = _json(["ls", url, "--json"])
    assert code == 0 and [s["metrics"] for s in doc["steps"]] == [{"loss": 0.25}, {}]
    r = runner.invoke(app, ["ls", url])
    assert r.exit_code == 0 and "metrics" in r.stdout and "loss=0.25" in r.stdout


def test_verify_table_names_the_key_path_and_object(steps):
    repo = ckptfmt.Repository(steps)
    t = repo.manifest(3).tensors["w"]
    written = [s for s in range(len(t.shards)) if s not in t.objects]
    flip(Path(steps) / t.object_key(written[0]), 8, 4)  # data bytes of w's first chunk in step 3's own shard
    r = runner.invoke(app, ["verify", steps, "--step", "3"])
    assert r.exit_code == 1
    table = r.stdout  # the table alone (the error lines go to stderr)
    assert "ChecksumMismatchError" in table and "w" in table and "saves/" in table and "expected" in table
    clean = runner.invoke(app, ["verify", steps, "--step", "1"])  # control: a clean step
    assert clean.exit_code == 0 and "clean" in clean.stdout and "ChecksumMismatchError" not in clean.stdout


def test_inspect_never_cuts_a_key_path(tmp_path, monkeypatch):
    url, key = str(tmp_path / "r"), "params/" + "/".join(f"layer_{i:02d}" for i in range(14)) + "/kernel"
    _save(url, 1, {key: np.ones((2, 2), np.float32)})
    monkeypatch.setenv("COLUMNS", "80")
    narrow = runner.invoke(app, ["inspect", url])
    assert narrow.exit_code == 0 and "…" not in narrow.stdout
    cells = "".join(line.split("│")[1].strip() for line in narrow.stdout.splitlines() if line.count("│") > 2)
    assert key in cells  # wrapped over lines, every character kept
    wide = runner.invoke(app, ["inspect", url, "--wide"])
    assert wide.exit_code == 0 and key in wide.stdout  # on one line
    assert "1 writer," in wide.stdout and "1 tensor," in wide.stdout


def test_the_command_line_imports_no_library_until_a_command_runs():
    import subprocess
    import sys

    code = "import sys, ckptfmt_tools.cli; print(sorted(m for m in ('ckptfmt', 'numpy', 'tensorstore') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout  # show/diff/ls import theirs when they run
    control = subprocess.run([sys.executable, "-c", code.replace("ckptfmt_tools.cli", "ckptfmt_tools.cli._compare")],
                             capture_output=True, text=True, timeout=60, check=True)
    assert "numpy" in control.stdout  # control: the module the commands import does pull them in
