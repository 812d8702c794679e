"""The implementation behind :mod:`bridges.interop` (its face re-exports the public names)."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Mapping as TMapping, Sequence

from ckptfmt.interop import read_config
from ckptfmt.errors import CheckpointError, IncompleteSaveError
from ckptfmt.reader import Checkpoint
from ckptfmt.interop import (DEFAULT_MAX_SHARD_SIZE, ExportPlan, ExportReport, ExportTensor, ImportReport, begin_export,
                             discard_parts, finish_export, import_safetensors, prepare_export, quantization_config,
                             quantized, write_part)

from bridges import presets
from bridges.interop._export_map import (PRESETS, Coverage, export_tensors, mapped_tensors, model_tensors, preset_mapping,
                                         strip_target_prefix)
from bridges.interop._peft import PeftReport, export_peft
from bridges.mapping._mapfile import InvalidMappingError, load_mapping_file, load_names_file, mapping_from_json, mapping_to_json
from bridges.mapping._rules import Mapping

__all__ = ["export", "export_peft", "PeftReport", "import_checkpoint", "import_orbax", "import_dcp", "import_safetensors", "load_mapping",
           "preset_mapping", "IMPORT_FORMATS", "InvalidMappingError", "Coverage", "export_tensors",
           "strip_target_prefix", "mapping_to_json", "mapping_from_json", "mapped_tensors", "PRESETS"]

Progress = Callable[[int, int], None]


def load_mapping(spec: str | Mapping | None, config: Any = None,
                 names: TMapping[str, str] | str | os.PathLike | None = None,
                 preset_args: TMapping[str, Any] | None = None) -> Mapping | None:
    """A mapping from a preset name (:data:`PRESETS`; needs ``config``: a dict, an HF config, or a
    ``config.json`` path; ``names``: the preset's ``names=``, a dict or a JSON file path;
    ``preset_args``: the preset function's other keyword arguments, e.g. ``{"experts":
    "per_expert"}``), a mapping JSON file path, or a Mapping as is. ValueError otherwise (``names``
    or ``preset_args`` without a preset, an argument the preset does not take or rejects, an
    unknown name key); InvalidMappingError / InvalidConfigError (both ValueErrors) for a
    malformed file."""
    for what, given in (("names (--names) fit a preset's name table", names is not None),
                        ("preset arguments (--preset-arg) configure a preset", bool(preset_args))):
        if given and spec not in PRESETS:
            raise ValueError(f"{what}; --mapping {spec!r} is not a preset ({', '.join(PRESETS)})")
    if spec is None or isinstance(spec, Mapping):
        return spec
    if spec in PRESETS:
        if config is None:
            raise ValueError(f"the preset {spec!r} needs the model's config (--config config.json)")
        kw = _preset_kwargs(spec, preset_args or {})
        if names is not None:
            kw["names"] = load_names_file(names) if isinstance(names, (str, os.PathLike)) else dict(names)
        return preset_mapping(spec, read_config(config) if isinstance(config, (str, os.PathLike)) else config, **kw)
    if os.path.isfile(spec):
        return load_mapping_file(spec)
    raise ValueError(f"--mapping {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a mapping file")


_FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def _with_ignore(mapping: Mapping | None, ignore: Sequence[str]) -> Mapping | None:
    if isinstance(ignore, str) or not all(isinstance(g, str) for g in ignore):
        raise ValueError(f"ignore is a list of glob strings, got {ignore!r}")
    if not ignore or mapping is None:  # without a mapping the export leaves the ignored keys out itself
        return mapping
    return Mapping(mapping.rules, mapping.ignore + tuple(ignore), mapping.keep, mapping.source_sep, mapping.target_sep,
                   mapping.tiers)


def _preset_kwargs(spec: str, preset_args: TMapping[str, Any]) -> dict[str, Any]:
    """``preset_args`` checked against the keyword arguments of preset ``spec`` (ValueError naming
    the argument and the ones it takes; ``names`` has its own option); JSON lists become tuples."""
    takes = [p.name for p in inspect.signature(presets.REGISTRY[spec].build).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "names"]
    for key in preset_args:
        if key not in takes:
            raise ValueError(f"--preset-arg {key}: the preset {spec} takes no argument {key!r} (it takes: "
                             f"{', '.join(takes)}; names go in --names)")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in preset_args.items()}


def export(url: str, out_dir: str, *, mapping: Mapping | str | None = None, step: int | None = None,
           dtype: str | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
           config: TMapping[str, Any] | str | os.PathLike | None = None, processes: int = 1,
           allow_partial: bool = False, ignore: Sequence[str] = (),
           progress: Progress | None = None, names: TMapping[str, str] | str | os.PathLike | None = None,
           preset_args: TMapping[str, Any] | None = None, optimizer: bool = False,
           quantize: str | None = None) -> ExportReport:
    """Export step ``step`` (None: latest) of ``url`` as a Hugging Face safetensors directory.

    ``mapping`` (checkpoint keys -> file names and layouts; None: every tensor as is): a Mapping
    (e.g. ``preset_mapping("hf_llama_from_nnx", config)``), a preset name or a mapping file
    (:func:`load_mapping`). Through a mapping the export is complete or refused: every target
    tensor the mapping names for the whole model is written, every checkpoint key is read (but
    those its ``ignore`` globs, or ``ignore``, name), every rule names something; else
    KeyMismatchError, unless ``allow_partial=True`` asks for what fits (the report lists
    ``unmapped`` checkpoint keys and ``unwritten`` targets). ``dtype`` casts floating-point
    tensors (``bfloat16``, ``float16``, ...). ``processes``: writer processes (this one and N-1
    started here), each writing whole files. ``config`` (a dict or a ``config.json`` path)
    becomes ``config.json`` and configures a preset; ``names`` (a dict or a JSON file of name key
    -> path) fits a preset's name table to the model (bridges/MAPPING.md, "Fitting your own
    model"); ``preset_args`` passes the preset's other keyword arguments (``{"experts":
    "per_expert"}``: the hub's one-tensor-per-expert names). ``progress(done, total)``: tensor bytes written by all writers.
    Without a mapping every tensor is written under its own key path but optimizer state (Adam
    moments and counts: no model weights; ``optimizer=True`` keeps them) and the keys ``ignore``
    names; the keys left out are the report's ``unmapped``.
    ``quantize="fp8"``: the Linear weights as block-FP8 codes with their ``*.weight_scale_inv``
    scales and ``quantization_config`` in ``config.json``, the layout serving engines load
    (:func:`ckptfmt.interop.export_safetensors`; bridges/MAPPING.md, "Quantized weights").

    Streaming and verified as :func:`ckptfmt.interop.export_safetensors` (host memory: the reader's
    window and one block per process); files are created and published as it does, never over
    or through an existing name. Fails closed: before any byte is written, MappingError (a rule
    that does not fit), KeyMismatchError (an incomplete export), InvalidMappingError /
    InvalidConfigError (a mapping file or config over its caps or malformed), OutputExistsError
    (``out_dir`` holds safetensors files, an index, ``config.json`` or a temporary name, as files
    or links); later any writer's CheckpointError; then no index is written and no file of this
    export is left.
    """
    t0 = time.perf_counter()
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if isinstance(config, (str, os.PathLike)):
        config = read_config(config)
    mapping = _with_ignore(load_mapping(mapping, config, names, preset_args), ignore)
    dtype = _DTYPE_ALIASES.get(dtype, dtype) if dtype is not None else None
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {', '.join(_FLOAT_DTYPES)} (floating-point tensors are cast)")
    coverage: list[Coverage] = []

    def tensors(ckpt: Checkpoint) -> tuple[list[ExportTensor], list[str]]:
        if mapping is None:
            return model_tensors(ckpt, dtype, ignore=tuple(ignore), optimizer=optimizer)
        outs, unmapped, cov = export_tensors(ckpt, mapping, dtype, allow_partial=allow_partial)
        coverage.append(cov)
        return outs, unmapped

    kept: list[str] = []
    ckpt, plan, unmapped = prepare_export(url, step=step, dtype=dtype, max_shard_size=max_shard_size,
                                          tensors=quantized(tensors, quantize, dtype, kept))
    if quantize is not None:
        config = dict(config or {}, quantization_config=quantization_config(kept))
    begin_export(out_dir, plan, config)
    read = _write_all(ckpt, plan, out_dir, config, processes, progress, {
        "url": str(url), "step": plan.step, "mapping": mapping_to_json(mapping) if mapping is not None else None,
        "dtype": dtype, "max_shard_size": max_shard_size, "out_dir": str(out_dir), "digest": plan.digest,
        "ignore": list(ignore), "optimizer": optimizer, "quantize": quantize})
    return ExportReport(str(out_dir), tuple(f.name for f in plan.files), sum(len(f.tensors) for f in plan.files),
                        plan.nbytes, read, time.perf_counter() - t0, plan.step, plan.save_id, tuple(unmapped),
                        coverage[0].unwritten if coverage else ())


def _write_all(ckpt: Checkpoint, plan: ExportPlan, out_dir: str, config: Any, processes: int, progress: Progress | None,
               spec: dict[str, Any]) -> int:
    """Write every file (this process and N-1 writers), then publish; bytes read by all writers.
    On failure kills the writers, removes every temporary file of the export, and raises."""
    world = min(processes, max(1, len(plan.files)))
    done = [0] * world
    lock = threading.Lock()

    def report(rank: int, n: int) -> None:
        with lock:
            done[rank] = n
            if progress:
                progress(sum(done), plan.nbytes)

    workers = [_Worker(spec, r, world, report) for r in range(1, world)]
    try:
        write_part(ckpt, plan, out_dir, part=(0, world), progress=lambda n, _t: report(0, n))
        errors = [w.wait() for w in workers]
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]
        finish_export(out_dir, plan, config)
    except BaseException:
        for w in workers:
            w.kill()
        # Ours: rank 0's files and those a writer reported written or was writing when killed
        # (a writer that failed removed its own; discard_parts leaves links alone).
        ours = [f.name for i, f in enumerate(plan.files) if i % world == 0 or workers[i % world - 1].owns_files]
        discard_parts(out_dir, ours)
        raise
    return int(ckpt.stats.bytes_read) + sum(int((w.result or {}).get("bytes_read", 0)) for w in workers)


class _Worker:
    """One more writer process: ``python -m bridges.interop._export_worker RANK WORLD`` with the spec on
    stdin; it prints ``{"done": bytes}`` lines, then ``{"ok": [files], "bytes_read": n}`` or
    ``{"error": {...}}``."""

    def __init__(self, spec: dict[str, Any], rank: int, world: int, report: Callable[[int, int], None]) -> None:
        self.rank, self.report, self.result = rank, report, None  # type: ignore[var-annotated]
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a file, so a chatty writer never blocks on a pipe
        self.proc = subprocess.Popen([sys.executable, "-m", "bridges.interop._export_worker", str(rank), str(world)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=env)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec))
        self.proc.stdin.close()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "done" in msg:
                self.report(self.rank, int(msg["done"]))
            else:
                self.result = msg

    def wait(self) -> CheckpointError | None:
        rc = self.proc.wait()
        self.thread.join()
        self.stderr.seek(0)
        err = self.stderr.read()
        self.stderr.close()
        res = self.result or {}
        if rc == 0 and "ok" in res:
            return None
        e = res.get("error")
        if isinstance(e, dict):
            return CheckpointError.from_json(e, prefix=f"export writer {self.rank}: ")
        return IncompleteSaveError(f"export writer {self.rank} failed (exit {rc})", found=(err or str(res))[-800:])

    @property
    def owns_files(self) -> bool:
        """False once the writer reported an error: it then removed the files it created."""
        return not isinstance((self.result or {}).get("error"), dict)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def import_orbax(src: str, url: str, *, step: int | None = None, prefix: str = "",
                 progress: Progress | None = None, max_leaf_bytes: int | None = None,
                 max_tensors: int | None = None) -> ImportReport:
    """Import an Orbax checkpoint (see :func:`bridges.interop._orbax.import_orbax`; ``max_leaf_bytes``
    None: its default cap, ``MAX_LEAF_BYTES``)."""
    from bridges.interop._orbax import import_orbax as run  # needs jax: imported when an import runs

    return run(src, url, step=step, prefix=prefix, progress=progress, max_leaf_bytes=max_leaf_bytes,
               max_tensors=max_tensors)


def import_dcp(src: str, url: str, *, step: int | None = None, prefix: str = "",
               progress: Progress | None = None, max_tensors: int | None = None) -> ImportReport:
    """Import a torch DCP checkpoint; its ``.metadata`` is a pickle: trusted sources only (see
    :func:`bridges.interop._dcp.import_dcp`)."""
    from bridges.interop._dcp import import_dcp as run  # needs torch: imported when an import runs

    return run(src, url, step=step, prefix=prefix, progress=progress, max_tensors=max_tensors)


#: Formats :func:`import_checkpoint` reads.
IMPORT_FORMATS = ("safetensors", "orbax", "dcp")


def import_checkpoint(src: str, url: str, *, source_format: str, step: int | None = None, prefix: str = "",
                      trust_pickle: bool = False, progress: Progress | None = None,
                      max_leaf_bytes: int | None = None, max_tensors: int | None = None) -> ImportReport:
    """The ``ckptfmt import`` verb: ``src`` in ``source_format`` (:data:`IMPORT_FORMATS`) -> one
    committed step of ``url``. ``max_leaf_bytes``: Orbax only, the largest leaf to import. DCP needs ``trust_pickle=True`` (its metadata is a pickle: trusted
    sources only). ValueError for an unknown format or a DCP import without that consent; otherwise
    fails closed as the format's importer does."""
    if source_format == "safetensors":
        return import_safetensors(src, url, step=step, prefix=prefix, progress=progress, max_tensors=max_tensors)
    if source_format == "orbax":
        return import_orbax(src, url, step=step, prefix=prefix, progress=progress, max_leaf_bytes=max_leaf_bytes,
                            max_tensors=max_tensors)
    if source_format == "dcp":
        if not trust_pickle:
            raise ValueError("a DCP checkpoint's .metadata is a Python pickle: loading it runs code from the file. "
                             "Import only a checkpoint you trust, and say so with --trust-pickle.")
        return import_dcp(src, url, step=step, prefix=prefix, progress=progress, max_tensors=max_tensors)
    raise ValueError(f"unknown source format {source_format!r}; one of {', '.join(IMPORT_FORMATS)}")
