"""``ckptfmt demo`` (``make demo``): a JAX job saves on 8 devices and resumes on 4.

The story runs in fresh processes (each sets its CPU device count before importing jax):

1. a tiny Flax NNX MLP trains with optax adamw on 8 CPU devices (mesh data x model = 4 x 2),
   saves step K, and continues to step K+1, recording the loss and the batch ids;
2. a new process with 4 devices restores step K and runs step K+1;
3. the receipt compares them: batch ids identical, loss within 1e-6 relative, every leaf of the
   training state bit-identical. A broken control (a shuffled data cursor) must fail it.

This module imports no jax; :func:`run` is reusable (the drill builds on it).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from typing import Any

__all__ = ["main", "run"]


def run(workdir: str, *, k: int = 3, save_devices: int = 8, save_nproc: int = 1, save_mesh: str = "4x2",
        restore_devices: int = 4, restore_mesh: str = "2x2", controls: str = "none,shuffled-cursor",
        policy: str | None = None) -> dict[str, Any]:
    """Run the story under ``workdir`` (the repository is ``workdir/ckpt``); return every result.

    Raises RuntimeError when a process fails (its stderr included).
    """
    from ckptfmt_tools.receipt import judge, run_side

    ckpt = os.path.join(workdir, "ckpt")
    saved = run_side("save", devices=save_devices, nproc=save_nproc, mesh=save_mesh, ckpt=ckpt, k=k,
                     out=os.path.join(workdir, "save.json"))
    restored = run_side("restore", devices=restore_devices, mesh=restore_mesh, ckpt=ckpt, k=k, controls=controls,
                        policy=policy, out=os.path.join(workdir, "restore.json"))
    verdicts = {name: judge(saved, r) for name, r in restored["controls"].items()}
    return {"saved": saved, "restored": restored, "verdicts": verdicts,
            "ok": verdicts["none"]["ok"] and all(not v["ok"] for n, v in verdicts.items() if n != "none")}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def _print_receipt(res: dict[str, Any]) -> None:
    s, r = res["saved"], res["restored"]
    good = r["controls"]["none"]
    v = res["verdicts"]["none"]
    ids = good.get("batch_ids_k1", [])
    w = print
    w(f"ckptfmt demo: a training job saves on {s['topology'].split(',')[0]}; a new job on "
      f"{r['topology'].split(',')[0]} restores it and takes the next step")
    w(f"  saving topology     {s['topology']}")
    w(f"  restoring topology  {r['topology']}")
    w(f"  checkpoint          step {s['step']}: {len(s['writer_lists'])} tensors, {_fmt_bytes(s['saved_bytes'])} "
      f"stored, {s['writers']} writer{'' if s['writers'] == 1 else 's'}, saved in {s['save_s']:.3f} s")
    if "error" in good:
        w(f"  restore FAILED      {good['error']}: {good.get('message', '')}")
    else:
        w(f"  resumed step        {good['step'] + 1} (restored step {good['step']})")
        w(f"  batch ids, step {good['step'] + 1:<3} {ids[:8]}{' ...' if len(ids) > 8 else ''} ({len(ids)} ids) "
          f"{'identical' if v['checks']['batch_ids'][0] else 'DIFFER'}")
        w(f"  loss, saving run    {s['loss_k1']:.9f}   (step {good['step'] + 1})")
        w(f"  loss, restored run  {good['loss_k1']:.9f}   ({v['checks']['loss_k1'][1].split('(')[-1].rstrip(')')})")
        w(f"  training state      {v['checks']['state_bits'][1]} "
          "(params, adamw mu/nu/count, rng keys, loss scale, data cursor)")
        st, t = good["stats"], good["stats"].get("reader", {}).get("timings", {})
        w("  phases              manifest load {:.3f} s | plan {:.3f} s | read {:.3f} s | verify {:.3f} s | "
          "build arrays {:.3f} s | first step {:.2f} s".format(
              t.get("manifest", st["open_s"]), st["plan_s"] + t.get("plan", 0.0), t.get("read", st["read_s"]),
              t.get("verify", 0.0), st["build_s"], good["first_step_s"]))
        w(f"  restore             {good['restore_s']:.3f} s, {_fmt_bytes(st['bytes_restored'])} restored, "
          f"peak RSS +{good['rss_mb']['peak'] - good['rss_mb']['before']:.1f} MB")
    for name, verdict in res["verdicts"].items():
        if name == "none":
            continue
        failed = [c for c, (ok, _) in verdict["checks"].items() if not ok]
        w(f"  sanity check        the same comparison with a wrong data position ({name}) "
          f"{'fails, as it must' if not verdict['ok'] else 'PASSES: a bug'} ({', '.join(failed)})")
    new, old = r["topology"].split(",")[0], s["topology"].split(",")[0]
    w(f"RESULT: PASS: the job on {new} took the step the job on {old} would have taken, bit for bit"
      if res["ok"] else "RESULT: FAIL (see the lines above)")


def parser() -> argparse.ArgumentParser:
    """The demo's options (``ckptfmt demo`` declares the same ones)."""
    ap = argparse.ArgumentParser(prog="ckptfmt demo", description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--k", type=int, default=3, help="the step to save (default 3)")
    ap.add_argument("--save-devices", type=int, default=8, help="devices in all (split over the processes)")
    ap.add_argument("--save-processes", type=int, default=1)
    ap.add_argument("--restore-devices", type=int, default=4)
    ap.add_argument("--restore-mesh", default="2x2", help="data x model mesh of the restoring side")
    ap.add_argument("--json", action="store_true", help="print the full results as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the demo and print the receipt. Returns 0 when the receipt passes, 1 when it fails,
    2 when the JAX extra is not installed."""
    args = parser().parse_args(argv)
    missing = [m for m in ("jax", "flax", "optax") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"ckptfmt demo needs {', '.join(missing)}: pip install -e '.[jax]'", file=sys.stderr)
        return 2
    workdir = args.dir or tempfile.mkdtemp(prefix="ckptfmt-demo-")
    os.makedirs(workdir, exist_ok=True)
    try:
        res = run(workdir, k=args.k, save_devices=args.save_devices // args.save_processes,
                  save_nproc=args.save_processes,
                  restore_devices=args.restore_devices, restore_mesh=args.restore_mesh,
                  policy="rank0" if args.save_processes > 1 else None)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(res, indent=1, default=str))
    else:
        _print_receipt(res)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
