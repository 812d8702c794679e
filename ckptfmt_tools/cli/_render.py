"""What the CLI shows: plain dicts built from the core API, and their rich renderings.

Every string that reaches a human-readable rendering goes through :func:`safe` first: key paths,
state keys, metadata, save ids, URLs and error messages all come from storage (or the user) and
may hold terminal escapes or rich markup. JSON output is written with ``json.dumps`` instead and
keeps every string exact.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import re
from collections import Counter
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.text import Text
from rich.progress import (BarColumn, DownloadColumn, Progress, TaskProgressColumn, TextColumn,
                           TimeRemainingColumn, TransferSpeedColumn)
from rich.table import Table
from rich.tree import Tree

__all__ = ["safe", "visible", "size", "plural", "step_summary", "describe_step", "verify_with_progress", "plain", "error", "steps_table",
           "inspect_view", "verify_summary", "gc_view", "fault_list", "fault_progress"]

# A backslash (so that an escape we print cannot be forged by the text itself), and any character
# Python does not call printable except the ASCII space: C0 and C1 controls, DEL, format characters
# (bidi overrides and isolates, zero-width characters), line and paragraph separators, other
# spaces, surrogates, private-use and unassigned code points.
_UNSAFE = re.compile(r"[^\x20-\x5b\x5d-\x7e]")


def _visible(m: re.Match[str]) -> str:
    c = m.group(0)
    if c == "\\":
        return "\\\\"
    if c.isprintable():
        return c
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def visible(value: Any) -> str:
    """``value`` as text with every terminal control and invisible character made visible (see
    :func:`safe`), for plain-text output such as markdown. Never raises."""
    return _UNSAFE.sub(_visible, value if isinstance(value, str) else str(value))


def safe(value: Any) -> str:
    """``value`` as text that is safe to hand to a rich console: controls made visible, markup escaped.

    Terminal controls (e.g. ``ESC ] 52`` clipboard writes, ``ESC [ 2J``), bidi overrides and other
    invisible characters become Python-style escapes (``\\x1b``, ``\\u202e``); a backslash becomes
    ``\\\\``; then rich markup is escaped, so ``[red]`` prints as itself. Never raises.
    """
    return escape(visible(value))


def _when(unix: float | None) -> str:
    if unix is None:
        return "-"
    return _dt.datetime.fromtimestamp(unix, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def size(n: int | None) -> str:
    """Bytes as text: ``512 B``, ``1.5 MiB``; ``-`` for None."""
    return _size(n)


def plural(n: int, word: str) -> str:
    """``1 writer``, ``2 writers``, ``0 writers``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def plain(obj: Any) -> Any:
    """A JSON-friendly copy of a report object (``to_json`` when it has one)."""
    if hasattr(obj, "to_json"):
        return obj.to_json()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return obj


# ------------------------------------------------------------------------------- data


def step_summary(repo: Any, step: int) -> dict[str, Any]:
    """One row of ``ls``; a manifest that cannot be read becomes a row with its error."""
    from ckptfmt.manager._query import recorded_metrics
    from ckptfmt.errors import CheckpointError

    try:
        m = repo.manifest(step)
    except CheckpointError as exc:
        return {"step": step, "error": type(exc).__name__, "message": exc.message}
    return {"step": step, "save_id": m.save_id, "created_unix": m.created_unix, "created": _when(m.created_unix),
            "bytes": m.nbytes, "written_bytes": m.written_nbytes, "referenced_bytes": m.referenced_nbytes,
            "references": sorted(m.referenced_saves), "tensors": len(m.tensors), "writers": m.writers,
            "state": sorted(m.state), "metrics": recorded_metrics(m)}


def _sharding_text(sh: dict[str, Any] | None) -> str:
    if not sh:
        return "-"
    parts = []
    if sh.get("framework"):
        parts.append(sh["framework"])
    if sh.get("mesh_shape"):
        names = sh.get("axis_names") or []
        parts.append("mesh " + "x".join(f"{a}={n}" if a else str(n)
                                        for n, a in zip(sh["mesh_shape"], names or [""] * len(sh["mesh_shape"]))))
    if sh.get("partition"):
        parts.append("P(" + ", ".join("None" if p is None else "+".join(p) for p in sh["partition"]) + ")")
        order = list(sh.get("axis_names") or [])
        strided = [p for p in sh["partition"] if p and [a for a in order if a in p] != list(p)]
        if strided:  # axes major to minor against the mesh's order: FSDP2 over TP (_StridedShard)
            parts.append("strided (" + "; ".join(f"{p[0]} major" for p in strided) + ")")
    if sh.get("replicated_axes"):
        parts.append("replicated over " + ",".join(sh["replicated_axes"]))
    return " ".join(parts) or "-"


