"""Training cadence: a small JAX training loop with and without a save every N steps.

The loop (:func:`_loop`) and its timing (:func:`cadence`) are shared by every system, so that the
three differ only in their save: ckptfmt through ``bridges.jax.CheckpointManager`` (async,
``keep_last=2``; :func:`run`), Orbax's and DCP's async saves (:mod:`.tailstep_peers`). Each
runs in a fresh process; the loop without saves is timed in the same process, in two halves
around the loop with saves, so that slow drift of a shared machine biases neither side.

Reported per system: p50/p99 step time of both loops and their ratios, the time the caller is
blocked per save (including any wait for the previous save), the save's total duration (from the
call to the commit, seen at the end of the step it finished in), and the recovery-point objective:
how many steps of work were not yet in a committed checkpoint, at worst and at the median.
ckptfmt also reports a synchronous save of the same state (the same manager with
``async_save=False``), for the blocked fraction. A step's time includes its save call.
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any, Protocol

from .child import rss_bytes

#: The loop's model: 4 layers of 1024 x 1024 float32 weights and biases, plus momentum: 32 MiB.
MODEL = {"hidden": 1024, "layers": 4, "batch": 128}


class Saver(Protocol):
    """One system's save under the cadence: ``step`` is called after every training step (inside
    its timing), ``poll`` after it (outside), ``close`` after the loop (waits for the last save)."""

    def step(self, t: int, state: dict) -> None: ...

    def poll(self, t: int) -> None: ...

    def close(self) -> None: ...


class Saves:
    """What a :class:`Saver` records: per save its step, blocked and waited seconds, its start,
    and the step and time at which it was first seen finished."""

    def __init__(self) -> None:
        self.started: list[tuple[int, float, float, float]] = []  # (step, t0, blocked_s, waited_s)
        self.finished: dict[int, float] = {}  # step -> duration_s (call to seen finished)
        self.committed = 0  # newest step seen finished

    def start(self, t: int, t0: float, waited_s: float = 0.0) -> None:
        self.started.append((t, t0, time.perf_counter() - t0, waited_s))

    def seen_done(self, t: int, now: float | None = None) -> None:
        """Every started save up to step ``t`` is finished (seen now)."""
        now = time.perf_counter() if now is None else now
        for s, t0, _, _ in self.started:
            if s <= t and s not in self.finished:
                self.finished[s] = now - t0
        self.committed = max(self.committed, t)

    def summary(self) -> dict[str, Any]:
        blocked = [b for _, _, b, _ in self.started]
        dur = list(self.finished.values())
        return {"saves": len(self.started), "committed": len(self.finished),
                "blocked_ms_median": statistics.median(blocked) * 1e3 if blocked else 0.0,
                "blocked_ms_max": max(blocked) * 1e3 if blocked else 0.0,
                "waited_ms_max": max((w for *_, w in self.started), default=0.0) * 1e3,
                "duration_ms_median": statistics.median(dur) * 1e3 if dur else 0.0,
                "duration_ms_max": max(dur) * 1e3 if dur else 0.0}


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def stat(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": _percentile(xs, 50) * 1e3, "p99_ms": _percentile(xs, 99) * 1e3, "mean_ms": statistics.fmean(xs) * 1e3}


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


class Trainer:
    """The loop's state and its compiled step; :meth:`timed` runs ``n`` steps, each timed with its
    save call. Model sizes from ``params`` (``hidden``, ``layers``, ``batch``; :data:`MODEL`)."""

    def __init__(self, params: dict) -> None:
        import jax

        self.model = {k: int(params.get(k, v)) for k, v in MODEL.items()}
        self.p, self.m, self._step = _loop(**self.model)
        self.state_bytes = sum(a.nbytes for a in jax.tree.leaves((self.p, self.m)))
        self.p, self.m = self._step(self.p, self.m)  # compile
        jax.block_until_ready(self.p)

    def state(self) -> dict:
        return {"params": self.p, "momentum": self.m}

    def advance(self) -> None:
        """One training step, waited for."""
        import jax

        self.p, self.m = self._step(self.p, self.m)
        jax.block_until_ready(self.p)

    def timed(self, saver: Saver | None, first_step: int, n: int, saves: Saves | None = None
              ) -> tuple[list[float], list[int]]:
        """Step times (s) and, per step, the steps not yet in a finished save (with ``saves``)."""
        times, at_risk = [], []
        for t in range(first_step + 1, first_step + n + 1):
            t0 = time.perf_counter()
            self.advance()
            if saver is not None:
                saver.step(t, self.state())
            times.append(time.perf_counter() - t0)
            if saver is not None:
                saver.poll(t)
            if saves is not None:
                at_risk.append(t - max(saves.committed, first_step))
        return times, at_risk


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cadence(trainer: Trainer, saver: Saver, saves: Saves, steps: int, baseline_steps: int | None = None
            ) -> dict[str, Any]:
    """Baseline halves around the loop with saves; the shared part of every system's result.
    ``baseline_steps``: steps of the loop without saves, in two halves (default ``steps``).

    ``save_cpu_ms``: the process's CPU time (user + system, every thread) of the loop with saves
    (until its last save finished) less that of as many steps without saves, per save: what a
    save takes from the cores training runs on, and less noisy than wall time on a shared machine."""
    nb = steps if baseline_steps is None else max(2, baseline_steps)
    c0 = _cpu_s()
    base, _ = trainer.timed(None, 0, nb // 2)
    c1 = _cpu_s()
    rss0 = rss_bytes()
    try:
        with_saves, at_risk = trainer.timed(saver, 1000, steps, saves)
    finally:
        saver.close()
    c2 = _cpu_s()
    base += trainer.timed(None, 0, nb - nb // 2)[0]
    base_cpu = (c1 - c0 + _cpu_s() - c2) / nb
    b, s = stat(base), stat(with_saves)
    out = {"steps": steps, "state_bytes": trainer.state_bytes, "model": trainer.model,
           "baseline": b, "with_saves": s,
           "p50_ratio": s["p50_ms"] / b["p50_ms"], "p99_ratio": s["p99_ms"] / b["p99_ms"],
           "rpo_steps": max(at_risk), "rpo_steps_median": statistics.median(at_risk), "rss_before_saves": rss0,
           "cpu_ms_per_step": base_cpu * 1e3,
           "save_cpu_ms": (c2 - c1 - base_cpu * steps) * 1e3 / max(1, len(saves.started))}
    return out | saves.summary()


class _Ours:
    """ckptfmt: ``bridges.jax.CheckpointManager`` (async, keep_last=2), saved every step; its own
    cadence decides. A save is finished when the manager's history holds it."""

    def __init__(self, url: str, every: int, saves: Saves, options: Any = None) -> None:
        import bridges.jax as bridge

        self.mgr = bridge.CheckpointManager(url, save_every_steps=every, keep_last=2, options=options)
        self.saves = saves

    def step(self, t: int, state: dict) -> None:
        t0 = time.perf_counter()
        if self.mgr.save(t, state):
            self.saves.start(t, t0)

    def poll(self, t: int) -> None:
        done = [r.step for r in self.mgr.history if r.committed]
        if done:
            self.saves.seen_done(done[-1])

    def close(self) -> None:
        self.mgr.wait()
        self.poll(0)
        self.mgr.close()


