"""The ``ckptfmt`` command line (typer + rich).

Commands: ``ls``, ``inspect``, ``show``, ``diff``, ``verify``, ``gc``, ``delete``, ``export``,
``import``, ``faults``, ``demo``, ``bench`` and ``drill``; every one is a typer command whose
options ``--help`` lists (a flag is shown as a flag; ``demo``, ``bench`` and ``drill`` forward
their options to the tools' runners, :mod:`ckptfmt_tools.cli._runs`).

Exit codes: 0 success; 1 a :class:`~ckptfmt.errors.CheckpointError` (its class name, tensor
key, object, expected and found are printed, or emitted as JSON with ``--json``); 2 usage
(also ``delete`` of the newest committed step without ``--force``: ``"error": "usage"`` with --json).
Every command takes ``--json`` and then prints exactly one JSON document on stdout, whose
``"ok"`` is true exactly when the command exits 0. A command that reads a repository (``ls``,
``inspect``, ``show``, ``diff``, ``verify``, ``gc``, ``export``) exits 1 with
``NotARepositoryError`` when the URL holds none (FORMAT.md 4.5); an empty repository is not an
error for ``ls`` ("no committed steps", exit 0).
The long commands (``verify``, ``faults``, ``bench``, ``drill``) show their progress on stderr
(on a terminal, and never with ``--json``).

Human-readable output passes every string through :func:`ckptfmt_tools.cli._render.safe` (terminal
controls made visible, rich markup escaped); JSON output keeps every string exact.
"""
from __future__ import annotations

import difflib
import json
import os
import sys
from typing import Any, Optional

import typer
from rich.console import Console

from ckptfmt_tools.cli import _render, _runs

__all__ = ["app", "main"]

app = typer.Typer(
    name="ckptfmt",
    help="Inspect, show, diff, verify, garbage-collect, delete, import and export ckptfmt checkpoints; "
         "run the demo, the fault table and the recovery drill. (bench is for ckptfmt's developers.)",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: typer's rich help prints a type after every flag ("--json <bool>"), as if it took a value.
    rich_markup_mode=None,
)

JsonOpt = typer.Option(False, "--json", help="Print one JSON document on stdout instead of tables.")


def _show_version(value: bool) -> None:
    if value:
        import ckptfmt
        from ckptfmt.manifest import FORMAT_REVISION

        sys.stdout.write(f"ckptfmt {ckptfmt.__version__} (format version 1, revision {FORMAT_REVISION})\n")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                       help="Print the library's version and the format revision it writes, then exit.")
          ) -> None:
    """ckptfmt's command line."""


def _out(width: int | None = None) -> Console:
    # Piped output (README pastes, CI logs) gets a wide page instead of rich's 80-column default.
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, soft_wrap=False, width=width or (200 if wide else None))


def _err() -> Console:
    return Console(stderr=True, highlight=False)


def _emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def _exit_unless(ok: bool) -> None:
    """The exit code that goes with the ``"ok"`` a command printed (0 when ok, else 1)."""
    if not ok:
        raise typer.Exit(code=1)


def _fail(exc: BaseException, as_json: bool) -> "typer.Exit":
    """Report a CheckpointError (or a storage-level OSError) and return the Exit to raise."""
    from ckptfmt.errors import CheckpointError

    if isinstance(exc, CheckpointError):
        doc = exc.to_json()
    else:  # not a typed error: still report the class, but this is a bug in ckptfmt
        doc = {"error": type(exc).__name__, "message": str(exc), "key": None, "object": None,
               "expected": None, "found": None, "untyped": True}
    if as_json:
        _emit_json({"ok": False, **doc})
    else:
        _render.error(_err(), doc)
    return typer.Exit(code=1)


def _print_foreign(keys: list[str]) -> None:
    """Keys under manifests/ that are not steps (FORMAT.md 4.2): ignored, but worth knowing about."""
    if keys:
        shown = ", ".join(_render.safe(k) for k in keys[:20])
        more = f" and {len(keys) - 20} more" if len(keys) > 20 else ""
        _out().print(f"[yellow]foreign objects under manifests/ (not steps, ignored):[/] {shown}{more}")


def _repo(url: str, *, recognise: bool = True):
    """The repository at ``url``; with ``recognise`` (every command that reads one), first
    NotARepositoryError unless the URL holds a repository (FORMAT.md 4.5), so that a mistyped path
    is never reported as a repository with no committed step."""
    from ckptfmt import Repository

    repo = Repository(url)
    if recognise:
        repo.recognise()
    return repo


# ----------------------------------------------------------------------------------- ls


@app.command("ls")
def ls_cmd(url: str = typer.Argument(..., help="Repository URL or path."),
           as_json: bool = JsonOpt) -> None:
    """List committed steps with their sizes, writers and commit times."""
    from ckptfmt.errors import CheckpointError

    try:
        repo = _repo(url)
        rows = [_render.step_summary(repo, step) for step in repo.steps()]
        foreign = repo.foreign_manifests()
    except CheckpointError as exc:
        raise _fail(exc, as_json)
    ok = not any(r.get("error") for r in rows)
    if as_json:
        _emit_json({"ok": ok, "url": url, "steps": rows, "foreign": foreign})
    else:
        _render.steps_table(_out(), url, rows)
        _print_foreign(foreign)
    _exit_unless(ok)


