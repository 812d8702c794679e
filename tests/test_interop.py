"""Interop acceptance: weights in and out of ckptfmt with real frameworks (issue 15). Nothing is
downloaded; every model is random-initialised from the tiny configs of tests/torchproc/hf_configs.

* JAX, 2 processes x 4 CPU devices (tests/interop/jax_llama.py): the NNX Llama saved from 8
  devices -> ``ckptfmt export --mapping hf_llama_from_nnx`` -> ``LlamaForCausalLM.from_pretrained``:
  logits within 1e-4 of JAX. ``save_pretrained(max_shard_size=...)`` (5 files) ->
  ``bridges.jax.restore`` straight from the directory onto the (4, 2) mesh with the inverse preset:
  logits within 1e-4 of torch; each process reads its share (and the files' headers) only.
* The same directory -> ``ckptfmt import`` -> ``bridges.torch.load`` at 2 gloo ranks: bit for bit.
* Orbax ``StandardCheckpointer`` from 8 devices, OCDBT on and off -> import -> ``bridges.jax.restore``
  onto 4 devices: every leaf bit for bit (tests/interop/jax_orbax.py); a truncated array: a typed
  error, no step.
* DCP from 8 gloo ranks -> ``ckptfmt import --from dcp --trust-pickle`` -> ``bridges.torch.load`` at
  4 ranks: bit for bit; a missing DCP shard: MissingShardError, no step.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
pytest.importorskip("jax")
pytest.importorskip("orbax.checkpoint")

from typer.testing import CliRunner  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt_tools.cli import app  # noqa: E402
from torchproc.hf_configs import LLAMA  # noqa: E402
from torchproc.hf_side import hf_model, logits  # noqa: E402
from torchproc.launch import REPO, child_env, run_jax, run_world  # noqa: E402

LOGIT_ATOL = 1e-4
HF_SEED = 7
runner = CliRunner()
pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The Hugging Face side: a random LlamaForCausalLM saved by save_pretrained in 5 files."""
    w = tmp_path_factory.mktemp("interop")
    model = hf_model("llama", seed=HF_SEED)
    model.save_pretrained(w / "hf", max_shard_size="100KB")
    np.save(w / "torch_logits.npy", logits(model))
    (w / "config.json").write_text(json.dumps(dict(LLAMA, model_type="llama", architectures=["LlamaForCausalLM"])))
    return w


@pytest.fixture(scope="module")
def jax_llama(work) -> list[dict]:
    """Both JAX processes (save from 8 devices; restore straight from the HF directory)."""
    t0 = time.monotonic()
    logs = run_jax(REPO / "tests" / "interop" / "jax_llama.py", work)
    print(f"JAX side (2 processes): {time.monotonic() - t0:.1f} s; "
          + "; ".join(line for log in logs for line in log.splitlines() if line.startswith("rank ")))
    return [json.loads((work / f"direct-{r}.json").read_text()) for r in range(2)]


