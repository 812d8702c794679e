"""Repository options (ckptfmt.storage._options.StorageOptions, issue 47 item 11): one typed, frozen
value, built where options enter (``Repository``, ``open_storage``). A misspelt or unknown key is
refused with the closest valid name, a bad value is refused, and every option the code reads is a
field (no free-form ``options.get("...")`` is left). Every refusal has its control: the correct
key or value is accepted and takes effect."""
from __future__ import annotations

import ast
import dataclasses
import threading
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable

import numpy as np
import pytest

from ckptfmt import Box, CheckpointError, InvalidOptionError, LocalShard, Repository, SaveOptions, StorageOptions, save
from ckptfmt.storage import DelegatingStorage, open_storage

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ unknown keys
@pytest.mark.parametrize("given,meant", [("read_thread", "read_threads"), ("writ_threads", "write_threads"),
                                         ("positional_read", "positional_reads"), ("fsycn", "fsync"),
                                         ("read_window", "read_window_bytes"), ("kv_store", "kvstore")])
def test_a_misspelt_option_is_refused_with_the_closest_name(tmp_path, given, meant):
    """The misspelt key raises InvalidOptionError (a CheckpointError and a ValueError) naming the
    key, the repository, every valid option and the closest one, before anything is opened or
    created. Control: the correctly spelt key is accepted."""
    url = str(tmp_path / "r")
    value = {"kvstore": {}}.get(meant, 4 if "thread" in meant or "window" in meant else True)
    with pytest.raises(InvalidOptionError) as e:
        Repository(url, options={given: value})
    err = e.value
    assert isinstance(err, CheckpointError) and isinstance(err, ValueError)
    assert f"did you mean {meant!r}?" in err.message and repr(given) in err.message
    assert all(name in err.message for name in StorageOptions.names())
    assert err.object == url and err.found == repr(given)
    assert not (tmp_path / "r").exists()  # refused before the store was opened
    # Control: the spelling it suggests is accepted, and the option is set.
    assert getattr(Repository(url, options={meant: value}).storage.options, meant) == value


def test_an_unknown_option_far_from_every_name_is_refused_without_a_guess(tmp_path):
    with pytest.raises(InvalidOptionError) as e:
        open_storage(str(tmp_path / "r"), {"zzzzzzzz": 1})
    assert "did you mean" not in e.value.message and "'zzzzzzzz'" in e.value.message
    open_storage(str(tmp_path / "r"), {})  # control: no option is fine


def test_options_that_are_no_mapping_are_refused(tmp_path):
    with pytest.raises(InvalidOptionError, match="StorageOptions or a mapping"):
        Repository(str(tmp_path), options=[("read_threads", 4)])  # type: ignore[arg-type]
    Repository(str(tmp_path), options=StorageOptions(read_threads=4))  # control: the typed value


class _Threads(DelegatingStorage):
    """Records the thread each shard object is written on (write_object is called on the writer threads)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.names: set[str] = set()
        self._lock = threading.Lock()

    def write_object(self, key: str, buffers: Iterable[Any], *, tensor: str | None = None) -> int:
        with self._lock:
            self.names.add(threading.current_thread().name)
        time.sleep(0.005)  # hold the thread, so that a pool of several really spreads the objects
        return super().write_object(key, buffers, tensor=tensor)

    def open_pack(self, key: str) -> Any:
        """A pack's shards are written by ``write_at`` on the writer threads (FORMAT.md 5.15)."""
        inner, outer = super().open_pack(key), self

        class _Recorded:
            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            def write_at(self, offset: int, buffers: Iterable[Any], *, tensor: str | None = None) -> int:
                with outer._lock:
                    outer.names.add(threading.current_thread().name)
                time.sleep(0.005)
                return inner.write_at(offset, buffers, tensor=tensor)

        return _Recorded()


def _writer_threads(tmp_path: Path, name: str, options: dict[str, Any]) -> set[str]:
    url = str(tmp_path / name)
    store = _Threads(open_storage(url, options))
    x = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    save(Repository(url, storage=store), 1, [LocalShard("x", x.shape, x.dtype, Box((r, 0), (1, 64)), x[r:r + 1])
                                             for r in range(32)], options=SaveOptions(chunk_target_bytes=256))
    assert np.array_equal(Repository(url).open(1).read("x"), x)
    return {n for n in store.names if n.startswith("ckptfmt-write")}


