"""Non-tensor state: round trips, the type allow-list, and a decoder that fails closed."""

from __future__ import annotations

import copy
import os
import pickle
import random
from pathlib import Path
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfmt.errors import InvalidStateError, ReferenceCycleError
from ckptfmt.state import EXT_BIGINT, EXT_NDARRAY, EXT_NPSCALAR, MAX_DEPTH, decode_state, encode_state


def roundtrip(obj: Any) -> Any:
    return decode_state(encode_state(obj))


def ndarray_ext(dtype: str, shape: Any, raw: bytes, code: int = EXT_NDARRAY) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, msgpack.packb([dtype, shape, raw], use_bin_type=True)),
                         use_bin_type=True)


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("value", [
    0, -1, 2**63 - 1, -(2**63), 2**63, 2**64, -(2**63) - 1, 2**200, -(2**1000) + 7, 255, -128, -129,
])
def test_ints_of_any_size(value: int) -> None:
    assert roundtrip(value) == value and type(roundtrip(value)) is int


def test_ints_outside_int64_use_the_bigint_extension() -> None:
    assert msgpack.unpackb(encode_state(2**63)) == msgpack.ExtType(EXT_BIGINT, b"\x00\x80" + b"\x00" * 7)
    low = msgpack.ExtType(EXT_BIGINT, b"\xff\x7f" + b"\xff" * 7)
    assert msgpack.unpackb(encode_state(-(2**63) - 1)) == low
    assert msgpack.unpackb(encode_state(2**63 - 1)) == 2**63 - 1  # plain msgpack inside int64


@pytest.mark.parametrize("value", [2**63, 2**63 + 1, 2**64 - 1])
def test_ints_from_2_63_to_2_64_have_two_encodings(value: int) -> None:
    """FORMAT.md 7.2 (issue 24): an int in [2^63, 2^64) is a msgpack uint 64 or an ext 1; readers
    accept both as the same int, and ckptfmt writes ext 1. Everywhere else one encoding only."""
    plain = msgpack.packb(value)
    assert plain[0] == 0xCF  # msgpack's uint 64, as any msgpack writer packs it
    ours = encode_state(value)
    assert msgpack.unpackb(ours) == msgpack.ExtType(EXT_BIGINT, value.to_bytes(9, "big", signed=True))
    assert decode_state(plain) == decode_state(ours) == value
    # Control: below 2^63 and from 2^64 on there is one encoding (ext 1 of 2^63 - 1 is refused,
    # and msgpack has no plain int for 2^64).
    with pytest.raises(InvalidStateError, match="fits in int64"):
        decode_state(msgpack.packb(msgpack.ExtType(EXT_BIGINT, (2**63 - 1).to_bytes(8, "big", signed=True))))
    with pytest.raises(OverflowError):
        msgpack.packb(2**64)


def test_nested_plain_values() -> None:
    state = {"step": 7, "lr": 3e-4, "name": "run-α", "blob": b"\x00\xff", "done": False,
             "none": None, "nested": {"a": [1, [2, {"b": [None, 1.5]}]]}, "t": (1, (2, 3))}
    expected = dict(state, t=[1, [2, 3]])  # tuples come back as lists
    assert roundtrip(state) == expected


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int32", "uint64", "float16", "float32",
                                   "float64", "complex64", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_numpy_arrays(dtype: str) -> None:
    dt = np.dtype(getattr(ml_dtypes, dtype, dtype))
    array = (np.arange(24) % 2).astype(dt).reshape(2, 3, 4)
    out = roundtrip({"a": array, "f": np.asfortranarray(array), "empty": np.zeros((0, 5), dt)})
    for key in ("a", "f"):
        assert out[key].dtype == dt and out[key].shape == (2, 3, 4)
        assert out[key].tobytes() == array.tobytes()
        assert out[key].flags.writeable
    assert out["empty"].shape == (0, 5) and out["empty"].dtype == dt


def test_big_endian_arrays_come_back_native() -> None:
    array = np.arange(5, dtype=">i4")
    out = roundtrip(array)
    assert out.dtype == np.dtype("int32") and out.tolist() == [0, 1, 2, 3, 4]


