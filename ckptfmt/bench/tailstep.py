"""Tail-step slowdown: a small JAX training loop with and without a save every N steps.

Reports p50/p99 step time of both loops, the time the caller is blocked per
save (against a synchronous save of the same state), and the recovery-point
objective: how many steps of work were not yet in a committed checkpoint, at
worst and at the median. Saves are asynchronous when the JAX bridge offers
``save(..., blocking=False)``; otherwise they are synchronous and the result
says so (``save_mode``).
"""

from __future__ import annotations

import inspect
import statistics
import time
from typing import Any, Callable

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


class _Saver:
    """The best save path available: async bridge, sync bridge, or the core API."""

    def __init__(self, url: str):
        self.url, self.mode, self.notes = url, "", []
        self._bridge = None
        try:
            from bridges import jax as bridge  # type: ignore[import-not-found]

            if hasattr(bridge, "save"):
                self._bridge = bridge
        except ImportError:
            pass
        if self._bridge is not None and "blocking" in inspect.signature(self._bridge.save).parameters:
            self.mode = "async (bridges.jax.save blocking=False)"
        elif self._bridge is not None:
            self.mode = "sync (bridges.jax.save has no blocking=False yet)"
        else:
            self.mode = "sync (core ckptfmt.save; no JAX bridge yet)"

    @property
    def is_async(self) -> bool:
        return self.mode.startswith("async")

    def save(self, step: int, tree: dict, *, blocking: bool) -> Any:
        if self._bridge is not None:
            if self.is_async:
                return self._bridge.save(self.url, tree, step=step, blocking=blocking)
            return self._bridge.save(self.url, tree, step=step)
        return _core_save(self.url, step, tree)


def _core_save(url: str, step: int, tree: dict) -> None:
    import jax
    import numpy as np

    import ckptfmt

    shards = []
    for path, arr in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = "/".join(str(getattr(p, "key", p)) for p in path)
        shards.append(ckptfmt.LocalShard(key, arr.shape, arr.dtype, ckptfmt.Box((0,) * arr.ndim, arr.shape), data=np.asarray(arr)))
    ckptfmt.save(url, step, shards, coordinator=ckptfmt.LocalCoordinator())


def _done(handle: Any) -> bool:
    if handle is None:
        return True
    for name in ("done", "is_done", "committed"):
        attr = getattr(handle, name, None)
        if attr is not None:
            return bool(attr() if callable(attr) else attr)
    return False


def _wait(handle: Any) -> None:
    if handle is None:
        return
    for name in ("wait", "result", "join"):
        fn: Callable | None = getattr(handle, name, None)
        if callable(fn):
            fn()
            return


def run(params: dict) -> dict:
    """Child task: baseline loop, loop with saves, and synchronous saves for reference."""
    import jax

    from .ours import clear_repository

    steps, every, url = params["steps"], params["every"], params["url"]
    hidden, layers, batch = params.get("hidden", 1024), params.get("layers", 4), params.get("batch", 128)
    clear_repository(url)
    p, m, step = _loop(hidden, layers, batch)
    state_bytes = sum(a.nbytes for a in jax.tree.leaves((p, m)))
    p, m = step(p, m)  # compile
    jax.block_until_ready(p)

    def timed_loop(with_saves: bool, saver: _Saver | None, first_step: int, n: int):
        nonlocal p, m
        times, blocked, at_risk = [], [], []
        committed, pending = first_step, []  # pending: [(step, handle)]
        for t in range(first_step + 1, first_step + n + 1):
            t0 = time.perf_counter()
            p, m = step(p, m)
            jax.block_until_ready(p)
            if with_saves and t % every == 0:
                b0 = time.perf_counter()
                h = saver.save(t, {"params": p, "momentum": m}, blocking=False)
                blocked.append(time.perf_counter() - b0)
                if saver.is_async:
                    pending.append((t, h))
                else:
                    committed = t
            times.append(time.perf_counter() - t0)
            while pending and _done(pending[0][1]):
                committed = pending.pop(0)[0]
            at_risk.append(t - committed)
        for _t, h in pending:
            _wait(h)
        return times, blocked, at_risk

    # The no-save baseline runs in two halves around the loop with saves, so that slow drift of a
    # shared machine biases neither side.
    base, _, _ = timed_loop(False, None, 0, steps // 2)
    saver = _Saver(url)
    rss0 = rss_bytes()
    with_saves, blocked, at_risk = timed_loop(True, saver, 1000, steps)
    base += timed_loop(False, None, 0, steps - steps // 2)[0]
    # Synchronous saves of the same state, for the blocked fraction.
    sync = []
    for k in range(3):
        t0 = time.perf_counter()
        h = saver.save(10_000 + k, {"params": p, "momentum": m}, blocking=True)
        _wait(h) if saver.is_async else None
        sync.append(time.perf_counter() - t0)
    clear_repository(url)
    stat = lambda xs: {"p50_ms": _percentile(xs, 50) * 1e3, "p99_ms": _percentile(xs, 99) * 1e3, "mean_ms": statistics.fmean(xs) * 1e3}  # noqa: E731
    blocked_med = statistics.median(blocked) if blocked else 0.0
    sync_med = statistics.median(sync)
    return {
        "steps": steps, "every": every, "save_mode": saver.mode, "state_bytes": state_bytes,
        "model": {"hidden": hidden, "layers": layers, "batch": batch},
        "baseline": stat(base), "with_saves": stat(with_saves),
        "blocked_ms_median": blocked_med * 1e3, "blocked_ms_max": max(blocked) * 1e3 if blocked else 0.0,
        "sync_save_ms_median": sync_med * 1e3,
        "blocked_fraction": blocked_med / sync_med if sync_med and saver.is_async else None,
        "rpo_steps": max(at_risk), "rpo_steps_median": statistics.median(at_risk), "saves": len(blocked),
        "rss_before_saves": rss0,
        "notes": saver.notes + ([] if saver.is_async else ["saves are synchronous: the caller is blocked for the whole save"]),
    }