def run(params: dict) -> dict:
    """Child task: ckptfmt's cadence run, then synchronous saves of the same state.

    ``params``: ``steps``, ``every``, ``url``; optional model sizes (:data:`MODEL`) and
    ``options`` (keyword arguments of :class:`ckptfmt.SaveOptions` for every save)."""
    import bridges.jax as bridge
    from ckptfmt import SaveOptions

    from .ours import clear_repository

    steps, every, url = params["steps"], params["every"], params["url"]
    options = SaveOptions(**params["options"]) if params.get("options") else None
    clear_repository(url)
    trainer = Trainer(params)
    saves = Saves()
    ours = _Ours(url, every, saves, options)
    out = cadence(trainer, ours, saves, steps)
    records = ours.mgr.history
    # Synchronous saves of the same state, for the blocked fraction.
    with bridge.CheckpointManager(url, async_save=False, keep_last=2, options=options) as sync_mgr:
        for k in range(3):
            sync_mgr.save(10_000 + k, trainer.state(), force=True)
    sync_med = statistics.median(r.blocked_s for r in sync_mgr.history)
    clear_repository(url)
    return out | {
        "system": "ckptfmt", "every": every, "save_mode": "async (bridges.jax.CheckpointManager, keep_last=2)",
        # The manager's own figures: blocked includes the wait for the previous save; write is
        # from the save's start to its commit, exact (not seen at a step's end).
        "blocked_ms_median": statistics.median(r.blocked_s for r in records) * 1e3 if records else 0.0,
        "write_ms_median": statistics.median(r.write_s for r in records) * 1e3 if records else 0.0,
        "bytes_per_save": records[-1].bytes if records else 0,
        "sync_save_ms_median": sync_med * 1e3,
        "blocked_fraction": statistics.median(r.blocked_s for r in records) / sync_med if records and sync_med else None,
        "committed": sum(r.committed for r in records), "options": params.get("options") or {}, "notes": [],
    }