def test_numpy_scalars_keep_their_type() -> None:
    out = roundtrip({"f": np.float32(1.5), "i": np.int64(-3), "b": np.bool_(True),
                     "h": ml_dtypes.bfloat16(2.5), "s": np.str_("text")})
    assert type(out["f"]) is np.float32 and out["f"] == 1.5
    assert type(out["i"]) is np.int64 and out["i"] == -3
    assert type(out["b"]) is np.bool_ and out["b"]
    assert out["h"].dtype == np.dtype(ml_dtypes.bfloat16) and float(out["h"]) == 2.5
    assert out["s"] == "text" and type(out["s"]) is str


def test_numpy_generator_state_with_128_bit_ints() -> None:
    rng = np.random.default_rng(1234)
    rng.random(3)
    state = rng.bit_generator.state
    assert state["state"]["state"] > 2**64  # really a 128-bit int
    restored = np.random.default_rng()
    restored.bit_generator.state = roundtrip({"rng": {"numpy": state}})["rng"]["numpy"]
    assert restored.random(4).tolist() == rng.random(4).tolist()


def test_python_random_state_converted_to_lists() -> None:
    gen = random.Random(99)
    gen.random()
    decoded = roundtrip(gen.getstate())
    version, internal, gauss = decoded
    restored = random.Random()
    restored.setstate((version, tuple(internal), gauss))
    assert [restored.random() for _ in range(3)] == [gen.random() for _ in range(3)]


def test_input_is_not_mutated() -> None:
    state = {"a": (1, [2, 3]), "b": np.arange(3), "c": {"d": 2**100}}
    before = copy.deepcopy(state)
    encode_state(state)
    assert state.keys() == before.keys() and state["a"] == before["a"] and state["c"] == before["c"]
    assert isinstance(state["a"], tuple) and state["b"].tolist() == [0, 1, 2]


# ------------------------------------------------------------------------------ encode rejects


@pytest.mark.parametrize("state,path,found", [
    ({"rng": {"numpy": {"state": object()}}}, "rng/numpy/state", "object"),
    ({"opt": [1, {2: "x"}]}, "opt/1", "int"),
    ({"x": {1.5, 2.5}}, "x", "set"),
    ({"a": np.array([None, 1], dtype=object)}, "a", "object"),
    ({"a": np.array(["s"])}, "a", "<U1"),
    ({"a": np.datetime64("2024-01-01")}, "a", "datetime64[D]"),
    ({"q": [np.zeros(2, ml_dtypes.int4)]}, "q/0", "int4"),
    ({"m": np.ma.masked_array([1, 2], mask=[0, 1])}, "m", "MaskedArray"),
])
def test_disallowed_types_name_the_key_path(state: Any, path: str, found: str) -> None:
    with pytest.raises(InvalidStateError) as info:
        encode_state(state)
    assert info.value.key == path and info.value.found == found


def test_reference_cycle_and_deep_nesting_rejected_on_encode() -> None:
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(ReferenceCycleError, match="contains itself") as info:
        encode_state(cyclic)
    assert isinstance(info.value, InvalidStateError) and info.value.key == "0"  # where the cycle closes
    loop: dict[str, Any] = {"a": 1}
    loop["x"] = {"ys": (1, loop)}  # through a dict and a tuple
    with pytest.raises(ReferenceCycleError) as info:
        encode_state({"opt": loop})
    assert info.value.key == "opt/x/ys/1"
    shared = {"lr": [0.1, 0.2]}  # control: one value reached twice is a tree, not a cycle
    assert decode_state(encode_state({"a": shared, "b": shared, "c": [shared, shared]})) == {
        "a": shared, "b": shared, "c": [shared, shared]}
    deep: Any = 1
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(InvalidStateError, match="deeper"):
        encode_state(deep)


