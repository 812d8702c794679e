"""``ckptfmt show`` and ``ckptfmt diff`` (typer glue only; the work is in
:mod:`ckptfmt_tools.cli._compare`). Registered on the app by importing this module.

Exit codes as every command: 0 success (``diff`` exits 0 whether or not the steps differ: the
difference is its answer); 1 a CheckpointError (a step that is not committed, a key the step does
not hold, a slice that does not fit: ShapeMismatchError, a byte that fails verification), printed
or as the JSON document with ``"ok": false``; 2 usage.
"""
from __future__ import annotations

from typing import Optional

import typer

from ckptfmt_tools.cli import JsonOpt, _emit_json, _fail, _out, _repo, app

__all__ = ["show_cmd", "diff_cmd"]


@app.command("show")
def show_cmd(url: str = typer.Argument(..., help="Repository URL or path."),
             key: str = typer.Argument(..., help="The tensor's key path, e.g. params/dense/kernel."),
             step: Optional[int] = typer.Option(None, "--step", "-s", help="Step (default: latest)."),
             slice_text: Optional[str] = typer.Option(None, "--slice", help="Part of the tensor, numpy style "
                                                      "without steps: 0:4,: (rows 0-3), 3 (row 3), -1; dimensions "
                                                      "left out are whole (default: all of it)."),
             stats_only: bool = typer.Option(False, "--stats", help="Only the statistics (min, max, mean, NaN "
                                             "count), not the values."),
             as_json: bool = JsonOpt) -> None:
    """Print one tensor's values and statistics (min, max, mean, NaN count) for a slice, reading only
    the chunks the slice overlaps; --json reports the bytes read."""
    from ckptfmt.errors import CheckpointError
    from ckptfmt_tools.cli import _compare  # numpy and the library: not imported for --help

    try:
        doc, got = _compare.show_tensor(_repo(url), step, key, slice_text, values=not stats_only)
    except CheckpointError as exc:
        raise _fail(exc, as_json)
    if as_json:
        _emit_json({"ok": True, "url": url, **doc})
    else:
        _compare.show_view(_out(), url, doc, got)


@app.command("diff")
def diff_cmd(url: str = typer.Argument(..., help="Repository URL or path."),
             a: int = typer.Argument(..., help="The older step."),
             b: int = typer.Argument(..., help="The newer step."),
             values: bool = typer.Option(False, "--values", help="Read both steps' tensors and compare them "
                                         "exactly, with the max abs difference (reads every byte of both)."),
             as_json: bool = JsonOpt) -> None:
    """Tensors added, removed and changed from step A to step B (shapes, dtypes; --values: max abs
    difference), and the bytes B wrote against those it references from earlier saves."""
    from ckptfmt.errors import CheckpointError
    from ckptfmt_tools.cli import _compare  # numpy and the library: not imported for --help

    try:
        doc = _compare.diff_steps(_repo(url), a, b, values=values)
    except CheckpointError as exc:
        raise _fail(exc, as_json)
    if as_json:
        _emit_json({"ok": True, "url": url, **doc})
    else:
        _compare.diff_view(_out(), url, doc)
