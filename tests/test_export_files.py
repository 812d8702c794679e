"""The files an export creates in OUT (ckptfmt/interop/_exportfiles.py, issue 24 items 5 and 11): a link
planted at any temporary or final name is refused with a typed error and the file it points to
outside OUT is left as it was; an existing ``config.json`` is refused like existing weights; a
model config nested too deeply (or containing itself) is a typed error before anything is
written. Every fault has its broken control: a clean OUT exports, and the reference
``safetensors`` reader loads it."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

safetensors_numpy = pytest.importorskip("safetensors.numpy")

import ckptfmt  # noqa: E402
from ckptfmt import Box, LocalShard  # noqa: E402
from ckptfmt_tools.cli import app  # noqa: E402
from ckptfmt.interop._exportfiles import MAX_CONFIG_NESTING, read_config, temp_name  # noqa: E402
from ckptfmt.errors import CheckpointError, InvalidConfigError, OutputExistsError  # noqa: E402
from ckptfmt.interop import (begin_export, export_safetensors, finish_export, prepare_export,  # noqa: E402
                             write_part)

INDEX = "model.safetensors.index.json"
CONFIG = {"model_type": "llama", "hidden_size": 8, "rope_scaling": {"type": "linear", "factor": 2.0}}
VICTIM = b"precious bytes outside OUT\n"


@pytest.fixture
def repo(tmp_path) -> tuple[str, dict[str, np.ndarray]]:
    """A committed step of three tensors; exported with max_shard_size=1000 it makes 2 files."""
    rng = np.random.default_rng(3)
    t = {"a": rng.standard_normal((16, 16)).astype(np.float32), "b": np.arange(200, dtype=np.int32),
         "c": rng.standard_normal((4,)).astype(np.float32)}
    url = str(tmp_path / "repo")
    ckptfmt.save(url, 1, [LocalShard(k, v.shape, v.dtype, Box.full(v.shape), v) for k, v in t.items()])
    return url, t


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "outside" / "victim.bin"
    v.parent.mkdir(exist_ok=True)
    v.write_bytes(VICTIM)
    return v


def _names(url: str) -> list[str]:
    _, plan, _ = prepare_export(url, max_shard_size=1000)
    return [f.name for f in plan.files] + [INDEX, "config.json"]


def _loads_back(out: Path, t: dict[str, np.ndarray]) -> None:
    index = json.loads((out / INDEX).read_text())
    got = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(safetensors_numpy.load_file(str(out / f)))
    assert got.keys() == t.keys() and all(np.array_equal(got[k], v) for k, v in t.items())
    assert json.loads((out / "config.json").read_text()) == CONFIG


def test_clean_out_exports_and_loads(repo, tmp_path):
    """The control of every test below: a clean OUT gets 2 files, config.json and the index, no
    temporary file is left, and the reference reader loads every tensor."""
    url, t = repo
    out = tmp_path / "out"
    r = export_safetensors(url, str(out), max_shard_size=1000, config=CONFIG)
    assert len(r.files) == 2
    assert sorted(p.name for p in out.iterdir()) == sorted(r.files + (INDEX, "config.json"))
    _loads_back(out, t)


@pytest.mark.parametrize("which", ["temp", "final"])
def test_a_link_planted_at_any_name_is_refused_before_writing(repo, tmp_path, which):
    """A link at each temporary name and each final name (weights, index, config.json), pointing
    outside OUT: OutputExistsError (a CheckpointError and a FileExistsError), the file outside
    unchanged, no file of the export left in OUT. Control: the clean export above."""
    url, t = repo
    victim = _victim(tmp_path)
    for i, name in enumerate(_names(url)):
        out = tmp_path / f"out-{which}-{i}"
        out.mkdir()
        planted = out / (temp_name(name) if which == "temp" else name)
        planted.symlink_to(victim)
        with pytest.raises(OutputExistsError) as e:
            export_safetensors(url, str(out), max_shard_size=1000, config=CONFIG)
        assert isinstance(e.value, CheckpointError) and isinstance(e.value, FileExistsError)
        assert victim.read_bytes() == VICTIM, name
        assert [p.name for p in out.iterdir()] == [planted.name], name
        planted.unlink()
        export_safetensors(url, str(out), max_shard_size=1000, config=CONFIG)  # control: the same OUT, cleaned
        _loads_back(out, t)


def test_a_link_planted_after_the_checks_is_never_followed(repo, tmp_path):
    """The race the up-front check cannot close: a link planted between begin_export and the
    write (at a temporary name) or between the write and finish_export (at each final name).
    write_part / finish_export refuse with OutputExistsError, the file outside is unchanged, and
    nothing of the export is left; the same steps on an untouched OUT publish a loadable export."""
    url, t = repo
    victim = _victim(tmp_path)
    ckpt, plan, _ = prepare_export(url, max_shard_size=1000)
    out = tmp_path / "race-temp"
    begin_export(str(out), plan, CONFIG)
    (out / temp_name(plan.files[1].name)).symlink_to(victim)
    with pytest.raises(OutputExistsError):
        write_part(ckpt, plan, str(out))
    assert victim.read_bytes() == VICTIM
    assert [p.name for p in out.iterdir()] == [temp_name(plan.files[1].name)]  # its own first file removed
    for name in [f.name for f in plan.files] + ["config.json", INDEX]:
        out = tmp_path / f"race-{name}"
        begin_export(str(out), plan, CONFIG)
        write_part(ckpt, plan, str(out))
        (out / name).symlink_to(victim)
        with pytest.raises(OutputExistsError):
            finish_export(str(out), plan, CONFIG)
        assert victim.read_bytes() == VICTIM, name
        assert [p.name for p in out.iterdir()] == [name], name  # only the planted link
    out = tmp_path / "race-control"
    begin_export(str(out), plan, CONFIG)
    write_part(ckpt, plan, str(out))
    finish_export(str(out), plan, CONFIG)
    _loads_back(out, t)


def test_an_existing_config_json_is_refused_like_existing_weights(repo, tmp_path):
    """config.json already in OUT (a regular file) is not replaced: OutputExistsError, its bytes
    kept. Controls: the same OUT without a config to write exports (the file is not ours to
    touch, and stays); weights already there are refused as before."""
    url, _ = repo
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"theirs": true}')
    with pytest.raises(OutputExistsError, match="already exists"):
        export_safetensors(url, str(out), config=CONFIG)
    assert (out / "config.json").read_text() == '{"theirs": true}' and not (out / INDEX).exists()
    export_safetensors(url, str(out))
    assert (out / "config.json").read_text() == '{"theirs": true}' and (out / INDEX).exists()
    with pytest.raises(OutputExistsError, match="already holds"):
        export_safetensors(url, str(tmp_path / "out"))


def _nested(depth: int) -> str:
    return "{\"a\": " * depth + "1" + "}" * depth


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, _nested(100_000), _nested(MAX_CONFIG_NESTING + 1)],
                         ids=["100k-lists", "100k-objects", "one-over-the-cap"])
def test_a_deeply_nested_config_is_a_typed_error(tmp_path, text):
    """100,000 nested lists or objects (json raises RecursionError), and one level over the cap:
    InvalidConfigError naming the file. Control: nesting at the cap reads."""
    p = tmp_path / "config.json"
    p.write_text(text)
    with pytest.raises(InvalidConfigError) as e:
        read_config(p)
    assert e.value.object == str(p)
    p.write_text(_nested(MAX_CONFIG_NESTING - 1))
    assert read_config(p)["a"]["a"]["a"]


def test_a_config_that_cannot_be_written_fails_before_any_byte(repo, tmp_path):
    """A dict config nested too deeply, one that contains itself, and one with a non-JSON value:
    InvalidConfigError, and OUT is not even created. Control: a plain config exports."""
    url, t = repo
    deep: dict = {}
    node = deep
    for _ in range(MAX_CONFIG_NESTING + 5):
        node["a"] = {}
        node = node["a"]
    loop: dict = {"model_type": "llama"}
    loop["self"] = loop
    for bad in (deep, loop, {"x": object()}):
        out = tmp_path / f"out-{id(bad)}"
        with pytest.raises(InvalidConfigError):
            export_safetensors(url, str(out), config=bad)
        assert not out.exists()
    out = tmp_path / "good"
    export_safetensors(url, str(out), max_shard_size=1000, config=CONFIG)
    _loads_back(out, t)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_config_value_is_refused_not_written_as_nan(repo, tmp_path, value):
    """Issue 47: json.dumps wrote ``NaN`` / ``Infinity`` into config.json, which is not JSON (a strict
    parser, and every non-Python loader, refuses it). Now InvalidConfigError, OUT not created.
    Control: the same config with a finite value exports and parses strictly."""
    url, t = repo
    out = tmp_path / "out"
    with pytest.raises(InvalidConfigError, match="cannot be written as JSON"):
        export_safetensors(url, str(out), config=dict(CONFIG, rope_scaling={"type": "linear", "factor": value}))
    assert not out.exists()
    export_safetensors(url, str(out), max_shard_size=1000, config=CONFIG)
    _loads_back(out, t)
    json.loads((out / "config.json").read_text(), parse_constant=lambda name: pytest.fail(f"not JSON: {name}"))


def test_config_read_keeps_the_caller_dict(repo, tmp_path):
    """The export copies the config; the caller's dict is not changed."""
    url, _ = repo
    cfg = json.loads(json.dumps(CONFIG))
    export_safetensors(url, str(tmp_path / "out"), config=cfg)
    assert cfg == CONFIG
    assert os.path.exists(tmp_path / "out" / "config.json")


def test_cli_deep_config_is_a_typed_error_and_nothing_is_written(repo, tmp_path):
    """``ckptfmt export URL OUT --config deep.json`` (100,000 nested lists): exit 1 with the typed
    error under --json, no traceback, OUT not created. Control: a plain config.json exports."""
    url, t = repo
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    r = CliRunner().invoke(app, ["export", url, str(tmp_path / "out"), "--config", str(deep), "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["error"] == "InvalidConfigError", r.output
    assert not (tmp_path / "out").exists()
    good = tmp_path / "config.json"
    good.write_text(json.dumps(CONFIG))
    r = CliRunner().invoke(app, ["export", url, str(tmp_path / "out"), "--config", str(good),
                                 "--max-shard-size", "1000", "--json"])
    assert r.exit_code == 0, r.output
    _loads_back(tmp_path / "out", t)
