"""The JAX side of the drill. Runs as a fresh process (XLA flags set before jax is imported).

Modes (one process of a job each):

``train``     a rank of the training job. Trains the tiny Flax NNX model of
              :mod:`ckptfmt_tools.training` on a ``data x model`` mesh spanning every process, logs each
              step (loss, batch ids, wall time) as one JSON line (rank 0), and every ``cadence``
              steps starts an asynchronous save through ``bridges.jax.CheckpointManager`` whose
              ``extra`` holds the sha256 of every leaf (the state hashes the replacement compares).
``restore``   a rank of a replacement (or control) job: resume through the checkpoint manager
              (the newest committed step that verifies) onto its own mesh, compare the reconstructed state hashes with the saved ones, run
              exactly one step, and write the result (rank 0). With ``--rejected-control`` it then
              tries to restore a copy of the step with one shard object deleted into the live
              state, and records that the restore raised and the live state did not change.

Every timestamp is ``time.time()`` so the parent can measure from the moment of the kill.

usage: python -m ckptfmt_tools.drill._job train|restore --devices N --mesh DxM --url URL --out PATH
       [--nproc N --rank R --port P] [train: --cadence C --max-steps N --step-time S]
       [restore: --rejected-control URL --victim R]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

T_START = time.time()  # before anything heavy is imported: the process exists from here

from ckptfmt.manager import LocalTier  # noqa: E402  (after T_START: it imports the storage layer)


def _write(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def _framework(args: argparse.Namespace) -> dict[str, float]:
    """Import JAX and join the job; returns the wall times of each stage."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    t_import = time.time()
    if args.nproc > 1:
        from ckptfmt_tools.jaxjoin import join as join_jax
        join_jax(args.port, args.nproc, args.rank, timeout=120)
    jax.devices()
    import bridges.jax  # noqa: F401  (part of the framework cost: flax, optax, the bridge)
    from ckptfmt_tools import training  # noqa: F401

    return {"t_start": T_START, "t_import": t_import, "t_ready": time.time()}


def _config(args: argparse.Namespace) -> Any:
    from ckptfmt_tools.training import Config

    # Fixed schedule length: the training job and every restoring job build the same Config.
    return Config(dropout=args.dropout, total_steps=1000, d_in=args.d_in, hidden=args.hidden)


def _mesh(args: argparse.Namespace) -> Any:
    from ckptfmt_tools.training import make_mesh

    return make_mesh(tuple(int(x) for x in args.mesh.split("x")))


# --------------------------------------------------------------------------------- train


def _train(args: argparse.Namespace, times: dict[str, float]) -> dict[str, Any]:
    import jax

    import bridges.jax as bjax
    from ckptfmt_tools.training import Trainer, digest_tree

    cfg = _config(args)
    tr = Trainer(cfg, _mesh(args))
    rank0 = jax.process_index() == 0
    log = open(args.log, "a", buffering=1) if rank0 else None
    saves: list[dict[str, Any]] = []
    stall_s = 0.0
    # The checkpoint manager keeps one asynchronous save in flight (the next waits for its commit).
    # With --local (drill --tiers): a local tier with peer replicas every --local-every steps too.
    local = LocalTier(args.local, every=args.local_every, keep=3) if args.local else None
    with bjax.CheckpointManager(args.url, save_every_steps=args.cadence, local=local) as mgr:
        for _ in range(args.max_steps):
            t0 = time.time()
            loss, ids = tr.train_step()
            if log is not None:
                log.write(json.dumps({"step": tr.step, "loss": loss, "ids": ids, "t": time.time()}) + "\n")
            persist = mgr.should_save(tr.step)
            if persist or (local is not None and tr.step % local.every == 0):
                ts = time.time()
                state = tr.checkpoint_state()
                extra = {"digests": digest_tree(state), "config": cfg.__dict__, "mesh": args.mesh,
                         "processes": args.nproc, "devices_per_process": args.devices,
                         "cursor": {k: int(v) for k, v in tr.cursor.items()}}  # the torch tier job's data cursor
                mgr.save(tr.step, state, extra=extra)
                stall_s += time.time() - ts
                saves.append({"step": tr.step, "t_started": ts, "blocked_s": time.time() - ts})
                if log is not None and persist:  # the persistent saves: the judge lists the torn ones
                    log.write(json.dumps({"save_started": tr.step, "t": ts}) + "\n")
            rest = args.step_time - (time.time() - t0)
            if rest > 0:  # pace the job like a heavier model, so that the kill lands on a chosen step
                time.sleep(rest)
    return {"mode": "train", "completed": tr.step, "saves": saves, "stall_s": stall_s, **times}


