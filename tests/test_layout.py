"""The layout module: keys, the save-id grammar (one writer, one parser) and the shard byte layout."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfmt import layout as L


@given(st.integers(0, L.MAX_STEP), st.floats(0, 4e9), st.from_regex(r"[0-9a-f]{8}", fullmatch=True))
@settings(max_examples=200, deadline=None)
def test_the_save_id_writer_and_parser_agree(step, now, token):
    sid = L.new_save_id(step, now_unix=now, token=token)
    parsed = L.parse_writer_save_id(sid)
    assert parsed is not None and parsed.step == step and parsed.token == token
    assert L.is_save_id(sid) and L.save_prefix(sid) == f"saves/{sid}/"


def test_names_outside_the_writer_form_are_not_parsed():
    good = L.new_save_id(7, now_unix=0, token="0badcafe")
    assert L.parse_writer_save_id(good) is not None  # control
    for bad in (good.upper(), "0" + good[1:].replace("-", "_", 1), good + "x", good[1:], "1" * 20 + good[12:],
                "my-run", ""):
        assert L.parse_writer_save_id(bad) is None, bad
    assert L.is_save_id("my-run") and not L.is_save_id("../x") and not L.is_save_id(3)
    # The whole name must match: "$" alone also matches before a final line feed (issue 24).
    assert L.is_save_id(good) and not L.is_save_id(good + "\n") and not L.is_save_id("my-run\n")


@given(st.lists(st.integers(0, L.MAX_STEP), min_size=1, max_size=40), st.binary(max_size=64), st.data())
@settings(max_examples=150, deadline=None)
def test_the_scan_for_writer_ids_equals_substring_search(steps, noise, data):
    """gc's linear scan (its fast path) against plain substring search (its slow twin)."""
    ids = [L.new_save_id(s, now_unix=s % 10**9, token=f"{s % 2**32:08x}") for s in steps]
    inside = data.draw(st.lists(st.sampled_from(ids), max_size=10))
    text = noise.join(i.encode() for i in inside) + b'"save_id":"' + (inside[0].encode() if inside else b"") + b'"'
    wanted = set(ids)
    assert L.writer_save_ids_in(text, wanted) == {i for i in wanted if i.encode() in text}


def test_keys():
    assert L.manifest_key(7) == "manifests/00000000000000000007.json"
    assert L.step_of_manifest_key(L.manifest_key(L.MAX_STEP)) == L.MAX_STEP
    assert L.step_of_manifest_key("manifests/99999999999999999999.json") is None  # above 2^63 - 1
    assert L.step_of_manifest_key("manifests/7.json") is None
    sid = "000000000007-20260101T000000-0badcafe"
    path = L.array_path(sid, 3)
    assert path == f"saves/{sid}/t/000003" and path.startswith(L.arrays_prefix(sid))
    assert L.shard_key(path, (1, 0)) == path + "/c/1/0" == L.shard_key(path, "c/1/0")
    assert L.shard_key(path, ()) == path + "/c"
    assert L.lease_key(sid) == f"saves/{sid}/LEASE"
    assert (L.state_key(sid, None), L.state_name(None)) == (f"saves/{sid}/state/global.msgpack", "global")
    assert (L.state_key(sid, 3), L.state_name(3)) == (f"saves/{sid}/state/rank-00003.msgpack", "rank/3")


def test_zarr_array_metadata_of_a_bool_array():
    meta = L.zarr_array_metadata((4,), "bool", (2,), (1,))
    assert meta["fill_value"] is False and meta["codecs"][0]["configuration"]["codecs"][0] == {"name": "bytes"}


def test_leases_round_trip_and_garbage_reads_as_stale():
    lease = L.parse_lease(L.lease_bytes({"save_id": "s", "step": 3, "world": 2, "state": "committing"}, now_unix=5.0))
    assert lease == L.Lease(5.0, "committing", 3)
    assert json.loads(L.lease_bytes({"save_id": "s"}, now_unix=1.0)) == {"heartbeat_unix": 1.0, "save_id": "s"}
    for junk in (b"", b"{", b"[]", b'{"heartbeat_unix": "x"}', b"x" * (L.LEASE_MAX_BYTES + 1)):
        assert L.parse_lease(junk) == L.Lease(0.0, "writing", None)
    assert L.parse_lease(b'{"heartbeat_unix": 1, "state": "odd", "step": true}') == L.Lease(1.0, "writing", None)
