"""The files an export creates in its output directory OUT, and the model config it copies there.

Rules (docs/INTEROP.md, section 3, "What is written when"):

* Every file is created under its temporary name ``.<name>.partial`` in OUT with
  ``O_CREAT | O_EXCL | O_NOFOLLOW``: a name that already exists (a file, a leftover of an
  interrupted export, or a link planted there) is refused with :class:`OutputExistsError`, never
  truncated, and never followed out of OUT.
* A finished temporary file is published under its final name by :func:`publish`: a hard link,
  which fails when the final name exists (as a file or a link), then the temporary name is
  removed. Where the file system has no hard links, the final name is checked and the file
  renamed (a rename replaces a directory entry; it never writes through a link).
* The model config is checked before anything is written: a JSON object of at most
  :data:`MAX_CONFIG_BYTES`, nested at most :data:`MAX_CONFIG_NESTING` levels, that encodes as JSON.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any, Iterable, Mapping

from ckptfmt.errors import InvalidConfigError, OutputExistsError, StorageError

__all__ = ["temp_name", "create_exclusive", "publish", "check_out_dir", "read_config", "encode_config",
           "CONFIG_NAME", "MAX_CONFIG_BYTES", "MAX_CONFIG_NESTING"]

CONFIG_NAME = "config.json"
#: A model config is a few kB; transformers' largest (label maps) are well under a MiB.
MAX_CONFIG_BYTES = 16 << 20
#: Nesting of arrays and objects in a config: the top-level object is level 1 (as a manifest's).
MAX_CONFIG_NESTING = 64
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV}


def temp_name(name: str) -> str:
    """The temporary name under which ``name`` is written (a dot file in OUT)."""
    return f".{name}.partial"


def _exists(path: str, what: str) -> OutputExistsError:
    try:
        kind = "a link" if stat.S_ISLNK(os.lstat(path).st_mode) else "a file"
    except OSError:
        kind = "an entry"
    return OutputExistsError(f"the export's {what} already exists in the output directory; an export never writes "
                             "over or through an existing name: remove it (a leftover of an interrupted export, "
                             "or not ours) or export into an empty directory", object=path,
                             expected="absent", found=kind)


def create_exclusive(path: str) -> int:
    """A new file at ``path``, opened for writing (the fd). OutputExistsError when the name exists
    (a file or a link: nothing is truncated or followed); StorageError for another OSError."""
    try:
        return os.open(path, _CREATE, 0o644)
    except FileExistsError:
        raise _exists(path, "temporary file") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _exists(path, "temporary file") from None
        raise StorageError("cannot create an export file", object=path, found=str(e)) from None


def publish(tmp: str, final: str) -> None:
    """Give the finished file ``tmp`` its name ``final`` (same directory) without replacing anything:
    OutputExistsError when ``final`` exists, as a file or a link."""
    try:
        os.link(tmp, final, follow_symlinks=False)
    except FileExistsError:
        raise _exists(final, "file") from None
    except OSError as e:
        if e.errno not in _NO_HARD_LINKS:
            raise StorageError("cannot publish an export file", object=final, found=str(e)) from None
        if os.path.lexists(final):
            raise _exists(final, "file") from None
        os.rename(tmp, final)
        return
    os.unlink(tmp)


def check_out_dir(out_dir: str, names: Iterable[str] = ()) -> None:
    """Create ``out_dir`` if needed. OutputExistsError when it already holds safetensors files or an
    index (an export never mixes its files with another's), or any of ``names`` or their temporary
    names (e.g. ``config.json``), as files or links."""
    os.makedirs(out_dir, exist_ok=True)
    held = os.listdir(out_dir)
    clash = sorted(n for n in held if n.endswith(".safetensors") or n.endswith(".safetensors.index.json"))
    if clash:
        raise OutputExistsError(f"the output directory already holds {clash[:3]}{' ...' if len(clash) > 3 else ''}; "
                                "export into an empty directory", object=str(out_dir), expected="no safetensors files",
                                found=clash[:8])
    present = set(held)
    for name in names:
        for n in (name, temp_name(name)):
            if n in present:
                raise _exists(os.path.join(out_dir, n), "file" if n == name else "temporary file")


def _check_nesting(doc: Any, what: str) -> None:
    """InvalidConfigError when ``doc`` nests arrays and objects deeper than MAX_CONFIG_NESTING
    (a value that contains itself nests without end). Iterative: no recursion."""
    stack = [(doc, 1)]
    while stack:
        value, level = stack.pop()
        if level > MAX_CONFIG_NESTING:
            raise InvalidConfigError("the model config nests arrays and objects too deeply (or contains itself)",
                                     object=what, expected=f"<= {MAX_CONFIG_NESTING} levels",
                                     found=f"more than {MAX_CONFIG_NESTING} levels")
        children = value.values() if isinstance(value, Mapping) else value
        for c in children:
            if isinstance(c, (Mapping, list, tuple)):
                stack.append((c, level + 1))


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in the file ``path`` (a model's ``config.json``). InvalidConfigError for a
    file over MAX_CONFIG_BYTES, text that is not JSON (or nests too deeply to parse), nesting over
    MAX_CONFIG_NESTING, or a value that is not an object; OSError when it cannot be read."""
    with open(path, "rb") as fh:
        data = fh.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidConfigError("the model config is too large", object=str(path), expected=f"<= {MAX_CONFIG_BYTES} B",
                                 found=f"more than {MAX_CONFIG_BYTES} B")
    try:
        doc = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise InvalidConfigError("the model config nests arrays and objects too deeply to parse", object=str(path),
                                 expected=f"<= {MAX_CONFIG_NESTING} levels", found="deeper") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise InvalidConfigError("the model config is not JSON", object=str(path), found=str(e)[:200]) from None
    if not isinstance(doc, dict):
        raise InvalidConfigError("a model config is a JSON object", object=str(path), expected="object",
                                 found=type(doc).__name__)
    _check_nesting(doc, str(path))
    return doc


def encode_config(config: Mapping[str, Any]) -> bytes:
    """The bytes of ``config.json`` (indented JSON and a newline). InvalidConfigError, before anything
    is written, for a value that is not a mapping, nests over MAX_CONFIG_NESTING (or contains
    itself), cannot be encoded as strict JSON (NaN and Infinity included), or encodes to more than
    MAX_CONFIG_BYTES."""
    if not isinstance(config, Mapping):
        raise InvalidConfigError("a model config is a mapping (a JSON object)", object=CONFIG_NAME,
                                 expected="a dict", found=type(config).__name__)
    _check_nesting(config, CONFIG_NAME)
    try:
        text = json.dumps(dict(config), indent=2, allow_nan=False) + "\n"  # strict JSON: no NaN/Infinity
        data = text.encode("utf-8")
    except (TypeError, ValueError) as e:  # a non-JSON value or key, a lone surrogate (UnicodeEncodeError)
        raise InvalidConfigError("the model config cannot be written as JSON", object=CONFIG_NAME,
                                 found=str(e)[:200]) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidConfigError("the model config is too large", object=CONFIG_NAME,
                                 expected=f"<= {MAX_CONFIG_BYTES} B", found=f"{len(data)} B")
    return data
