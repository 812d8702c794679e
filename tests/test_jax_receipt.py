"""The continuation receipt (issue 3's acceptance): save on one topology, resume on another.

A tiny Flax NNX MLP trains with optax adamw on a data x model CPU mesh, with data keyed by the
global sample position (ckptfmt_tools/training.py). The saving side records step K+1 (and K+2); a
fresh process on a different topology restores step K and runs the same steps. The receipt
(ckptfmt_tools.receipt.judge): batch ids identical, loss of K+1 within 1e-6 relative (same bits of
parameters, different floating-point reduction order across device counts), and every leaf of
the live training state bit-identical to the saved one. Broken controls must visibly fail.
"""
from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(importlib.util.find_spec("jax") is None or importlib.util.find_spec("flax") is None,
                       reason="needs the [jax] extra: pip install -e '.[jax]'"),
]

CONTROLS = "none,drop-opt,shuffled-cursor,no-opt-ckpt"


def _run(tmp_path, *, save_nproc, save_devices, restore_mesh, policy=None):
    from ckptfmt_tools.receipt import run_side

    ckpt = str(tmp_path / "ckpt")
    saved = run_side("save", devices=save_devices, nproc=save_nproc, mesh="4x2", ckpt=ckpt,
                     out=str(tmp_path / "save.json"))
    restored = run_side("restore", devices=4, mesh=restore_mesh, ckpt=ckpt, out=str(tmp_path / "restore.json"),
                        controls=CONTROLS, policy=policy)
    return saved, restored


def _assert_receipt(saved, restored):
    from ckptfmt_tools.receipt import judge

    good = judge(saved, restored["controls"]["none"])
    assert good["ok"], good
    assert restored["controls"]["none"]["extra_losses"] == saved["losses"]
    # Broken controls: each must fail the receipt, visibly and for the right reason.
    drop = judge(saved, restored["controls"]["drop-opt"])
    assert not drop["ok"] and not drop["checks"]["state_bits"][0] and not drop["checks"]["loss_k2"][0], drop
    assert "optimizer/opt_state/1/0/mu/l1/kernel" in drop["checks"]["state_bits"][1] or \
        "optimizer/" in drop["checks"]["state_bits"][1]
    shuf = judge(saved, restored["controls"]["shuffled-cursor"])
    assert not shuf["ok"] and not shuf["checks"]["batch_ids"][0] and not shuf["checks"]["loss_k1"][0], shuf
    noopt = judge(saved, restored["controls"]["no-opt-ckpt"])
    assert not noopt["ok"] and restored["controls"]["no-opt-ckpt"]["error"] == "KeyMismatchError", noopt


def test_receipt_8_devices_to_4(tmp_path):
    saved, restored = _run(tmp_path, save_nproc=1, save_devices=8, restore_mesh="4x1")
    _assert_receipt(saved, restored)
    assert saved["writers"] == 1 and restored["restore_without_policy"] == "ok"


def test_receipt_2_processes_to_1(tmp_path):
    saved, restored = _run(tmp_path, save_nproc=2, save_devices=4, restore_mesh="2x2", policy="rank0")
    _assert_receipt(saved, restored)
    assert saved["writers"] == 2
    # Both processes wrote: the kernels are split over "data", which spans the two processes.
    kernel = saved["writer_lists"]["model/l1/kernel"]
    assert sorted(set(kernel)) == [0, 1], kernel
    bias = saved["writer_lists"]["model/l2/bias"]  # replicated on both processes: written once,
    assert len(bias) == 1 and bias[0] in (0, 1), bias  # by the process whose turn it is (FORMAT.md 8.1)
    # Each saving process also restored its own half onto the global mesh, bit-identical,
    # reading only the boxes of its addressable shards.
    assert saved["mp_restore_identical"]
    assert all(b < saved["mp_logical_bytes"] for b in saved["mp_restore_bytes"]), saved["mp_restore_bytes"]
    # Per-rank state (per-process numpy RNG) needs a policy when 2 processes become 1.
    assert restored["restore_without_policy"] == "TopologyChangedError"
    assert restored["controls"]["none"]["rank_state"] == {"rank": 0}