# ------------------------------------------------------------------------------ inspect


@app.command("inspect")
def inspect_cmd(url: str = typer.Argument(..., help="Repository URL or path."),
                step: Optional[int] = typer.Option(None, "--step", "-s", help="Step (default: latest)."),
                wide: bool = typer.Option(False, "--wide", help="Keep each key path on one line, however wide "
                                          "the table gets (default: long key paths wrap; none is cut)."),
                as_json: bool = JsonOpt) -> None:
    """Show the tensors of one step (key path, shape, dtype, sharding, shards, bytes) and state keys."""
    from ckptfmt.errors import CheckpointError

    try:
        repo = _repo(url)
        doc = _render.describe_step(repo, step)
    except CheckpointError as exc:
        raise _fail(exc, as_json)
    if as_json:
        _emit_json({"ok": True, "url": url, **doc})
    else:
        width = max(200, 110 + max((len(t["key"]) + len(t["sharding_text"]) for t in doc["tensors"]), default=0))
        _render.inspect_view(_out(width if wide else None), url, doc, wide=wide)


# ------------------------------------------------------------------------------- verify


@app.command("verify")
def verify_cmd(url: str = typer.Argument(..., help="Repository URL or path."),
               step: Optional[int] = typer.Option(None, "--step", "-s", help="Step (default: latest)."),
               all_steps: bool = typer.Option(False, "--all", help="Verify every committed step."),
               as_json: bool = JsonOpt) -> None:
    """Check every byte of a step against the manifest's sizes and crc32c. Exit 0 only if clean."""
    from ckptfmt.errors import CheckpointError, StepNotFoundError

    if all_steps and step is not None:
        raise typer.BadParameter("give --step or --all, not both")
    results: list[dict[str, Any]] = []
    try:
        repo = _repo(url)
        foreign = repo.foreign_manifests()
        if all_steps:
            steps = repo.steps()
        else:
            latest = repo.latest() if step is None else step
            if latest is None:
                raise StepNotFoundError("the repository has no committed step", object=url)
            steps = [latest]
    except CheckpointError as exc:
        raise _fail(exc, as_json)
    console = _err()
    for s in steps:
        try:
            nbytes = _render.verify_with_progress(repo, s, console, quiet=as_json)
            results.append({"step": s, "ok": True, "bytes": nbytes})
        except CheckpointError as exc:
            results.append({"step": s, "ok": False, **exc.to_json()})
            if not as_json and not sys.stdout.isatty():  # on a terminal the table below says it: once
                _render.error(console, exc.to_json(), step=s)
    ok = all(r["ok"] for r in results)
    if as_json:
        _emit_json({"ok": ok, "url": url, "steps": results, "foreign": foreign})
    else:
        _render.verify_summary(_out(), results)
        _print_foreign(foreign)
    _exit_unless(ok)


# ----------------------------------------------------------------------------------- gc


@app.command("gc")
def gc_cmd(url: str = typer.Argument(..., help="Repository URL or path."),
           keep_last: Optional[int] = typer.Option(None, "--keep-last", min=1,
                                                   help="Delete committed steps older than the newest N."),
           keep_every: Optional[int] = typer.Option(None, "--keep-every", min=1,
                                                    help="With --keep-last, also keep every step divisible by N."),
           grace_s: Optional[float] = typer.Option(None, "--grace-s", min=0.0,
                                                   help="Only remove uncommitted saves whose lease is older "
                                                        "than this (default: the repository's lease grace)."),
           dry_run: bool = typer.Option(False, "--dry-run", help="Delete nothing: report what a run would "
                                        "remove."),
           as_json: bool = JsonOpt) -> None:
    """Apply retention and remove leftovers of saves that never committed. Exits 1 when it finds
    committed steps whose manifest is damaged (listed; kept)."""
    from ckptfmt.errors import CheckpointError

    try:
        report = _repo(url, recognise=False).gc(grace_s=grace_s, keep_last=keep_last, keep_every=keep_every,
                                                dry_run=dry_run)  # gc recognises it
    except CheckpointError as exc:
        raise _fail(exc, as_json)
    doc = _render.plain(report)
    ok = not report.damaged_steps
    if as_json:
        _emit_json({"ok": ok, "url": url, "report": doc})
    else:
        _render.gc_view(_out(), url, doc)
        if dry_run:
            _out().print("dry run: nothing was deleted; run again without --dry-run to remove what is listed")
        for s in report.damaged_steps:
            _err().print(f"[bold red]step {s} has a damaged manifest[/] (kept): ckptfmt verify {_render.safe(url)} "
                         f"--step {s} says what is wrong; ckptfmt delete {_render.safe(url)} {s} removes it")
    _exit_unless(ok)


