"""``ckptfmt export`` and ``ckptfmt import`` (typer glue only; the work is in ``bridges.interop``
and ``ckptfmt.interop``). Registered on the app by importing this module.

Exit codes as every command: 0 success; 1 a CheckpointError (printed, or the JSON document with
``"ok": false`` under ``--json``: an incomplete export, an output name that exists, a mapping file
or config over its caps, ...); 2 usage (a bad option, an unknown preset, a preset without
``--config``, a ``--preset-arg`` the preset does not take, a DCP import without ``--trust-pickle``).
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, Callable, Iterator, List, Optional, Sequence

import typer
from typer.core import TyperCommand

from ckptfmt_tools.cli import JsonOpt, _emit_json, _err, _fail, _out, _render, _repo, app

__all__ = ["export_cmd", "import_cmd", "zarr_refs_cmd"]

#: Where an option's help names the presets; filled in by :class:`_PresetsHelp`.
PRESET_NAMES = "<presets>"


class _PresetsHelp(TyperCommand):
    """Names the presets (``bridges.interop.PRESETS``, from the one registry) in the help when the
    help is shown: importing them when the command line starts would load numpy for every command."""

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:  # typer vendors click (0.29 declares no click)
        from bridges.interop import PRESETS

        for param in self.params:
            text = getattr(param, "help", None)
            if text and PRESET_NAMES in text:
                param.help = text.replace(PRESET_NAMES, ", ".join(PRESETS))  # type: ignore[attr-defined]
        super().format_help(ctx, formatter)


@contextlib.contextmanager
def _bar(label: str, quiet: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar (bytes, speed, time left) on stderr, or nothing when quiet."""
    if quiet:
        yield None
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress, TaskProgressColumn, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)
    with Progress(TextColumn(_render.safe(label)), BarColumn(), TaskProgressColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=_err(), transient=False) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"