def describe_step(repo: Any, step: int | None) -> dict[str, Any]:
    """Tensors and state keys of one step (``inspect``), from the manifest and the global state."""
    ckpt = repo.open(step)
    m = ckpt.manifest
    tensors = []
    for key in ckpt.keys():
        t = ckpt.tensor(key)
        text = _sharding_text(t.sharding)
        per_writer = Counter(int(w) for w in t.shards.writer)
        if t.sharding is None and max(per_writer.values(), default=0) > 1:  # a layout no partition describes
            text = f"{len(t.shards)} boxes over {len(per_writer)} writers, no partition recorded"
        tensors.append({"key": key, "shape": list(t.shape), "dtype": t.dtype, "sharding": t.sharding,
                        "sharding_text": text, "shards": len(t.shards),
                        "writers": sorted({int(w) for w in t.shards.writer}),
                        "shard_shape": list(t.array.shard_shape), "chunk_shape": list(t.array.chunk_shape),
                        "bytes": t.nbytes, "stored_bytes": int(t.shards.nbytes.sum()),
                        "referenced_bytes": t.referenced_nbytes})
    state_keys: list[str] = []
    if "global" in m.state:
        g = ckpt.state()
        state_keys = sorted(g) if isinstance(g, dict) else [f"<{type(g).__name__}>"]
    return {"step": m.step, "save_id": m.save_id, "created_unix": m.created_unix, "created": _when(m.created_unix),
            "writers": m.writers, "bytes": m.nbytes, "written_bytes": m.written_nbytes,
            "referenced_bytes": m.referenced_nbytes, "references": sorted(m.referenced_saves),
            "versions": dict(m.versions), "metadata": dict(m.metadata),
            "tensors": tensors, "state_keys": state_keys,
            "state_objects": [{"name": n, "scope": e.scope, "rank": e.rank, "bytes": e.nbytes}
                              for n, e in sorted(m.state.items())]}


