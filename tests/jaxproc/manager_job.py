"""One process of the JAX checkpoint-manager acceptance runs (driven by tests/test_manager_mp.py).

train:  a rank of a 2-process jax.distributed job (4 CPU devices each, mesh data x model = 4x2)
        training ckptfmt_tools.training's model with bridges.jax.CheckpointManager(save_every_steps=5),
        async. Each step: save (cadence), then reached_preemption; on preemption it saves with
        force=True, records the state digests, and leaves the loop; close() waits for the commit.
        Rank 0 logs every step (loss, batch ids) and "preempt_save_started" to --log.
resume: one process of 4 devices (mesh 2x2) that runs the tasks in --tasks (a JSON list), each
        with a fresh Trainer and manager, and writes what each restored and the next steps.

usage: manager_job.py zygote SPEC_JSON   (forks the train ranks listed in SPEC_JSON; see zygote())
       manager_job.py train --url U --out JSON --log JSONL --port P --rank R [--keep-best]
                      [--record-at N] [--slow-after N] [--max-steps N]
       manager_job.py resume --tasks JSON --out JSON
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]  # repo root, tests/

STEP_TIME_S = 0.04


def _cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def train(args: argparse.Namespace) -> dict:
    import jax

    import bridges.jax as bjax
    from ckptfmt_tools.training import Config, Trainer, digest_tree, make_mesh
    from ckptfmt import Repository, SaveOptions
    from manager_common import eval_loss

    tr = Trainer(Config(), make_mesh((4, 2)))
    rank0 = jax.process_index() == 0
    policy = dict(keep_best=2, best_metric="eval_loss", keep_last=1) if args.keep_best else {}
    log = open(args.log, "a", buffering=1) if rank0 else None
    res: dict = {"rank": jax.process_index(), "started": [], "preempted_at": None}
    with bjax.CheckpointManager(args.url, save_every_steps=5, **policy) as mgr:
        for _ in range(args.max_steps):
            t0 = time.time()
            loss, ids = tr.train_step()
            step = tr.step
            if step == 1:
                res["cpu_s_at_step_1"] = _cpu_s()
            if log:
                log.write(json.dumps({"step": step, "loss": loss, "ids": ids}) + "\n")
            state = tr.checkpoint_state()
            if mgr.save(step, state, metrics={"eval_loss": eval_loss(step)}):
                res["started"].append(step)
            if step == args.record_at:
                mgr.wait()
                res["steps_at_record"] = Repository(args.url).steps()
            if step == args.slow_after:
                mgr.wait()  # this step committed at full speed; every later save crawls
                mgr.options = SaveOptions(max_write_bytes_per_s=2000)
            if mgr.reached_preemption(step):
                res["preempted_at"] = step
                if mgr.save(step, state, force=True):  # the documented line: keeps the metrics given above
                    res["started"].append(step)
                if log:  # step's save is in flight now (forced, or started by the cadence)
                    log.write(json.dumps({"preempt_save_started": step}) + "\n")
                res["digests"] = digest_tree(state)
                break
            time.sleep(max(0.0, STEP_TIME_S - (time.time() - t0)))
    res["latest_after_close"] = Repository(args.url).latest()
    res["cpu_s"] = _cpu_s()
    res["history"] = [r.to_json() for r in mgr.history]
    return res


def resume(args: argparse.Namespace) -> dict:
    import bridges.jax as bjax
    from ckptfmt_tools.training import Config, Trainer, digest_tree, make_mesh
    from ckptfmt.errors import CheckpointError

    # One trainer for every task: a successful restore replaces all of its state (model, optimizer,
    # loss scale, keys, data cursor, step), and a failed one leaves it untouched.
    tr = Trainer(Config(), make_mesh((2, 2)))
    out = {}
    for task in json.load(open(args.tasks)):
        r: dict = {}
        if task["name"] == "sigterm":  # one process: the manager's own SIGTERM flag
            with bjax.CheckpointManager(task["url"]) as mgr:
                before = mgr.reached_preemption(1)
                os.kill(os.getpid(), signal.SIGTERM)
                out["sigterm"] = {"before": before, "after": mgr.reached_preemption(2)}
            continue
        try:
            with bjax.CheckpointManager(task["url"], fallback=task.get("fallback", True)) as mgr:
                got = mgr.restore(tr.target(), step=task.get("step"))
            r.update(step=got.step, skipped=[[k.step, k.error] for k in got.skipped], digests=digest_tree(got.state))
            tr.load(got.state)
            loss, ids = tr.train_step()
            r.update(loss_k1=loss, batch_ids_k1=ids, loss_k2=tr.train_step()[0])
        except CheckpointError as e:
            r.update(error=type(e).__name__, message=str(e)[:300])
        out[task["name"]] = r
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "resume"])
    ap.add_argument("--url", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", default="")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--keep-best", action="store_true")
    ap.add_argument("--record-at", type=int, default=-1)
    ap.add_argument("--slow-after", type=int, default=-1)
    ap.add_argument("--max-steps", type=int, default=150)
    ap.add_argument("--tasks", default="")
    return ap


def run(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    import jax

    if args.mode == "train":
        from ckptfmt_tools.jaxjoin import join as join_jax
        join_jax(args.port, 2, args.rank, timeout=120)
        res = train(args)
    else:
        res = resume(args)
    with open(args.out, "w") as f:
        json.dump(res, f)
    if args.mode == "train":
        jax.distributed.shutdown()


def zygote(spec_path: str) -> None:
    """Import JAX, flax, optax and the bridge once, then fork the ranks listed in the spec (no XLA
    backend exists before the fork). The children share a compilation cache beside the spec: the
    jobs after the first (the spec makes them wait for its first step) load its programs instead
    of compiling them again, which saves about 4 CPU-seconds per process."""
    import jax

    import ckptfmt_tools.training  # noqa: F401
    import bridges.jax  # noqa: F401
    from manager_common import fork_children

    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.dirname(os.path.abspath(spec_path)), "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    fork_children(spec_path, run)


if __name__ == "__main__":
    if sys.argv[1] == "zygote":
        zygote(sys.argv[2])
    else:
        run(sys.argv[1:])