# ------------------------------------------------------------------------------- restore


def _digest_diff(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _restore(args: argparse.Namespace, times: dict[str, float]) -> dict[str, Any]:
    import jax

    import bridges.jax as bjax
    from ckptfmt_tools.training import Trainer, digest_tree

    cfg = _config(args)
    tr = Trainer(cfg, _mesh(args))
    target = tr.target()
    t_setup = time.time()

    # The checkpoint manager resumes from the newest committed step that verifies (every process
    # of the job restores the same one; a damaged newer step would be skipped and reported).
    local = LocalTier(args.local, every=args.local_every, keep=3) if args.local else None
    with bjax.CheckpointManager(args.url, local=local) as mgr:
        resumed = mgr.restore(target)
    state, stats = resumed.state, dict(resumed.stats)
    t_restored = time.time()
    if "reader" not in stats:  # served through the tiers (drill --tiers): no reader of one repository
        stats = {**stats, "open_s": 0.0, "plan_s": 0.0, "build_s": 0.0,
                 "reader": {"timings": {"read": stats.get("restore_s", 0.0)},
                            "bytes_read": sum(int((stats.get("tiers") or {}).get(k, 0))
                                                  for k in ("local", "peer", "persistent"))}}

    # Validation: the reconstructed state hashes against the hashes saved with the step. A tier job
    # (--local) takes them after its first step, from the restored arrays the step left as they were
    # (no buffer is donated): the step then runs as in a job without the drill's validation, and
    # pays what that job pays first (fresh memory for its outputs), which the validation's gathers
    # would otherwise have paid before it.
    extra = resumed.extra or {}
    saved = extra.get("digests", {})
    after_step = bool(args.local)
    if not after_step:
        got = digest_tree(state)
        tr.load(state)
        del state
        t_valid = time.time()
    else:
        tr.load(state)
    loss, ids = tr.train_step()  # exactly one step
    t_step = time.time()
    if after_step:
        got = digest_tree(state)
        del state
        t_valid = time.time()
    diff = _digest_diff(saved, got)
    validation_s = t_valid - t_step if after_step else t_valid - t_restored
    from ckptfmt_tools.receipt import LOSS_RTOL  # the documented tolerance of the continuation receipt

    # Where the restore's time went: the bridge's phases and the core reader's timings.

    r = stats["reader"]["timings"]
    wall = t_restored - t_setup
    mb = stats["reader"]["bytes_read"] / 1e6
    rows = [["manifest load", stats["open_s"], "choose the latest step, parse + validate its manifest, read state"],
            ["plan", stats["plan_s"] + r.get("plan", 0.0), "boxes of each local shard -> byte ranges"],
            ["data transfer", r.get("read", 0.0), f"{mb:.2f} MB read"],
            ["resharding", r.get("assemble", 0.0) + stats["build_s"], "assemble boxes, place on the new mesh"],
            ["validation: checksums", r.get("verify", 0.0), "crc32c of every byte read vs the manifest"]]
    rows.append(["restore bookkeeping", max(0.0, wall - sum(x[1] for x in rows)),
                 "inside restore, not attributed above"])
    rows.append(["validation: state hashes", validation_s, f"{len(saved)} leaf sha256 vs saved"
                 + (" (after the first step)" if after_step else "")])
    out: dict[str, Any] = {
        "mode": "restore", "framework": "jax", "init_note": "jax import, devices, flax/optax/bridge import",
        "loss_rtol": LOSS_RTOL, "restore_phases": rows,
        "topology": f"{args.nproc} process(es) x {args.devices} devices, mesh {args.mesh}",
        "devices": args.nproc * args.devices, "restored_step": resumed.step, "step": tr.step, "loss": loss,
        "skipped_steps": [[k.step, k.error] for k in resumed.skipped],
        "ids": ids, "hashes": {"leaves": len(saved), "differ": diff, "exact": bool(saved) and not diff},
        "restore_stats": stats, "bytes_read": stats["reader"]["bytes_read"],
        "t_setup": t_setup, "t_restored": t_restored, "t_valid": t_valid, "t_step": t_step, **times,
        "validated_after_step": after_step}
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        per = multihost_utils.process_allgather(np.int64(stats["reader"]["bytes_read"]))
        out["bytes_read_per_process"] = [int(x) for x in np.asarray(per).reshape(-1)]
        if local is not None:  # which tier served how many bytes, on every process, and its token
            t = stats.get("tiers") or {}
            # [local, peer, persistent, persistent bytes of pieces a surviving copy held (elastic)]
            mine = np.array([t.get("local", 0), t.get("peer", 0), t.get("persistent", 0), t.get("persistent_held", 0)],
                            dtype=np.int64)
            out["tiers_per_process"] = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 4).tolist()
            out["elastic"] = stats.get("elastic")
            tok = np.frombuffer(str(stats.get("tier_token") or "").ljust(40)[:40].encode(), dtype=np.uint8)
            out["tokens_per_process"] = [bytes(r).decode().strip() for r in
                                         np.asarray(multihost_utils.process_allgather(tok)).reshape(-1, 40)]
    else:
        out["bytes_read_per_process"] = [int(stats["reader"]["bytes_read"])]
    if args.rejected_control:
        out["rejected_control"] = _rejected_control(args, tr, resumed.step)
    return out