def verify_with_progress(repo: Any, step: int, console: Console, *, quiet: bool) -> int:
    """Verify every byte of ``step`` with a progress bar on ``console`` (only on a terminal); return
    bytes checked."""
    if quiet or not console.is_terminal:
        return repo.verify(step)
    with Progress(TextColumn(f"verify step {step}"), BarColumn(), TaskProgressColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=False) as bar:
        task = bar.add_task("verify", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return repo.verify(step, progress=progress)


# ---------------------------------------------------------------------------- drawing


def error(console: Console, doc: dict[str, Any], *, step: int | None = None) -> None:
    where = f" (step {step})" if step is not None else ""
    console.print(f"[bold red]{safe(doc['error'])}[/]{where}: {safe(doc['message'])}")
    for field in ("key", "object", "expected", "found"):
        if doc.get(field) is not None:
            console.print(f"  {field}: {safe(doc[field])}")
    if doc.get("untyped"):
        console.print("  [red]this is not a CheckpointError: please report it as a ckptfmt bug[/]")


def _metrics_text(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()) or "-"


def middle_ellipsis(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters by an ellipsis in its middle, or unchanged when it fits.
    Both ends stay, the tail longer (a save id ends with its random part, which tells two saves of
    one step apart; its zero-padded step is in the step column)."""
    if len(text) <= width:
        return text
    if width < 2:
        return "…"
    head = (width - 1) // 3
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


#: ``ls``'s columns; the last four go first when the terminal is narrow (the step never does).
_LS_COLUMNS = ("step", "committed", "size", "written", "referenced", "tensors", "writers")
_LS_OPTIONAL = ("referenced", "written", "writers", "tensors")
_SAVE_ID_MIN = 15  # below this a save id says too little: drop a column instead


def _ls_cells(r: dict[str, Any]) -> dict[str, str]:
    if r.get("error"):
        return {"step": str(r["step"]), "committed": f"[red]{safe(r['error'])}[/]", "size": "-", "written": "-",
                "referenced": "-", "tensors": "-", "writers": "-", "save id": safe(r["message"])}
    return {"step": str(r["step"]), "committed": safe(r["created"]), "size": _size(r["bytes"]),
            "written": _size(r["written_bytes"]), "referenced": _size(r["referenced_bytes"]),
            "tensors": str(r["tensors"]), "writers": str(r["writers"]), "save id": safe(r["save_id"])}


def _ls_layout(width: int, cells: list[dict[str, str]], with_metrics: bool) -> tuple[list[str], int | None]:
    """The columns that fit ``width`` and the save id's width (None: shown whole). Every column but
    the save id (and the metrics, which fold) keeps its cells on one line."""
    def natural(col: str) -> int:
        return max([len(col)] + [len(Text.from_markup(c[col]).plain) for c in cells])

    cols = list(_LS_COLUMNS)
    metrics = 14 if with_metrics else 0
    while True:
        used = sum(natural(c) + 3 for c in cols) + 1 + 3 + (metrics + 3 if with_metrics else 0)
        room = width - used
        if room >= natural("save id"):
            return cols, None
        dropped = [c for c in _LS_OPTIONAL if c in cols]
        if room >= _SAVE_ID_MIN or not dropped:
            return cols, max(room, 1) if room >= _SAVE_ID_MIN else 0
        cols.remove(dropped[0])


def steps_table(console: Console, url: str, rows: list[dict[str, Any]]) -> None:
    """The ``ls`` table; the metrics column appears when any step recorded metrics (FORMAT.md 14.7).
    It fits the console's width: the save id loses its middle to an ellipsis, then the written,
    referenced, writers and tensors columns go (``--json`` has them all); the step and the commit
    time are never cut."""
    if not rows:
        console.print(f"no committed steps in {safe(url)}")
        return
    with_metrics = any(r.get("metrics") for r in rows)
    cells = [_ls_cells(r) for r in rows]
    cols, id_width = _ls_layout(console.width, cells, with_metrics)
    t = Table(title=f"committed steps in {safe(url)}")
    for col in cols:
        t.add_column(col, justify="left" if col == "committed" else "right", no_wrap=True)
    if id_width != 0:  # an unreadable step's message wraps in this column; ids are cut to fit
        t.add_column("save id", no_wrap=not any(r.get("error") for r in rows), overflow="fold")
    if with_metrics:
        t.add_column("metrics", overflow="fold")
    for r, c in zip(rows, cells):
        row = [c[col] for col in cols]
        if id_width != 0:
            row.append(c["save id"] if id_width is None or r.get("error") else
                       middle_ellipsis(c["save id"], id_width))
        t.add_row(*row, *([safe(_metrics_text(r.get("metrics") or {}))] if with_metrics else []))
    console.print(t)
    if len(cols) < len(_LS_COLUMNS) or id_width is not None:
        gone = [c for c in _LS_COLUMNS if c not in cols] + (["save id"] if id_width == 0 else [])
        note = f"{', '.join(gone)} hidden" if gone else "save ids shortened"
        console.print(f"[dim]{note} at {console.width} columns (ckptfmt ls --json shows all)[/]")


def inspect_view(console: Console, url: str, doc: dict[str, Any], *, wide: bool = False) -> None:
    """The ``inspect`` table. The key path (the column that names a tensor) is never cut: it wraps,
    or with ``wide`` stays on one line however long the row gets."""
    t = Table(title=f"step {doc['step']} of {safe(url)}: {plural(len(doc['tensors']), 'tensor')}, {_size(doc['bytes'])} "
                    f"({_size(doc['written_bytes'])} written, {_size(doc['referenced_bytes'])} referenced in "
                    f"{plural(len(doc['references']), 'earlier save')}), {plural(doc['writers'], 'writer')}, "
                    f"committed {safe(doc['created'])}")
    key_kw: dict[str, Any] = {"no_wrap": True} if wide else {"overflow": "fold", "min_width": 12}
    cells = [{"key path": safe(r["key"]), "shape": str(tuple(r["shape"])), "dtype": safe(r["dtype"]),
              "sharding": safe(r["sharding_text"]), "shards": str(r["shards"]), "bytes": _size(r["bytes"]),
              "referenced": _size(r["referenced_bytes"])} for r in doc["tensors"]]
    cols = ["key path", "shape", "dtype", "sharding", "shards", "bytes", "referenced"]
    if not wide:  # the columns that do not wrap, plus 12 for the key path and 10 for the sharding
        def least(cols: list[str]) -> int:
            fixed = [c for c in cols if c not in ("key path", "sharding")]
            return sum(max([len(c)] + [len(x[c]) for x in cells]) for c in fixed) + 22 + 3 * len(cols) + 1
        for optional in ("referenced", "shards"):
            if least(cols) > console.width:
                cols.remove(optional)
    for col in cols:
        t.add_column(col, **(key_kw if col == "key path" else {"overflow": "fold"} if col == "sharding" else
                              {"justify": "right", "no_wrap": True} if col in ("shards", "bytes", "referenced") else
                              {"no_wrap": True}))
    for c in cells:
        t.add_row(*(c[col] for col in cols))
    console.print(t)
    if len(cols) < 7:
        gone = ", ".join(c for c in ("shards", "referenced") if c not in cols)
        console.print(f"[dim]{gone} hidden at {console.width} columns (--wide or --json shows all)[/]")
    tree = Tree("non-tensor state")
    g = tree.add("global")
    for k in doc["state_keys"]:
        g.add(safe(k))
    ranks = [o for o in doc["state_objects"] if o["scope"] == "rank"]
    if ranks:
        tree.add(f"per-rank: {len(ranks)} objects (ranks {', '.join(str(o['rank']) for o in ranks)})")
    console.print(tree)


def verify_summary(console: Console, results: list[dict[str, Any]]) -> None:
    """The ``verify`` table: for a step that fails, the error, the tensor key path, the object, and
    what differed (expected against found)."""
    t = Table(title="verify")
    t.add_column("step", justify="right")
    t.add_column("result", overflow="fold")
    t.add_column("key path", overflow="fold")
    t.add_column("object", overflow="fold")
    t.add_column("what differed", overflow="fold")
    t.add_column("bytes checked", justify="right")
    for r in results:
        if r["ok"]:
            t.add_row(str(r["step"]), "[green]clean[/]", "-", "-", "-", _size(r["bytes"]))
            continue
        differed = safe(r["message"])
        if r.get("expected") is not None or r.get("found") is not None:
            differed += f" (expected {safe(r.get('expected'))}, found {safe(r.get('found'))})"
        t.add_row(str(r["step"]), f"[bold red]{safe(r['error'])}[/]", safe(r.get("key") or "-"),
                  safe(r.get("object") or "-"), differed, "-")
    console.print(t)


def gc_view(console: Console, url: str, doc: dict[str, Any]) -> None:
    dry = bool(doc.get("dry_run"))
    t = Table(title=f"gc of {safe(url)}" + (" (dry run: nothing deleted)" if dry else ""))
    t.add_column("what")
    t.add_column("value", overflow="fold")
    for k, v in doc.items():
        if k == "dry_run":
            continue
        name = {"removed_steps": "steps to remove", "removed_saves": "saves to remove",
                "objects_removed": "objects to remove"}.get(k, k) if dry else k
        name = name.replace("_", " ")
        t.add_row(safe(name), safe(", ".join(map(str, v)) if isinstance(v, list) else str(v)) or "-")
    console.print(t)


def fault_list(console: Console, names: list[dict[str, Any]]) -> None:
    t = Table(title="fault catalogue")
    t.add_column("fault")
    t.add_column("where")
    t.add_column("expected error")
    for f in names:
        t.add_row(safe(f["name"]), safe(f["where"]), safe(", ".join(f["expect"])))
    console.print(t)


@contextlib.contextmanager
def fault_progress(console: Console, *, quiet: bool, total: int) -> Iterator[Callable[[Any], None]]:
    """A progress bar that counts finished faults (stderr, only on a terminal); yields the per-outcome callback."""
    if quiet or not console.is_terminal:
        yield lambda o: None
        return
    with Progress(TextColumn("faults"), BarColumn(), TaskProgressColumn(), TextColumn("{task.description}"),
                  console=console, transient=True) as bar:
        task = bar.add_task("base save by 2 writer processes", total=total)

        def on_outcome(o: Any) -> None:
            bar.update(task, advance=1, description=f"{safe(o.fault)}: {'PASS' if o.passed else 'FAIL'}")

        yield on_outcome