def test_nesting_limit_counts_the_root() -> None:
    # FORMAT.md 7.1: the root container is level 1; levels 1..64 are accepted, 65 is rejected.
    assert MAX_DEPTH == 64
    assert decode_state(b"\x91" * 64 + b"\xc0") is not None  # control: 64 levels, root included
    with pytest.raises(InvalidStateError, match="deeper"):
        decode_state(b"\x91" * 65 + b"\xc0")
    deep: Any = None
    for _ in range(64):
        deep = {"k": deep}
    assert decode_state(encode_state(deep)) == deep  # the encoder accepts exactly what decoders do
    with pytest.raises(InvalidStateError, match="deeper"):
        encode_state([deep])
    assert decode_state(b"\xc0") is None  # a scalar root has no level


def test_encode_refuses_state_that_decode_would_refuse() -> None:
    with pytest.raises(InvalidStateError, match="max_bytes"):
        encode_state(b"x" * 1000, max_bytes=100)


# ------------------------------------------------------------------------------ hostile input


@given(st.binary(max_size=512))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_arbitrary_bytes_decode_or_raise_invalid_state_only(data: bytes) -> None:
    try:
        decode_state(data)
    except InvalidStateError:
        pass


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
                    | st.binary(), lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
                    max_leaves=20))
@settings(max_examples=200, deadline=None)
def test_mutated_valid_encodings_decode_or_raise_invalid_state_only(obj: Any) -> None:
    data = bytearray(encode_state({"s": obj, "a": np.arange(3, dtype=np.int16)}))
    for i in range(0, len(data), 3):  # flip bytes at many positions, one at a time
        mutated = bytes(data[:i]) + bytes([data[i] ^ 0xA5]) + bytes(data[i + 1:])
        try:
            decode_state(mutated)
        except InvalidStateError:
            pass


# Inputs on which raw msgpack.unpackb raises something that is not InvalidStateError.
RAW_FAILURES = [
    b"\xc1",                                  # reserved byte
    b"\x92\x01",                              # truncated array
    b"\x01\x02",                              # trailing data
    b"\x81\x91\x01\x02",                      # list as a map key
    b"\x91" * 5000 + b"\xc0",                 # nesting deeper than msgpack's stack
    b"\xdd\xff\xff\xff\xff",                  # array declaring 4 billion items
]


@pytest.mark.parametrize("data", RAW_FAILURES, ids=range(len(RAW_FAILURES)))
def test_raw_unpackb_raises_other_types_but_decode_state_does_not(data: bytes) -> None:
    # Broken control: without the wrapper, these escape as ValueError, TypeError, msgpack errors.
    with pytest.raises(Exception) as raw:
        msgpack.unpackb(data, strict_map_key=False)
    assert not isinstance(raw.value, InvalidStateError)
    with pytest.raises(InvalidStateError):
        decode_state(data)


@pytest.mark.parametrize("data,match", [
    (b"\x91" * (MAX_DEPTH + 1) + b"\xc0", "deeper"),
    (b"\x81\xa1a" * (MAX_DEPTH + 1) + b"\xc0", "deeper"),
    # Declared lengths far beyond the input: refused before anything is allocated.
    (b"\xdb\xff\xff\xff\xff" + b"x" * 10, "max_str_len|incomplete input"),
    (b"\xc6\x7f\xff\xff\xff" + b"x" * 10, "max_bin_len|incomplete input"),
    (b"\xdf\xff\xff\xff\xff", "exceeds max_map_len"),
    (b"\xc9\x7f\xff\xff\xff\x02", "max_ext_len|incomplete input"),
    (b"\x81\xc4\x01k\x01", "key"),                              # bytes map key
    (msgpack.packb(msgpack.ExtType(42, b"")), "unknown msgpack extension type 42"),
    (msgpack.packb(msgpack.ExtType(EXT_BIGINT, b"")), "empty big-int"),
    (ndarray_ext("float32", [2, 3], b"\0" * 20), "needs 24 bytes, found 20"),
    (ndarray_ext("float32", [-1], b""), "non-negative"),
    (ndarray_ext("float32", [2**62, 2**62, 0], b""), "too large"),
    (ndarray_ext("float32", [1] * 40, b"\0" * 4), "max_array_len\\(32\\)"),  # refused before the list is built
    (ndarray_ext("object", [1], b"\0" * 8), "'object' is not allowed"),
    (ndarray_ext("O", [1], b"\0" * 8), "'O' is not allowed"),
    (ndarray_ext("<f4", [1], b"\0" * 4), "is not allowed"),
    (ndarray_ext("bool", [2], b"\x01\x07"), "other than 0 and 1"),
    (ndarray_ext("float32", [2], b"\0" * 8, code=EXT_NPSCALAR), "shape \\[\\]"),
    (msgpack.packb(msgpack.ExtType(EXT_NDARRAY, b"\xc1")), "not valid"),
    (msgpack.packb(msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["int8", [1], msgpack.ExtType(2, b"")]))),
     "not allowed inside"),
])
def test_hostile_inputs_are_rejected(data: bytes, match: str) -> None:
    with pytest.raises(InvalidStateError, match=match):
        decode_state(data)