def _preset_args(items: Sequence[str]) -> dict[str, Any]:
    """``--preset-arg KEY=VALUE`` options as keyword arguments: VALUE parsed as JSON (numbers,
    true/false, lists), else kept as a string. BadParameter (exit 2) for an item without ``=``, a
    KEY that is not an identifier, or a KEY given twice."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise typer.BadParameter(f"--preset-arg {item!r}: expected KEY=VALUE (e.g. experts=per_expert)")
        if key in out:
            raise typer.BadParameter(f"--preset-arg {key}: given twice")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


@app.command("export", cls=_PresetsHelp)
def export_cmd(url: str = typer.Argument(..., help="Repository URL or path."),
               out_dir: str = typer.Argument(..., help="Directory to write (created; must hold no safetensors files)."),
               fmt: str = typer.Option("safetensors", "--format", help="Output format (safetensors)."),
               step: Optional[int] = typer.Option(None, "--step", "-s", help="Step (default: latest)."),
               mapping: Optional[str] = typer.Option(None, "--mapping", help=f"A preset ({PRESET_NAMES}; needs "
                                                     "--config) or a mapping JSON file. Default: every model tensor as "
                                                     "it is (optimizer state only with --optimizer)."),
               dtype: Optional[str] = typer.Option(None, "--dtype", help="Cast floating-point tensors "
                                                   "(bfloat16, float16, float32)."),
               max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest file (5GB, 500MiB, ...)."),
               config: Optional[str] = typer.Option(None, "--config", help="The model's config.json: configures "
                                                    "a preset and is copied into OUT_DIR."),
               processes: int = typer.Option(1, "--processes", min=1, help="Writer processes (disjoint files)."),
               allow_partial: bool = typer.Option(False, "--allow-partial", help="Write what the mapping fits even "
                                                  "if target tensors are left unwritten or checkpoint keys unread "
                                                  "(default: refuse, writing nothing)."),
               ignore: Optional[List[str]] = typer.Option(None, "--ignore", help="Checkpoint keys to leave out on "
                                                          "purpose (a glob, * crosses /; repeatable)."),
               optimizer: bool = typer.Option(False, "--optimizer", help="Without --mapping: also write optimizer "
                                              "state (Adam moments, counts), which is left out by default."),
               names: Optional[str] = typer.Option(None, "--names", help="A JSON object of name key -> path that "
                                                   "fits a preset's name table to your model (needs a preset "
                                                   "--mapping; bridges/MAPPING.md, 'Fitting your own model')."),
               preset_arg: Optional[List[str]] = typer.Option(None, "--preset-arg", help="KEY=VALUE: a keyword "
                                                              "argument of the preset (repeatable; VALUE is JSON, "
                                                              "else a string), e.g. experts=per_expert, "
                                                              "rope=interleaved, scan_axis=0."),
               quantize: Optional[str] = typer.Option(None, "--quantize", help="fp8: the Linear weights as "
                                                      "block-FP8 codes with their weight_scale_inv and "
                                                      "quantization_config in config.json (bridges/MAPPING.md 3.7)."),
               as_json: bool = JsonOpt) -> None:
    """Export a step as Hugging Face safetensors files (+ index), loadable by from_pretrained.
    Through a mapping it is complete or refused (--allow-partial to write what fits)."""
    from ckptfmt.errors import CheckpointError

    if fmt != "safetensors":
        raise typer.BadParameter(f"--format {fmt!r}: only 'safetensors' is written")
    from bridges.interop import export

    try:
        _repo(url)  # NotARepositoryError before OUT_DIR is touched
        with _bar(f"export {url}", quiet=as_json) as progress:
            report = export(url, out_dir, mapping=mapping, step=step, dtype=dtype, max_shard_size=max_shard_size,
                            config=config, processes=processes, allow_partial=allow_partial,
                            ignore=tuple(ignore or ()), progress=progress, names=names,
                            preset_args=_preset_args(preset_arg or ()), optimizer=optimizer, quantize=quantize)
    except CheckpointError as exc:
        raise _fail(exc, as_json)
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc))
    doc = _render.plain(report)
    if as_json:
        _emit_json({"ok": True, "url": url, "report": doc})
        return
    out = _out()
    out.print(f"exported step {report.step} of {_render.safe(url)}: {report.tensors} tensors, {_size(report.nbytes)} "
              f"in {len(report.files)} files, {_render.safe(out_dir)} ({report.seconds:.1f} s); every byte read "
              f"({_size(report.bytes_read)}) verified against the manifest")
    if report.unmapped:
        shown = ", ".join(_render.safe(k) for k in report.unmapped[:8])
        more = f" and {len(report.unmapped) - 8} more" if len(report.unmapped) > 8 else ""
        why = ("no mapping rule reads them" if mapping is not None else
               "optimizer state or --ignore; --optimizer writes the optimizer state too")
        out.print(f"[yellow]not exported ({why}):[/] {shown}{more}")
    if report.unwritten:
        shown = ", ".join(_render.safe(k) for k in report.unwritten[:8])
        more = f" and {len(report.unwritten) - 8} more" if len(report.unwritten) > 8 else ""
        out.print(f"[yellow]partial export (--allow-partial): target tensors not written:[/] {shown}{more}")


@app.command("import")
def import_cmd(src: str = typer.Argument(..., help="Source: a safetensors file or directory, an Orbax "
                                         "checkpoint directory, or a DCP directory."),
               url: str = typer.Argument(..., help="Repository URL or path to write the step into."),
               source_format: str = typer.Option(..., "--from", help="safetensors, orbax or dcp."),
               step: Optional[int] = typer.Option(None, "--step", "-s", help="Step to write (default: the step an "
                                                  "export of ours recorded, else 0; Orbax: also the "
                                                  "CheckpointManager step directory to read)."),
               prefix: str = typer.Option("", "--prefix", help="Put every key path under this prefix (e.g. model/)."),
               trust_pickle: bool = typer.Option(False, "--trust-pickle", help="DCP only: I trust this source "
                                                 "(its .metadata is a pickle, which runs code when loaded)."),
               max_leaf_bytes: Optional[int] = typer.Option(None, "--max-leaf-bytes", help="Orbax only: the "
                                                            "largest leaf to import, in bytes (default 512 MiB: "
                                                            "Orbax restores a leaf whole, in host memory)."),
               max_tensors: Optional[int] = typer.Option(None, "--max-tensors", help="The most tensors to import "
                                                         "(default 131,072; each costs the save memory and time)."),
               as_json: bool = JsonOpt) -> None:
    """Import a safetensors, Orbax or DCP checkpoint as one committed step, with its provenance."""
    from ckptfmt.errors import CheckpointError, StepAlreadyCommittedError

    from bridges.interop import IMPORT_FORMATS, import_checkpoint

    if source_format not in IMPORT_FORMATS:
        raise typer.BadParameter(f"--from {source_format!r}: one of {', '.join(IMPORT_FORMATS)}")
    if source_format == "dcp":
        _err().print("[yellow]DCP's .metadata is a Python pickle: loading it runs code from the file. "
                     "Import only a checkpoint whose origin you trust.[/]")
    try:
        with _bar(f"import {source_format}", quiet=as_json) as progress:
            report = import_checkpoint(src, url, source_format=source_format, step=step, prefix=prefix,
                                       trust_pickle=trust_pickle, progress=progress, max_leaf_bytes=max_leaf_bytes,
                                       max_tensors=max_tensors)
    except StepAlreadyCommittedError as exc:
        newest = _repo(url, recognise=False).latest()
        raise _fail(StepAlreadyCommittedError(
            f"{exc.message}; pass --step with a step not committed yet (the newest is {newest}: --step "
            f"{(newest or 0) + 1})", object=exc.object, expected=exc.expected, found=exc.found), as_json)
    except CheckpointError as exc:
        raise _fail(exc, as_json)
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc))
    doc: Any = _render.plain(report)
    if as_json:
        _emit_json({"ok": True, "src": src, "report": doc})
        return
    out = _out()
    out.print(f"imported {report.tensors} tensors ({_size(report.nbytes)}) from {source_format} "
              f"{_render.safe(src)} as step {report.step} of {_render.safe(url)} ({report.seconds:.1f} s)")
    out.print(f"source checksums: {_render.safe(report.provenance.get('source_checksums', 'n/a'))}")
    skipped = report.provenance.get("skipped_non_tensors") or []
    if skipped:
        out.print(f"[yellow]not imported (non-tensor DCP entries):[/] {', '.join(_render.safe(k) for k in skipped[:8])}")


@app.command("zarr-refs")
def zarr_refs_cmd(url: str = typer.Argument(..., help="Repository URL or path."),
                  step: Optional[int] = typer.Option(None, "--step", "-s", help="Step (default: latest)."),
                  output: Optional[str] = typer.Option(None, "--output", "-o",
                                                       help="Write the map to this file (default: stdout).")) -> None:
    """Print a step's reference map (FORMAT.md 14.4): every array of the step as a zarr v3 array
    for fsspec's ReferenceFileSystem, packed or not. Verify the step first (``ckptfmt verify``):
    zarr, not the manifest, then decides what is present."""
    from ckptfmt.interop import zarr_references

    try:
        repo = _repo(url)
        m = repo.manifest(step if step is not None else repo.latest())
        text = json.dumps(zarr_references(m, url), sort_keys=True)
    except Exception as e:  # noqa: BLE001 (a CheckpointError, reported as every command does)
        raise _fail(e, False) from None
    if output:
        with open(output, "x", encoding="utf-8") as f:
            f.write(text + "\n")
        _err().print(f"wrote {output}: {len(m.tensors)} arrays of step {m.step}")
    else:
        typer.echo(text)