def test_jax_llama_exports_to_transformers(jax_llama, work):
    """ckptfmt export of the JAX step (saved from 8 devices over 2 processes) through the preset,
    2 writer processes: from_pretrained loads it; logits within 1e-4 of JAX's."""
    out = work / "exported"
    r = runner.invoke(app, ["export", str(work / "llama_jax"), str(out), "--format", "safetensors",
                            "--mapping", "hf_llama_from_nnx", "--config", str(work / "config.json"),
                            "--max-shard-size", "100KB", "--processes", "2", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)["report"]
    assert report["tensors"] == 21 and len(report["files"]) >= 3 and report["unmapped"] == []
    assert (out / "model.safetensors.index.json").exists() and (out / "config.json").exists()
    model = tf.LlamaForCausalLM.from_pretrained(str(out)).eval()
    err = float(np.abs(logits(model) - np.load(work / "jax_logits.npy")).max())
    print(f"JAX -> export -> from_pretrained: max |logit diff| {err:.2e}; {len(report['files'])} files, "
          f"{report['nbytes']:,} B, read {report['bytes_read']:,} B (verified)")
    assert err < LOGIT_ATOL


def test_restore_straight_from_save_pretrained(jax_llama, work):
    """save_pretrained's 5 files -> bridges.jax.restore onto the (4, 2) mesh of 2 processes: logits
    within 1e-4 of torch; each process read its share (the distinct boxes its devices hold,
    replicated tensors whole) plus the files' headers, and nothing else."""
    files = sorted(p.name for p in (work / "hf").glob("model-*.safetensors"))
    assert len(files) >= 3
    err = float(np.abs(np.load(work / "direct_logits.npy") - np.load(work / "torch_logits.npy")).max())
    print(f"save_pretrained ({len(files)} files) -> bridges.jax.restore: max |logit diff| vs torch {err:.2e}")
    assert err < LOGIT_ATOL
    for rank, r in enumerate(jax_llama):
        print(f"process {rank}: read {r['bytes_read']:,} B = its share {r['share']:,} B (of which replicated "
              f"tensors {r['replicated']:,} B) + {r['headers']:,} B of headers; all tensors: {r['total']:,} B")
        assert r["bytes_read"] <= r["share"] + r["headers"]
        assert r["share"] < 0.6 * r["total"] and r["replicated"] > 0


def test_import_save_pretrained_then_torch_load_at_2_ranks(work):
    """ckptfmt import of the same directory (CLI), then bridges.torch.load at 2 gloo ranks into
    zeroed tensor-parallel DTensors: every tensor bit for bit with the files as the reference
    safetensors reader reads them."""
    url = work / "from_hf"
    r = runner.invoke(app, ["import", str(work / "hf"), str(url), "--from", "safetensors", "--prefix", "model/",
                            "--step", "1"])
    assert r.exit_code == 0, r.output
    meta = ckptfmt.Repository(str(url)).manifest(1).metadata["import"]
    assert meta["format"] == "safetensors" and len(meta["files"]) >= 3 and meta["source_checksums"].startswith("none")
    res = run_world("interop_side:load_hf", 2, work, {"url": str(url), "hf": str(work / "hf")})
    for rank, x in enumerate(res):
        print(f"rank {rank}: {x['keys']} tensors ({x['sharded']} sharded) bit for bit; read {x['bytes_read']:,} B")
        assert x["differ"] == [] and x["sharded"] > 0


def test_orbax_import_then_restore_onto_4_devices(work):
    """StandardCheckpointer from 8 devices, OCDBT on and off -> import -> bridges.jax.restore onto
    4 devices: every leaf bit for bit, on the 4 devices; scalar leaves come back. A truncated
    array file (each layout): a typed CheckpointError and no step (controls: the intact imports)."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(REPO / "tests" / "interop" / "jax_orbax.py"), str(work)],
                       env=child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    doc = json.loads((work / "orbax.json").read_text())
    print(f"Orbax side: {time.monotonic() - t0:.1f} s")
    for layout in ("ocdbt", "zarr"):
        d = doc[layout]
        print(f"{layout}: {d['tensors']} leaves bit for bit: {all(d['same'].values())}; truncated array -> {d['fault']}")
        assert all(d["same"].values()) and len(d["same"]) == 7, d["same"]
        assert all(devs == [0, 1, 2, 3] for devs in d["devices"].values()), d["devices"]
        assert d["steps_done"] == 7 and d["provenance"]["format"] == "orbax"
        assert d["provenance"]["ocdbt"] == (layout == "ocdbt")
        assert d["fault"] in ("SizeMismatchError", "MissingShardError", "InvalidSourceError") and d["fault_committed"] == []


@pytest.mark.parametrize("payload, words", [
    (["not", "metadata"], "DCP could not read .metadata"),  # torch itself fails on it
    (types.SimpleNamespace(), "does not hold a checkpoint's metadata"),  # read_metadata accepts these
    (types.SimpleNamespace(state_dict_metadata=[1, 2], storage_data={}), "does not hold a checkpoint's metadata"),
])
def test_trusted_dcp_metadata_of_the_wrong_type_is_a_typed_error(tmp_path, payload, words):
    """Issue 24 item 11: a --trust-pickle .metadata that unpickles to another type raised an
    AttributeError traceback (no JSON under --json). It is InvalidSourceError, as JSON, exit 1,
    nothing committed; the control: the intact checkpoint imports."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(6, dtype=torch.float32)}, checkpoint_id=str(src))
    good = tmp_path / "good"
    r = runner.invoke(app, ["import", str(src), str(good), "--from", "dcp", "--trust-pickle", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["report"]["tensors"] == 1, r.output  # the control
    (src / ".metadata").write_bytes(pickle.dumps(payload))
    url = tmp_path / "repo"
    r = runner.invoke(app, ["import", str(src), str(url), "--from", "dcp", "--trust-pickle", "--json"])
    assert r.exit_code == 1, r.output
    err = json.loads(r.stdout)
    assert err["error"] == "InvalidSourceError" and words in err["message"], err
    assert not url.exists() or ckptfmt.Repository(str(url)).steps() == []


def test_dcp_import_then_torch_load_at_4_ranks(work):
    """DCP saved by 8 gloo ranks -> ckptfmt import (CLI, --trust-pickle) -> bridges.torch.load at 4
    ranks into other placements: bit for bit. Without --trust-pickle the CLI refuses (usage);
    a deleted DCP data file: MissingShardError before anything is written, no step."""
    dcp_dir = work / "dcp"
    run_world("interop_side:dcp_save", 8, work, {"dcp": str(dcp_dir)})
    url = work / "from_dcp"
    r = runner.invoke(app, ["import", str(dcp_dir), str(url), "--from", "dcp"])
    assert r.exit_code == 2 and not url.exists()
    r = runner.invoke(app, ["import", str(dcp_dir), str(url), "--from", "dcp", "--trust-pickle", "--json"])
    assert r.exit_code == 0, r.output
    prov = json.loads(r.stdout)["report"]["provenance"]
    assert prov["skipped_non_tensors"] == ["step"] and prov["tensors"] == 4
    broken = work / "dcp_missing"
    shutil.copytree(dcp_dir, broken)
    os.unlink(broken / "__3_0.distcp")
    bad_url = work / "from_dcp_missing"
    r = runner.invoke(app, ["import", str(broken), str(bad_url), "--from", "dcp", "--trust-pickle", "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["error"] == "MissingShardError", r.output
    assert not bad_url.exists() or ckptfmt.Repository(str(bad_url)).steps() == []
    res = run_world("interop_side:load_dcp", 4, work, {"url": str(url)})
    for rank, x in enumerate(res):
        assert all(x["same"].values()), (rank, x)
    print("DCP (8 ranks) -> import -> bridges.torch.load (4 ranks): bit for bit; read per rank "
          + ", ".join(f"{x['bytes_read']:,} B" for x in res))


def test_orbax_leaf_over_the_cap_is_refused_before_reading(tmp_path):
    """Issue 24 item 9: Orbax restores a leaf whole, so memory followed the declared leaf (a 35 KB
    directory declaring 1 GiB of zeros cost 1.36 GB). A leaf over ``max_leaf_bytes`` (default
    512 MiB) is refused from the metadata, before any read, naming the leaf and the option; the
    control: the same checkpoint imports under a cap that fits it (and through the CLI flag)."""
    src = tmp_path / "orbax"
    code = ("import numpy as np, orbax.checkpoint as ocp, sys\n"
            "c = ocp.StandardCheckpointer()\n"
            "c.save(sys.argv[1], {'big': np.zeros((1024, 1024), np.float32), 'small': np.arange(4, dtype=np.int32)})\n"
            "c.wait_until_finished()\n")
    subprocess.run([sys.executable, "-c", code, str(src)], env=child_env(JAX_PLATFORMS="cpu"), check=True,
                   timeout=300, cwd=str(REPO))
    from bridges.interop import import_checkpoint

    url = tmp_path / "repo"
    with pytest.raises(ckptfmt.InvalidSourceError) as e:
        import_checkpoint(str(src), str(url), source_format="orbax", max_leaf_bytes=1 << 20)
    assert e.value.key == "big" and "--max-leaf-bytes" in str(e.value), str(e.value)
    assert not (url / "manifests").exists() or ckptfmt.Repository(str(url)).steps() == []
    r = runner.invoke(app, ["import", str(src), str(url), "--from", "orbax", "--max-leaf-bytes", str(4 << 20),
                            "--json"])
    assert r.exit_code == 0, r.output  # the control: 4 MiB fits
    ckpt = ckptfmt.Repository(str(url)).open()
    assert np.array_equal(ckpt.read("big"), np.zeros((1024, 1024), np.float32))
    assert np.array_equal(ckpt.read("small"), np.arange(4, dtype=np.int32))