def test_write_threads_takes_effect_and_its_misspelling_is_refused(tmp_path):
    """``writ_threads=1`` was accepted and ignored (16 writer threads ran): now refused. Control:
    ``write_threads=1`` writes every shard object on one thread, ``write_threads=4`` on several
    (so the observation can tell them apart)."""
    with pytest.raises(InvalidOptionError, match="did you mean 'write_threads'"):
        open_storage(str(tmp_path / "typo"), {"writ_threads": 1})
    assert len(_writer_threads(tmp_path, "one", {"write_threads": 1})) == 1
    assert len(_writer_threads(tmp_path, "four", {"write_threads": 4})) > 1


def test_read_options_take_effect(tmp_path):
    """The reader reads the typed fields: the window a checkpoint opens with and the positional
    path. Control: the defaults differ from what is set."""
    url = str(tmp_path / "r")
    x = np.ones((4, 4), np.float32)
    save(url, 1, [LocalShard("x", x.shape, x.dtype, Box.full(x.shape), x)])
    default = Repository(url)
    assert default.open(1).max_inflight_bytes == StorageOptions().read_window_bytes and default.storage.positional_reads
    tuned = Repository(url, options={"read_window_bytes": 2048, "positional_reads": False})
    assert tuned.open(1).max_inflight_bytes == 2048 and not tuned.storage.positional_reads
    assert np.array_equal(tuned.open(1).read("x"), x)


# ------------------------------------------------------------------ bad values
@pytest.mark.parametrize("name,bad,good", [
    ("write_threads", -1, 1), ("write_threads", 0, np.int64(3)), ("write_threads", True, 2), ("write_threads", "4", 4),
    ("read_threads", 2.0, 2), ("read_window_bytes", 0, 1 << 20), ("io_concurrency", None, 4),
    ("copy_concurrency", -8, 8), ("positional_reads", "no", False), ("fsync", 1, np.bool_(False)),
    ("mapped_reads", None, True), ("sync_mode", "fdatasync", "fsync"), ("kvstore", "http://x", {"endpoint": "http://x"}),
])
def test_a_bad_value_is_refused(tmp_path, name, bad, good):
    """A negative or zero count, a bool for a count, a string for a count or a flag, an unknown
    sync_mode, a kvstore that is no mapping: InvalidOptionError naming the option, from the typed
    value and from a Repository's mapping alike. Control: a good value of the same option is
    accepted and stored as its plain type."""
    with pytest.raises(InvalidOptionError) as e:
        StorageOptions(**{name: bad})
    assert repr(name) in e.value.message
    with pytest.raises(InvalidOptionError, match=name) as e:
        Repository(str(tmp_path / "r"), options={name: bad})
    assert e.value.object == str(tmp_path / "r")
    got = getattr(StorageOptions(**{name: good}), name)
    assert got == good and type(got) in (int, bool, str, MappingProxyType)


# ------------------------------------------------------------------ frozen, and the caller's dict is theirs
def test_options_are_frozen_and_never_change_the_callers_mapping(tmp_path):
    creds = {"type": "anonymous"}
    given = {"write_threads": 2, "kvstore": {"credentials": creds}}
    opts = StorageOptions.of(given)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.write_threads = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        opts.kvstore["endpoint"] = "http://x"  # type: ignore[index]
    with pytest.raises(InvalidOptionError):  # replace() checks too
        dataclasses.replace(opts, write_threads=0)
    given["kvstore"]["credentials"]["type"] = "environment"  # the caller changes theirs later
    assert opts.kvstore == {"credentials": {"type": "anonymous"}}
    assert given == {"write_threads": 2, "kvstore": {"credentials": {"type": "environment"}}}
    # Control: the typed value is passed through as is, and replace() with a good value works.
    assert StorageOptions.of(opts) is opts and dataclasses.replace(opts, write_threads=8).write_threads == 8
    local = dataclasses.replace(opts, kvstore=None)  # a local store takes no S3 credentials
    assert Repository(str(tmp_path), options=local).storage.options is local