def test_input_larger_than_max_bytes_is_refused_before_parsing() -> None:
    data = encode_state({"x": b"\0" * 2000})
    assert decode_state(data, max_bytes=len(data)) == {"x": b"\0" * 2000}
    with pytest.raises(InvalidStateError, match="more than max_bytes"):
        decode_state(data, max_bytes=len(data) - 1)
    with pytest.raises(InvalidStateError, match="must be bytes"):
        decode_state("text")  # type: ignore[arg-type]


class _Boom:
    def __reduce__(self) -> Any:
        return (Path.touch, (Path(os.environ["CKPTFMT_STATE_CANARY"]),))


def test_pickle_payload_is_rejected_and_never_executed(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    canary = tmp_path / "executed"
    monkeypatch.setenv("CKPTFMT_STATE_CANARY", str(canary))
    payload = pickle.dumps({"step": 1, "boom": _Boom()})
    # Broken control: pickle itself runs the payload's code.
    pickle.loads(payload)
    assert canary.exists()
    canary.unlink()
    for data in (payload, msgpack.packb({"state": payload}),
                 msgpack.packb(msgpack.ExtType(EXT_NDARRAY, payload))):
        try:
            out = decode_state(data)
        except InvalidStateError:
            out = None
        assert out is None or out == {"state": payload}  # stays inert bytes at most
        assert not canary.exists()


# ------------------------------------------------------------------ one encoding per value (FORMAT.md 7.1, 7.2)

def _timestamp(seconds: int, nanoseconds: int = 0) -> bytes:
    return msgpack.packb({"t": msgpack.Timestamp(seconds, nanoseconds)})


@pytest.mark.parametrize("data, control, match", [
    # ext -1, the msgpack timestamp (32-, 64- and 96-bit forms): plain msgpack decodes it into a
    # Timestamp without asking the ext hook.
    (_timestamp(1), msgpack.packb({"t": 1}), "timestamp"),
    (_timestamp(1, 5), msgpack.packb({"t": 1}), "timestamp"),
    (_timestamp(-1), msgpack.packb({"t": -1}), "timestamp"),
    # A map that holds a key twice: plain msgpack keeps the last value.
    (b"\x82\xa1a\x01\xa1a\x02", b"\x82\xa1a\x01\xa1b\x02", "twice"),
    (b"\x81\xa1m\x82\xa1k\xc0\xa1k\xc3", b"\x81\xa1m\x82\xa1k\xc0\xa1j\xc3", "twice"),
    # ext 1 that is not minimal, or holds a value that fits in int64.
    (msgpack.packb(msgpack.ExtType(EXT_BIGINT, b"\x00\x00\x80" + b"\x00" * 7)), encode_state(2**63), "not minimal"),
    (msgpack.packb(msgpack.ExtType(EXT_BIGINT, b"\xff\xff\x7f" + b"\xff" * 7)), encode_state(-(2**63) - 1),
     "not minimal"),
    (msgpack.packb(msgpack.ExtType(EXT_BIGINT, b"\x05")), msgpack.packb(5), "fits in int64"),
    (msgpack.packb(msgpack.ExtType(EXT_BIGINT, b"\x80" + b"\x00" * 7)), msgpack.packb(-(2**63)), "fits in int64"),
    # A bool byte of 2, in an array and in a numpy scalar.
    (ndarray_ext("bool", [3], b"\x00\x01\x02"), ndarray_ext("bool", [3], b"\x00\x01\x01"), "other than 0 and 1"),
    (ndarray_ext("bool", [], b"\x02", code=EXT_NPSCALAR), ndarray_ext("bool", [], b"\x01", code=EXT_NPSCALAR),
     "other than 0 and 1"),
])
def test_values_with_a_second_encoding_are_rejected(data: bytes, control: bytes, match: str) -> None:
    decode_state(control)  # the control: the one encoding the format allows decodes
    with pytest.raises(InvalidStateError, match=match):
        decode_state(data)


# ------------------------------------------------------------------ the element cap (FORMAT.md 7.1)

from ckptfmt.state import MAX_ELEMENTS, _count_elements  # noqa: E402


def _nils(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + b"\xc0" * n  # an array of n nils: n + 1 elements


def test_state_of_more_elements_than_the_cap_is_refused_before_decoding() -> None:
    cap = 1000  # the rule at a small cap; the real one (2^22) below, on a header alone
    assert decode_state(_nils(cap - 1), max_elements=cap) == [None] * (cap - 1)  # the control: exactly the cap
    assert len(msgpack.unpackb(_nils(cap))) == cap  # broken control: plain msgpack builds whatever it is given
    nested = msgpack.packb([[None] * 9] * 100)  # 1 + 100 * 10 = 1001 elements
    assert len(decode_state(nested, max_elements=cap + 1)) == 100
    for data in (_nils(cap), nested):
        with pytest.raises(InvalidStateError, match="msgpack elements"):
            decode_state(data, max_elements=cap)
    # Issue 12: 64 MiB of empty arrays decoded into 4.9 GB. Refused from the first header.
    n = (64 << 20) - 5
    with pytest.raises(InvalidStateError, match=f"more than {MAX_ELEMENTS} msgpack elements"):
        decode_state(b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n)


def test_encode_refuses_state_with_more_elements_than_a_reader_accepts() -> None:
    cap = 1000
    assert decode_state(encode_state([None] * (cap - 1), max_elements=cap), max_elements=cap)  # the control
    with pytest.raises(InvalidStateError, match="one numpy array"):
        encode_state([None] * cap, max_elements=cap)
    assert decode_state(encode_state({"ids": np.arange(2 * cap)}, max_elements=cap), max_elements=cap)["ids"].size == 2 * cap


def _elements(obj: Any) -> int:
    """The slow twin: elements of a decoded tree (an ndarray or numpy scalar is one ext)."""
    if isinstance(obj, list):
        return 1 + sum(_elements(v) for v in obj)
    if isinstance(obj, dict):
        return 1 + sum(1 + _elements(v) for v in obj.values())
    return 1


_SIZES = st.sampled_from([0, 1, 31, 32, 255, 256, 65535, 65536])  # every width of str, bin and ext headers


@given(st.recursive(st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                    | st.floats(allow_nan=False) | _SIZES.map(lambda n: "a" * n) | _SIZES.map(bytes)
                    | _SIZES.map(lambda n: np.zeros(n // 2, np.int16)) | st.builds(np.float32, st.floats(width=32)),
                    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=5), inner, max_size=20),
                    max_leaves=40))
@settings(max_examples=150, deadline=None)
def test_the_header_count_equals_the_decoded_count(obj: Any) -> None:
    """The counter that runs before decoding agrees with counting the decoded tree (every header
    width: fixstr to str32, bin8 to bin32, fixext to ext32, fixarray to array16, fixmap to map16)."""
    data = encode_state(obj)
    assert _count_elements(data, 1 << 40) == _elements(decode_state(data))


def test_the_header_count_of_32_bit_containers() -> None:
    for obj in ([None] * 70000, {str(i): None for i in range(70000)}):
        data = encode_state(obj)
        assert data[0] in (0xDD, 0xDF) and _count_elements(data, 1 << 40) == _elements(obj)