def _rejected_control(args: argparse.Namespace, tr: Any, step: int) -> dict[str, Any]:
    """Restore a copy of ``step`` with one shard object deleted into the live trainer."""
    import bridges.jax as bjax
    from ckptfmt_tools.training import digest_tree
    from ckptfmt import Repository
    from ckptfmt.errors import CheckpointError

    from ._damage import copy_without_one_shard

    removed = copy_without_one_shard(args.url, args.rejected_control, step, prefer_writer=args.victim)
    before = digest_tree(tr.checkpoint_state())
    res: dict[str, Any] = {"fault": "missing shard", "step": step, "copy": args.rejected_control,
                           "removed": removed}
    t0 = time.time()
    try:
        st = bjax.restore(args.rejected_control, tr.target(), step=step)
        tr.load(st)  # reached only if the restore wrongly succeeded
        res.update(raised=None, exposed=True)
    except CheckpointError as exc:
        res.update(raised=type(exc).__name__, message=str(exc)[:400], exposed=False,
                   error=exc.to_json() if hasattr(exc, "to_json") else None)
    res["reject_s"] = time.time() - t0
    after = digest_tree(tr.checkpoint_state())
    res["live_state_unchanged"] = before == after
    res["live_state_leaves"] = len(before)
    # The committed original is untouched and still verifies.
    try:
        res["original_verified_bytes"] = int(Repository(args.url).verify(step))
        res["original_intact"] = True
    except CheckpointError as exc:
        res.update(original_intact=False, original_error=type(exc).__name__)
    # The live job can still train after the rejection.
    loss, _ = tr.train_step()
    res["step_after_rejection_ok"] = bool(loss == loss)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ckptfmt_tools.drill._job")
    ap.add_argument("mode", choices=["train", "restore"])
    ap.add_argument("--devices", type=int, required=True, help="CPU devices of this process")
    ap.add_argument("--mesh", required=True, help="global data x model mesh, e.g. 4x2")
    ap.add_argument("--url", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", default="")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--cadence", type=int, default=5)
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--d-in", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--rejected-control", default="")
    ap.add_argument("--victim", type=int, default=0)
    ap.add_argument("--local", default="", help="local tier directory (drill --tiers; {rank}: this process's rank)")
    ap.add_argument("--local-every", type=int, default=5)
    args = ap.parse_args(argv)
    # drill --elastic: one local tier directory per simulated machine, "{rank}" naming this process's
    args.local = args.local.replace("{rank}", str(args.rank))
    times = _framework(args)
    import jax

    res = _train(args, times) if args.mode == "train" else _restore(args, times)
    res["t_end"] = time.time()
    if jax.process_index() == 0:
        _write(args.out, res)
    sys.stdout.flush()
    if args.nproc > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