# ------------------------------------------------------------------------------- delete


def _refuse_newest(url: str, step: int, steps: list[int], as_json: bool) -> "typer.Exit":
    """Say that ``step`` is the newest committed step and that deleting it takes --force; the Exit (2) to raise."""
    message = (f"step {step} is the newest committed step of {url}; nothing deleted. Pass --force to delete it "
               "(a restore of the latest step then gets the one before it)")
    if as_json:
        _emit_json({"ok": False, "error": "usage", "message": message, "url": url, "step": step, "newest": True,
                    "steps": steps})
    else:
        _err().print(f"[red]refused:[/] {_render.safe(message)}")
    return typer.Exit(code=2)


@app.command("delete")
def delete_cmd(url: str = typer.Argument(..., help="Repository URL or path."),
               step: int = typer.Argument(..., help="The committed step to delete."),
               force: bool = typer.Option(False, "--force", help="Also delete the newest committed step."),
               as_json: bool = JsonOpt) -> None:
    """Delete one committed step, its manifest first, then the objects nothing else needs (FORMAT.md 4.4).
    The newest committed step only with --force: without it, exit 2 (usage) and nothing deleted."""
    from ckptfmt.errors import CheckpointError, StepNotFoundError

    try:
        repo = _repo(url)
        steps = repo.steps()
        if step not in steps:
            raise StepNotFoundError("no such committed step; nothing deleted", object=url,
                                    expected=f"one of {steps[-8:]}", found=step)
        if step == steps[-1] and not force:
            # Not a checkpoint fault (the step exists): a usage refusal, exit 2, nothing deleted.
            raise _refuse_newest(url, step, steps, as_json)
        repo.delete(step)
    except CheckpointError as exc:
        raise _fail(exc, as_json)
    left = repo.steps()
    if as_json:
        _emit_json({"ok": True, "url": url, "deleted": step, "steps": left})
    else:
        _out().print(f"deleted step {step} of {_render.safe(url)}; committed steps now: "
                     f"{', '.join(map(str, left[-12:])) or 'none'}")


# ------------------------------------------------------------------------------- faults


@app.command("faults")
def faults_cmd(as_json: bool = JsonOpt,
               workdir: Optional[str] = typer.Option(None, "--workdir", help="Keep each fault's repository "
                                                     "under this directory (default: a temporary one)."),
               only: Optional[list[str]] = typer.Option(None, "--only", help="Run only these faults "
                                                        "(repeatable; see --list)."),
               list_only: bool = typer.Option(False, "--list", help="List the fault names and exit."),
               markdown: bool = typer.Option(False, "--markdown", help="Print the table as GitHub markdown."),
               peers: bool = typer.Option(False, "--peers", help="Also measure Orbax and torch DCP "
                                          "for the faults where that is cheap (needs jax/torch).")) -> None:
    """Run every fault of the catalogue, one per fresh repository, and print the outcome table."""
    from ckptfmt_tools import faults

    if list_only:
        names = [{"name": f.name, "where": f.where, "expect": [e.__name__ for e in f.expect]}
                 for f in faults.CATALOGUE]
        if as_json:
            _emit_json({"ok": True, "faults": names})
        else:
            _render.fault_list(_out(), names)
        return
    # "--only a,b" and "--only a --only b" alike; an unknown name is a usage error with the closest names.
    only = [n.strip() for item in (only or []) for n in item.split(",") if n.strip()] or None
    known = [f.name for f in faults.CATALOGUE]
    for name in only or []:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            raise typer.BadParameter(f"no fault named {name!r}" + (f"; did you mean {', '.join(close)}?" if close else
                                     "") + " (ckptfmt faults --list names them all)", param_hint="--only")
    console = _err()
    total = len(only) if only else len(faults.CATALOGUE)
    with _render.fault_progress(console, quiet=as_json, total=total) as on_outcome:
        table = faults.run_all(names=only or None, workdir=workdir, peers=peers, on_outcome=on_outcome)
    ok = bool(table.all_passed)
    if as_json:
        _emit_json({"ok": ok, **table.to_json()})
    elif markdown:
        sys.stdout.write(faults.to_markdown(table) + "\n")
    else:
        faults.print_table(table, _out())
    _exit_unless(ok)


from ckptfmt_tools.cli import _interop as _interop  # noqa: E402,F401  (registers export and import)
from ckptfmt_tools.cli import _look as _look  # noqa: E402,F401  (registers show and diff)

_runs.register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``ckptfmt`` console script and of ``python -m ckptfmt``. With an ``s3://``
    URL among the arguments, the AWS SDK's log is left out of stderr unless asked
    (:mod:`ckptfmt_tools.cli._quiet`); other runs keep stderr as it is (their child processes
    included)."""
    from ckptfmt_tools.cli._quiet import quiet_aws_log

    args = sys.argv[1:] if argv is None else argv
    if not any("s3://" in a for a in args):
        app(args=argv, prog_name="ckptfmt")
        return
    with quiet_aws_log():
        app(args=argv, prog_name="ckptfmt")
