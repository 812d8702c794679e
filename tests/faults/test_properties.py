"""Property tests: the manifest parser and the msgpack state loader accept or raise a
CheckpointError subclass, for any input, within a deadline and bounded memory.

Broken controls: the same properties, run against a parser and a loader whose error
translation was taken away (what a plain ``json.loads`` / ``msgpack.unpackb`` does), must find
a counterexample.
"""
from __future__ import annotations

import functools
import json
import tempfile
import tracemalloc
from typing import Any, Callable

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfmt.errors import CheckpointError
from ckptfmt.manifest import parse_manifest
from ckptfmt.state import decode_state, encode_state

SETTINGS = settings(max_examples=250, deadline=2000, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CONTROL = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.lru_cache(maxsize=1)
def valid_manifest() -> bytes:
    """The manifest of a real two-tensor save (made once, on local disk)."""
    from ckptfmt_tools.faults import _data
    from ckptfmt_tools.faults._procs import start_writers, wait_writers

    root = tempfile.mkdtemp(prefix="ckptfmt-prop-")
    run = wait_writers(start_writers(root, [5], 2, 3), 60)
    assert all(r["ok"] for r in run.results) and len(run.results) == 2, run.results
    with open(f"{root}/manifests/{5:020d}.json", "rb") as f:
        data = f.read()
    assert _data.TENSORS  # the state is the fixture's
    return data


def valid_state() -> bytes:
    from ckptfmt_tools.faults import _data

    return encode_state(_data.global_state(3, 5))


# ------------------------------------------------------------------------- strategies

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                      st.sampled_from(["../x", "/etc/passwd", "s3://b/k", "c/0/0", "raw", "float32", "", "."]))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                              st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated_manifest(draw) -> bytes:
    """A real manifest with 1-3 structural edits (replace, delete, duplicate), then maybe byte edits."""
    doc = json.loads(valid_manifest())
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        path = draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["replace", "delete", "duplicate"]))
        if op == "replace":
            parent[path[-1]] = draw(json_value)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, list):
            parent.append(parent[path[-1]])
        else:
            parent[path[-1] + "_"] = parent[path[-1]] if isinstance(path[-1], str) else None
    data = bytearray(json.dumps(doc, allow_nan=True).encode())
    for _ in range(draw(st.integers(0, 2))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


msgpack_obj = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 64), max_value=(1 << 64) - 1),
              st.floats(), st.text(max_size=10), st.binary(max_size=16),
              st.builds(msgpack.ExtType, st.integers(-128, 127), st.binary(max_size=24))),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.text(max_size=6), st.integers(), st.binary(max_size=4)),
                                            inner, max_size=4)),
    max_leaves=16)

hostile_headers = st.sampled_from([
    b"\xdd\xff\xff\xff\xff",              # array32 claiming 4 billion items
    b"\xdf\xff\xff\xff\xff",              # map32 claiming 4 billion pairs
    b"\xc6\xff\xff\xff\xff",              # bin32 claiming 4 GiB
    b"\xdb\xff\xff\xff\xff",              # str32 claiming 4 GiB
    b"\xc9\xff\xff\xff\xff\x02",          # ext32 (ndarray) claiming 4 GiB
    b"\x91" * 5000 + b"\xc0",             # 5000-deep nesting
])


@st.composite
def state_bytes(draw) -> bytes:
    kind = draw(st.sampled_from(["random", "structured", "mutated", "hostile"]))
    if kind == "random":
        return draw(st.binary(max_size=512))
    if kind == "structured":
        try:
            return msgpack.packb(draw(msgpack_obj), use_bin_type=True)
        except (OverflowError, TypeError, ValueError):
            return b"\xc1"
    if kind == "hostile":
        return draw(hostile_headers) + draw(st.binary(max_size=32))
    data = bytearray(valid_state())
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))] if draw(st.booleans()) else data)


# --------------------------------------------------------------------------- properties


def only_checkpoint_errors(parse: Callable[[bytes], Any], data: bytes) -> None:
    try:
        parse(data)
    except CheckpointError:
        pass


def bounded_memory(parse: Callable[[bytes], Any], data: bytes, limit: int) -> None:
    tracemalloc.start()
    try:
        only_checkpoint_errors(parse, data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= limit, f"peak {peak} bytes for {len(data)} input bytes"


def test_the_strategies_start_from_valid_inputs():
    assert parse_manifest(valid_manifest()).step == 5
    assert decode_state(valid_state())["step"] == 5


@SETTINGS
@given(st.binary(max_size=2048))
def test_manifest_parser_arbitrary_bytes(data):
    only_checkpoint_errors(parse_manifest, data)


@SETTINGS
@given(mutated_manifest())
def test_manifest_parser_mutated_manifests(data):
    only_checkpoint_errors(parse_manifest, data)


@SETTINGS
@given(st.one_of(json_value.map(lambda v: json.dumps(v).encode()),
                 st.binary(max_size=64).map(lambda b: b"[" * 100_000 + b)))
def test_manifest_parser_arbitrary_json_and_deep_nesting(data):
    only_checkpoint_errors(parse_manifest, data)


@SETTINGS
@given(state_bytes())
def test_state_loader_only_raises_invalid_state(data):
    only_checkpoint_errors(decode_state, data)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(state_bytes())
def test_state_loader_memory_is_bounded(data):
    bounded_memory(decode_state, data, 64 * len(data) + (4 << 20))


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_manifest())
def test_manifest_parser_memory_is_bounded(data):
    bounded_memory(parse_manifest, data, 200 * len(data) + (4 << 20))


# ------------------------------------------------------------------------ broken controls


def _weak_manifest_parser(data: bytes) -> Any:
    """The parser without its error translation: json and validation errors escape untyped."""
    from ckptfmt.manifest import _from_doc

    return _from_doc(json.loads(data))


def _weak_state_loader(data: bytes) -> Any:
    from ckptfmt.state import _ext_hook

    return msgpack.unpackb(data, raw=False, ext_hook=_ext_hook)


def test_control_weak_manifest_parser_is_caught():
    @CONTROL
    @given(mutated_manifest())
    def prop(data):
        only_checkpoint_errors(_weak_manifest_parser, data)

    with pytest.raises(Exception) as info:
        prop()
    assert not isinstance(info.value, CheckpointError)


def test_control_weak_state_loader_is_caught():
    @CONTROL
    @given(state_bytes())
    def prop(data):
        only_checkpoint_errors(_weak_state_loader, data)

    with pytest.raises(Exception) as info:
        prop()
    assert not isinstance(info.value, CheckpointError)
