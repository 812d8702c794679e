"""Training cadence: a small JAX training loop with and without a save every N steps, through the
checkpoint manager (``bridges.jax.CheckpointManager``, async, ``keep_last=2``).

Reports p50/p99 step time of both loops, the time the caller is blocked per save (the manager's
``blocked_s``, including any wait for the previous save) against a synchronous save of the same
state (the same manager with ``async_save=False``), and the recovery-point objective: how many
steps of work were not yet in a committed checkpoint, at worst and at the median.
"""

from __future__ import annotations

import statistics
import time

from .child import rss_bytes


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _loop(hidden: int, layers: int, batch: int):
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    keys = jax.random.split(key, layers + 2)
    params = {f"layer{i}": {"w": jax.random.normal(keys[i], (hidden, hidden), jnp.float32) / hidden**0.5,
                            "b": jnp.zeros((hidden,), jnp.float32)} for i in range(layers)}
    momentum = jax.tree.map(jnp.zeros_like, params)
    x = jax.random.normal(keys[-2], (batch, hidden), jnp.float32)
    y = jax.random.normal(keys[-1], (batch, hidden), jnp.float32)

    def loss(p):
        h = x
        for i in range(layers):
            h = jnp.tanh(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
        return jnp.mean((h - y) ** 2)

    @jax.jit
    def step(p, m):
        g = jax.grad(loss)(p)
        m = jax.tree.map(lambda m_, g_: 0.9 * m_ + g_, m, g)
        p = jax.tree.map(lambda p_, m_: p_ - 1e-3 * m_, p, m)
        return p, m

    return params, momentum, step


def run(params: dict) -> dict:
    """Child task: baseline loop, loop with saves through the manager, and synchronous saves."""
    import jax

    import bridges.jax as bridge

    from .ours import clear_repository

    steps, every, url = params["steps"], params["every"], params["url"]
    hidden, layers, batch = params.get("hidden", 1024), params.get("layers", 4), params.get("batch", 128)
    clear_repository(url)
    p, m, step = _loop(hidden, layers, batch)
    state_bytes = sum(a.nbytes for a in jax.tree.leaves((p, m)))
    p, m = step(p, m)  # compile
    jax.block_until_ready(p)

    def timed_loop(mgr: bridge.CheckpointManager | None, first_step: int, n: int) -> tuple[list[float], list[int]]:
        nonlocal p, m
        times, at_risk = [], []
        committed = first_step
        for t in range(first_step + 1, first_step + n + 1):
            t0 = time.perf_counter()
            p, m = step(p, m)
            jax.block_until_ready(p)
            if mgr is not None:
                mgr.save(t, {"params": p, "momentum": m})  # saves when the cadence says so
            times.append(time.perf_counter() - t0)
            if mgr is not None:
                done = [r.step for r in mgr.history if r.committed]
                committed = done[-1] if done else committed
            at_risk.append(t - committed)
        return times, at_risk

    # The no-save baseline runs in two halves around the loop with saves, so that slow drift of a
    # shared machine biases neither side.
    base, _ = timed_loop(None, 0, steps // 2)
    rss0 = rss_bytes()
    with bridge.CheckpointManager(url, save_every_steps=every, keep_last=2) as mgr:
        with_saves, at_risk = timed_loop(mgr, 1000, steps)
        mgr.wait()
    records = mgr.history
    base += timed_loop(None, 0, steps - steps // 2)[0]
    # Synchronous saves of the same state, for the blocked fraction.
    with bridge.CheckpointManager(url, async_save=False, keep_last=2) as sync_mgr:
        for k in range(3):
            sync_mgr.save(10_000 + k, {"params": p, "momentum": m}, force=True)
    sync = [r.blocked_s for r in sync_mgr.history]
    clear_repository(url)
    stat = lambda xs: {"p50_ms": _percentile(xs, 50) * 1e3, "p99_ms": _percentile(xs, 99) * 1e3, "mean_ms": statistics.fmean(xs) * 1e3}  # noqa: E731
    blocked = [r.blocked_s for r in records]
    blocked_med = statistics.median(blocked) if blocked else 0.0
    sync_med = statistics.median(sync)
    return {
        "steps": steps, "every": every, "save_mode": "async (bridges.jax.CheckpointManager, keep_last=2)",
        "state_bytes": state_bytes, "model": {"hidden": hidden, "layers": layers, "batch": batch},
        "baseline": stat(base), "with_saves": stat(with_saves),
        "blocked_ms_median": blocked_med * 1e3, "blocked_ms_max": max(blocked) * 1e3 if blocked else 0.0,
        "waited_ms_max": max((r.waited_s for r in records), default=0.0) * 1e3,
        "write_ms_median": statistics.median(r.write_s for r in records) * 1e3 if records else 0.0,
        "bytes_per_save": records[-1].bytes if records else 0,
        "sync_save_ms_median": sync_med * 1e3,
        "blocked_fraction": blocked_med / sync_med if sync_med else None,
        "rpo_steps": max(at_risk), "rpo_steps_median": statistics.median(at_risk), "saves": len(records),
        "committed": sum(r.committed for r in records), "rss_before_saves": rss0, "notes": [],
    }