def test_the_removed_option_warns_and_is_not_a_field(tmp_path):
    """``vectored_writes`` (gone in revision 1.2.2) still warns and is ignored, and is no field."""
    with pytest.warns(DeprecationWarning, match="vectored_writes"):
        assert open_storage(str(tmp_path), {"vectored_writes": False}).options == StorageOptions()
    assert "vectored_writes" not in StorageOptions.names()


# ------------------------------------------------------------------ every option read is a field
_PACKAGES = ("ckptfmt", "bridges", "ckptfmt_tools")


def _is_options(node: ast.AST) -> bool:
    """``options``, ``opts``, or ``<anything>.options``: the names the repository options go by."""
    return (isinstance(node, ast.Name) and node.id in ("options", "opts")) or \
        (isinstance(node, ast.Attribute) and node.attr == "options")


def free_form_reads(source: str) -> list[str]:
    """Each ``options.get("k")``, ``options["k"]``, ``"k" in options`` with a string literal key,
    and each ``<x>.storage.options.k`` / ``st.options.k`` attribute that is no StorageOptions field."""
    out: list[str] = []
    fields = set(StorageOptions.names())
    for node in ast.walk(ast.parse(source)):
        lit = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and _is_options(node.func.value) and node.args and isinstance(node.args[0], ast.Constant):
            lit = node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_options(node.value) \
                and isinstance(node.slice, ast.Constant):
            lit = node.slice.value
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and \
                any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(_is_options(c) for c in node.comparators):
            lit = node.left.value
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "options" \
                and (isinstance(node.value.value, ast.Attribute) and node.value.value.attr == "storage"
                     or isinstance(node.value.value, ast.Name) and node.value.value.id in ("storage", "st")) \
                and node.attr not in fields | {"get"}:  # a .get call is reported as a call
            out.append(f"line {node.lineno}: storage options have no field {node.attr!r}")
        if isinstance(lit, str):
            out.append(f"line {node.lineno}: free-form option {lit!r}")
    return sorted(out, key=lambda s: int(s.split(":")[0].split()[1]))


def test_no_free_form_option_is_read_anywhere():
    """No module of the library, the bridges or the tools reads a repository option by a string
    key: each is a typed field, with its default in one place. Control: the reads this change
    removed (and a storage attribute that is no field) are reported."""
    found = [f"{p.relative_to(ROOT)} {line}" for pkg in _PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
             for line in free_form_reads(p.read_text())]
    assert found == []
    old = '''
def f(self, storage, st, options, opts):
    a = int(self.storage.options.get("read_window_bytes", 1))
    b = storage.options.get("mapped_reads")
    c = opts.get("kvstore")
    d = options["sync_mode"]
    if "vectored_writes" in options:
        pass
    e = st.options.read_thread
    ok = st.options.read_threads, self.options.timeout_s, other.get("x")
'''
    assert free_form_reads(old) == ["line 3: free-form option 'read_window_bytes'", "line 4: free-form option 'mapped_reads'",
                                    "line 5: free-form option 'kvstore'", "line 6: free-form option 'sync_mode'",
                                    "line 7: free-form option 'vectored_writes'",
                                    "line 9: storage options have no field 'read_thread'"]


def test_every_field_is_typed_and_documented():
    """Each field has a type, a default and a ``#:`` line saying what it does (the API reference
    renders it). Control: the parser sees the fields (the count matches the dataclass)."""
    src = (ROOT / "ckptfmt" / "storage" / "_options.py").read_text()
    lines = src.splitlines()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "StorageOptions")
    anns = [n for n in cls.body if isinstance(n, ast.AnnAssign)]
    assert [a.target.id for a in anns] == list(StorageOptions.names())  # type: ignore[attr-defined]
    undocumented = [a.target.id for a in anns if not lines[a.lineno - 2].strip().startswith("#:")]  # type: ignore[attr-defined]
    assert undocumented == [] and all(a.value is not None for a in anns)
