"""The continuation receipt. Each side runs as a fresh process, XLA flags set before jax import.

Used by tests/test_jax_receipt.py and ``ckptfmt demo``. Importing this module imports no jax:
:func:`run_side` starts the processes and :func:`judge` compares their JSON results.

save:    train to step K on a (data x model) mesh, save step K (through bridges.jax.CheckpointManager),
         then run steps K+1 and K+2 and record their losses and the batch ids of K+1. Also saves step K+1000 without the
         optimizer state (for a broken control).
restore: restore step K on another mesh and run steps K+1 and K+2, once per control:

         ================  ====================================================================
         none              the real receipt
         drop-opt          model restored, optimizer left freshly initialised (must fail: the
                           optimizer moments differ, and so does the loss of step K+2)
         shuffled-cursor   the data cursor's shuffle seed altered after restore (must fail: the
                           batch ids and the loss of step K+1 differ)
         no-opt-ckpt       the full target restored from the step saved without optimizer state
                           (must fail: KeyMismatchError)
         ================  ====================================================================

usage: python -m ckptfmt_tools.receipt save|restore --devices N --mesh DxM --ckpt DIR --k K --out JSON
       [--controls a,b] [--port P --nproc N --rank R] [--policy drop|rank0]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from ckptfmt.coord import free_port

__all__ = ["run_side", "judge", "main", "LOSS_RTOL", "LOSS_K2_RTOL"]

#: Relative tolerance on the loss of step K+1 computed on the two topologies. The restored state
#: is bit-identical, so only the order of floating-point reductions differs: the batch mean
#: over 4 vs 2 data shards and the contractions over 2 vs 1 model (and data) shards. float32's
#: unit roundoff is 6e-8 and each reduction here sums at most a few hundred terms, so reordering
#: moves the loss by a few ulps (measured: 0 to 7e-8 relative); 1e-6 leaves a margin of >10x.
LOSS_RTOL = 1e-6
#: Step K+2 runs after one update computed on each topology, whose gradients were reduced in a
#: different order; its loss is informative and checked loosely.
LOSS_K2_RTOL = 1e-5
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------- parent side (no jax)


def run_side(mode: str, *, devices: int, mesh: str, ckpt: str, out: str, k: int = 3, nproc: int = 1,
             controls: str = "none", policy: str | None = None, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run one side in ``nproc`` fresh processes of ``devices`` CPU devices each; return its JSON.

    Raises RuntimeError with the processes' stderr when any process fails or times out.
    """
    from ckptfmt.coord import free_port

    port = free_port() if nproc > 1 else 0
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    for rank in range(nproc):
        cmd = [sys.executable, "-m", "ckptfmt_tools.receipt", mode, "--devices", str(devices), "--mesh", mesh,
               "--ckpt", ckpt, "--k", str(k), "--out", out, "--controls", controls,
               "--port", str(port), "--nproc", str(nproc), "--rank", str(rank)]
        if policy:
            cmd += ["--policy", policy]
        procs.append(subprocess.Popen(cmd, env=env, cwd=_REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    deadline = time.monotonic() + timeout_s
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            _, err = p.communicate()
            errs.append(f"timed out after {timeout_s} s\n{err.decode(errors='replace')[-3000:]}")
            continue
        if p.returncode != 0:
            errs.append(f"rc={p.returncode}\n{err.decode(errors='replace')[-3000:]}")
    if errs:
        raise RuntimeError(f"receipt {mode} side failed:\n" + "\n---\n".join(errs))
    with open(out) as f:
        return json.load(f)


def judge(saved: dict[str, Any], restored: dict[str, Any]) -> dict[str, Any]:
    """Compare one restored run (one control's result) against the saving run.

    Returns ``{"ok": bool, "checks": {name: [ok, detail]}}``. Checks: no error, same step, batch
    ids of K+1 identical, loss of K+1 within LOSS_RTOL, loss of K+2 within LOSS_K2_RTOL, and
    every leaf of the live state after restore (model, optimizer, loss scale, keys, cursor)
    bit-identical to the saved one.
    """
    checks: dict[str, list[Any]] = {}
    if "error" in restored:
        checks["restore"] = [False, f"{restored['error']}: {restored.get('message', '')[:300]}"]
        return {"ok": False, "checks": checks}
    checks["step"] = [restored["step"] == saved["step"], f"{restored['step']} vs {saved['step']}"]
    checks["batch_ids"] = [restored["batch_ids_k1"] == saved["batch_ids_k1"],
                           "identical" if restored["batch_ids_k1"] == saved["batch_ids_k1"] else
                           f"{restored['batch_ids_k1'][:6]}... vs {saved['batch_ids_k1'][:6]}..."]
    for name, tol in (("loss_k1", LOSS_RTOL), ("loss_k2", LOSS_K2_RTOL)):
        a, b = restored[name], saved[name]
        rel = abs(a - b) / max(abs(b), 1e-30)
        checks[name] = [rel <= tol, f"{a!r} vs {b!r} (rel {rel:.2e}, tol {tol:g})"]
    bad = sorted(k for k in saved["digests"] if restored["digests"].get(k) != saved["digests"][k])
    extra = sorted(set(restored["digests"]) - set(saved["digests"]))
    checks["state_bits"] = [not bad and not extra,
                            f"{len(saved['digests'])} leaves identical" if not bad and not extra
                            else f"differ: {bad[:4]}{'...' if len(bad) > 4 else ''} extra: {extra[:4]}"]
    return {"ok": all(c[0] for c in checks.values()), "checks": checks}


# ----------------------------------------------------------------------- child side (jax)


def _rss_mb() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _topology(args: argparse.Namespace) -> str:
    return f"{args.nproc} process(es) x {args.devices} CPU devices, mesh data x model = {args.mesh}"


def _do_save(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import numpy as np

    import bridges.jax as bjax
    from ckptfmt_tools.training import Config, Trainer, digest_tree, make_mesh
    from ckptfmt import Repository

    cfg = Config()
    tr = Trainer(cfg, make_mesh(tuple(int(x) for x in args.mesh.split("x"))))
    losses = [tr.train_step()[0] for _ in range(args.k)]
    state = tr.checkpoint_state()
    digests = digest_tree(state)
    rng = np.random.default_rng(100 + jax.process_index())  # per-process host RNG: rank state
    rank_state = {"np_rng": rng.bit_generator.state, "rank": jax.process_index()}
    # Saved through the checkpoint manager (asynchronously; save_s runs to the commit).
    with bjax.CheckpointManager(args.ckpt) as mgr:
        t = time.perf_counter()
        mgr.save(args.k, state, extra={"config": cfg.__dict__, "losses": losses}, rank_state=rank_state, force=True)
        record = mgr.wait()
        save_s = time.perf_counter() - t
        mgr.save(args.k + 1000, tr.checkpoint_state(with_optimizer=False), force=True)
    manifest = Repository(args.ckpt).manifest(args.k)
    res: dict[str, Any] = {
        "topology": _topology(args), "step": args.k, "losses": losses, "digests": digests, "save_s": save_s,
        "save_blocked_s": record.blocked_s,
        "saved_bytes": int(manifest.nbytes), "writers": int(manifest.writers),
        "tensor_bytes": int(sum(t.nbytes for t in manifest.tensors.values())),
        "writer_lists": {k: [int(w) for w in t.shards.writer] for k, t in manifest.tensors.items()}}
    if args.nproc > 1:
        # Each process restores onto its own devices of the global mesh, reading its shards only.
        stats: dict[str, Any] = {}
        restored = bjax.restore(args.ckpt, tr.target(), step=args.k, stats=stats)
        res["mp_restore_identical"] = digest_tree(restored) == digests
        res["mp_restore_bytes"] = [int(b) for b in _allgather_int(stats["bytes_restored"])]
        res["mp_logical_bytes"] = int(sum(int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
                                          for t in manifest.tensors.values()))
    loss, ids = tr.train_step()
    res.update(loss_k1=loss, batch_ids_k1=ids, loss_k2=tr.train_step()[0])
    return res


def _allgather_int(x: int) -> list[int]:
    import numpy as np
    from jax.experimental import multihost_utils

    return list(np.asarray(multihost_utils.process_allgather(np.int64(x))).reshape(-1))


def _do_restore(args: argparse.Namespace) -> dict[str, Any]:
    import bridges.jax as bjax
    from ckptfmt_tools.training import Config, Trainer, digest_tree, make_mesh
    from ckptfmt import CheckpointError

    cfg = Config()
    mesh = make_mesh(tuple(int(x) for x in args.mesh.split("x")))
    out: dict[str, Any] = {"topology": _topology(args), "controls": {}}
    for control in args.controls.split(","):
        tr = Trainer(cfg, mesh)
        r: dict[str, Any] = {}
        try:
            step = args.k + 1000 if control == "no-opt-ckpt" else args.k
            _reset_peak()
            before = _rss_mb()
            stats: dict[str, Any] = {}
            t = time.perf_counter()
            st = bjax.restore(args.ckpt, tr.target(with_optimizer=control != "drop-opt"), step=step,
                              rank_state_policy=args.policy, stats=stats)
            r["restore_s"] = time.perf_counter() - t
            after = _rss_mb()
            r["rss_mb"] = {"before": before["VmRSS"], "peak": after["VmHWM"], "after": after["VmRSS"]}
            r["stats"] = stats
            tr.load(st)
            if control == "shuffled-cursor":
                tr.cursor["shuffle_seed"] += 1
            # The whole live state after the restore, optimizer included: a dropped optimizer
            # shows up here as fresh moments.
            r["digests"] = digest_tree(tr.checkpoint_state())
            r["extra_losses"] = bjax.load_extra(args.ckpt, step)["losses"]
            t = time.perf_counter()
            loss, ids = tr.train_step()
            r["first_step_s"] = time.perf_counter() - t
            r.update(loss_k1=loss, batch_ids_k1=ids, step=tr.step - 1, loss_k2=tr.train_step()[0])
            if args.policy is not None:
                rs = bjax.load_rank_state(args.ckpt, step, rank_state_policy=args.policy)
                r["rank_state"] = None if rs is None else {"rank": rs["rank"]}
        except CheckpointError as e:
            r["error"] = type(e).__name__
            r["message"] = str(e)
        out["controls"][control] = r
    try:
        bjax.restore(args.ckpt, Trainer(cfg, mesh).target(), step=args.k)
        out["restore_without_policy"] = "ok"
    except CheckpointError as e:
        out["restore_without_policy"] = type(e).__name__
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ckptfmt_tools.receipt")
    ap.add_argument("mode", choices=["save", "restore"])
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--controls", default="none")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--policy", default=None)
    args = ap.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    import jax

    if args.nproc > 1:
        from ckptfmt_tools.jaxjoin import join as join_jax
        join_jax(args.port, args.nproc, args.rank, timeout=120)
    res = _do_save(args) if args.mode == "save" else _do_restore(args)
    res["process_s"] = time.perf_counter() - t0
    if jax.process_index() == 0:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if args.nproc > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
