"""The manifest parsed in pieces (a top-level member at a time, tensor entries a batch at a time)
accepts exactly what the whole-document parse accepts, with the same manifest, and gives way to
it on everything else, which then raises the precise error.

The pieces path only ever accepts: for every text below, either it returns None or the whole
parse accepts the same manifest. Each rule that spans batches (a tensor key or an array path
repeated, the row caps) is broken across two batches of two entries, with the same text kept
whole as the control. A valid manifest takes the pieces path (else the memory it saves is not
saved), and a text the split does not serve (a backslash) is parsed whole."""
import copy
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfmt import (Box, CheckpointError, DuplicateShardError, InvalidManifestError, LocalShard, ManifestTooLargeError,
                     SaveOptions, parse_manifest, save)
from ckptfmt import manifest as mf
from ckptfmt.manifest import CountCaps, MAX_MANIFEST_BYTES
from ckptfmt.manifest._caps import count_structural
from ckptfmt.layout import arrays_prefix
from ckptfmt.manifest._stream import split_document
from manifest_common import same_tables
from test_manifest import BROKEN

BATCH = 2  # small batches: every rule that spans tensors is checked across batches


def caps(data, max_bytes=MAX_MANIFEST_BYTES):
    return CountCaps.for_size_cap(max_bytes).after_counting(count_structural(data))


def both(data, max_bytes=MAX_MANIFEST_BYTES):
    """(the pieces path's manifest or None, the whole parse's manifest or its error)."""
    c = caps(data, max_bytes)
    pieces = mf._parse_in_pieces(data, c, batch=BATCH)
    try:
        whole = mf._parse_whole(data, c)
    except CheckpointError as e:
        whole = e
    return pieces, whole


def agree(data, max_bytes=MAX_MANIFEST_BYTES):
    """The pieces path accepts only what the whole parse accepts, with the same manifest."""
    pieces, whole = both(data, max_bytes)
    if pieces is not None:
        assert not isinstance(whole, Exception), f"pieces accepted what the whole parse rejects: {whole!r}"
        assert pieces.to_bytes() == whole.to_bytes()
        same_tables(pieces.tensors, whole.tensors)
    return pieces, whole


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """Manifest documents of each kind of save: arrays, packed, derived columns, references and zstd."""
    out = {}
    x = np.arange(64, dtype=np.float32).reshape(16, 4)

    def shards(scale):
        s = []
        for i in range(5):  # five tensors of one geometry, a 0-d one and an empty one: batches of two
            s += [LocalShard(f"b/{i}", x.shape, x.dtype, Box((4 * r, 0), (4, 4)), x[4 * r:4 * r + 4] * scale + i)
                  for r in range(4)]
        s.append(LocalShard("s", (), np.float32, Box((), ()), np.asarray(1.5 * scale, np.float32)))
        s.append(LocalShard("e", (0, 3), np.int32, Box((0, 0), (0, 3)), np.zeros((0, 3), np.int32)))
        return s
    for name, opts in (("arrays", SaveOptions(layout="arrays")), ("packed", SaveOptions()),
                       ("derived", SaveOptions(layout="arrays", manifest_columns="derived")),
                       ("zstd", SaveOptions(layout="arrays", codec="zstd"))):
        d = str(tmp_path_factory.mktemp(name) / "repo")
        save(d, 1, shards(1.0), metadata={"note": "true or false", "lr": 0.5}, options=opts)
        m = save(d, 2, shards(1.0 if name == "zstd" else 2.0), options=opts)  # zstd: step 2 references step 1
        out[name] = json.loads(m.to_bytes())
    d = str(tmp_path_factory.mktemp("corpus") / "repo")  # the save of tests/test_manifest.py's corpus
    y = np.arange(40, dtype=np.float32).reshape(10, 4)
    corpus = [LocalShard("w", y.shape, y.dtype, Box((r * 3, 0), (min(3, 10 - r * 3), 4)), y[r * 3:r * 3 + 3]) for r in range(4)]
    corpus.append(LocalShard("s", (), np.int32, Box((), ()), np.asarray(7, np.int32)))
    out["corpus"] = json.loads(save(d, 1, corpus, state={"k": 1}, options=SaveOptions(layout="arrays")).to_bytes())
    return out


def test_every_kind_of_manifest_takes_the_pieces_path(docs):
    """The control for everything below: valid manifests are accepted in pieces, equal to whole."""
    for name, d in docs.items():
        data = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        pieces, whole = agree(data)
        assert pieces is not None, name
        assert parse_manifest(data).to_bytes() == data + b"\n"
    assert set(docs["zstd"]["must_understand"]) >= {mf.ZSTD}
    assert mf.DERIVED in docs["derived"]["must_understand"] and mf.PACKS in docs["packed"]["must_understand"]


def _text(d):
    return json.dumps(d, separators=(",", ":")).encode()


def test_a_tensor_key_repeated_across_batches_is_rejected(docs):
    """``{"b/0": ..., ..., "s": ..., "b/0": ...}``: the repeat (on an array of its own) is the last
    entry, in another batch of two than the first "b/0". The control: the same entry under a new
    key is accepted in pieces."""
    d = docs["arrays"]
    text = _text(d)
    entry = dict(d["tensors"]["b/0"], array=dict(d["tensors"]["b/0"]["array"], path=f"saves/{d['save_id']}/t/009999"))
    member = json.dumps(entry, separators=(",", ":")).encode()
    head, sep, tail = text.rpartition(b'},"versions":')
    assert list(d["tensors"])[0] == "b/0" and len(d["tensors"]) % 2 == 1  # the last entry starts a batch
    pieces, whole = agree(head + b',"b/9":' + member + sep + tail)
    assert pieces is not None and "b/9" in pieces.tensors
    repeated = head + b',"b/0":' + member + sep + tail
    pieces, whole = agree(repeated)
    assert pieces is None and isinstance(whole, InvalidManifestError) and "repeats a JSON member" in str(whole)
    with pytest.raises(InvalidManifestError, match="repeats a JSON member"):
        parse_manifest(repeated)


def test_two_tensors_on_one_array_in_different_batches_are_rejected(docs):
    """The first and the last tensor name one array (different batches). Control: the document as written."""
    d = copy.deepcopy(docs["arrays"])
    keys = list(d["tensors"])
    assert agree(_text(d))[0] is not None
    d["tensors"][keys[-1]]["array"]["path"] = d["tensors"][keys[0]]["array"]["path"]
    pieces, whole = agree(_text(d))
    assert pieces is None and isinstance(whole, CheckpointError)
    with pytest.raises((DuplicateShardError, InvalidManifestError)):
        parse_manifest(_text(d))


def test_row_caps_count_every_batch(docs):
    """At a cap one row below the document's shard rows, no batch alone exceeds it but the running
    total does: ManifestTooLargeError from the whole parse, None from the pieces. Control: at exactly
    the document's rows both accept."""
    data = _text(docs["arrays"])
    rows = sum(len(t["shards"]["key"]) for t in docs["arrays"]["tensors"].values())
    base = caps(data)
    at = CountCaps(**{**base.__dict__, "shard_rows": rows, "count_rows": True})
    below = CountCaps(**{**base.__dict__, "shard_rows": rows - 1, "count_rows": True})
    assert mf._parse_in_pieces(data, at, batch=BATCH) is not None
    assert mf._parse_in_pieces(data, below, batch=BATCH) is None
    with pytest.raises(ManifestTooLargeError, match="too many shard rows"):
        mf._parse_whole(data, below)


@pytest.mark.parametrize("edit, err", [
    (lambda t: t.replace(b'"tensors":{', b'"tensors":{"z":1,', 1), InvalidManifestError),   # a bad first entry
    (lambda t: t[:-2] + b",}" + t[-1:], InvalidManifestError),                              # trailing comma (top)
    (lambda t: t.replace(b'}},"versions"', b'},},"versions"', 1), InvalidManifestError),      # trailing comma (tensors)
    (lambda t: t + b"{}", InvalidManifestError),                                            # a second object
    (lambda t: t + b" x", InvalidManifestError),                                            # extra data
    (lambda t: b"\xef\xbb\xbf" + t, InvalidManifestError),                                  # a BOM
    (lambda t: t.replace(b'"writer":[', b'"writer":[1.0,', 1), InvalidManifestError),        # a float in a column
    (lambda t: t.replace(b'"writers":', b'"writers":1,"writers":', 1), InvalidManifestError),  # repeated top member
    (lambda t: t.replace(b'"tensors":{', b'"tensors":[{', 1), InvalidManifestError),         # not an object
    (lambda t: t.replace(b'"tensors":', b'"tensors":{},"tensors":', 1), InvalidManifestError),
])
def test_broken_texts_are_parsed_whole(docs, edit, err):
    """Each broken text is refused by the pieces path and rejected by the whole parse."""
    data = _text(docs["arrays"])
    assert agree(data)[0] is not None  # control
    bad = edit(data)
    assert bad != data
    pieces, whole = agree(bad)
    assert pieces is None and isinstance(whole, err), whole
    with pytest.raises(err):
        parse_manifest(bad)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_hostile_corpus_agrees(docs, name):
    """Every broken manifest of tests/test_manifest.py, built from the same save as its own, is
    refused in pieces and rejected whole. Control: that save's manifest is accepted in pieces."""
    make, err = BROKEN[name]
    assert agree(_text(docs["corpus"]))[0] is not None
    pieces, whole = agree(make(json.loads(json.dumps(docs["corpus"]))))
    assert pieces is None and isinstance(whole, err), (name, whole)


def test_a_backslash_sends_the_text_whole(docs):
    """A backslash (an escape in a string) and the split does not apply; the manifest parses the
    same. Control: without it, the split applies."""
    d = copy.deepcopy(docs["arrays"])
    assert split_document(_text(d)) is not None
    d["metadata"]["path"] = "C:\\data"
    data = _text(d)
    assert split_document(data) is None and mf._parse_in_pieces(data, caps(data)) is None
    assert parse_manifest(data).metadata["path"] == "C:\\data"


_EDITS = b'{}[],:"0 1-.etn'


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_edits_agree(docs, data):
    """A character inserted, deleted or replaced anywhere in the text: the pieces path accepts only
    what the whole parse accepts, with the same manifest."""
    name = data.draw(st.sampled_from(sorted(docs)), label="kind")
    text = _text(docs[name])
    i = data.draw(st.integers(0, len(text) - 1), label="at")
    op = data.draw(st.sampled_from(["insert", "delete", "replace"]), label="op")
    c = bytes([data.draw(st.sampled_from(list(_EDITS)), label="char")])
    edited = (text[:i] + c + text[i:] if op == "insert" else text[:i] + text[i + 1:] if op == "delete"
              else text[:i] + c + text[i + 1:])
    agree(edited)


def _peak_and_retained(parse):
    """(peak, retained) bytes above the start while ``parse()`` runs and once it returns."""
    import gc
    import tracemalloc
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        m = parse()
        gc.collect()
        now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert m is not None
    return peak - start, now - start


def test_a_large_manifest_is_parsed_in_pieces(docs):
    """A manifest past mf._PIECES_FROM (about 18,000 empty tensors, as an import writes them) parses
    with a peak under twice what the parsed manifest keeps. The control: parsed whole, the same
    text peaks above three times (the JSON of every tensor at once), so the measure can fail."""
    d = copy.deepcopy(docs["arrays"])
    proto, prefix = d["tensors"]["e"], arrays_prefix(d["save_id"])
    d["tensors"] = {f"t{i:06d}": dict(proto, array=dict(proto["array"], path=f"{prefix}{i:06d}")) for i in range(18_000)}
    data = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    assert len(data) >= mf._PIECES_FROM
    peak, kept = _peak_and_retained(lambda: parse_manifest(data))
    assert peak < 2 * kept, (peak, kept)
    whole_peak, whole_kept = _peak_and_retained(lambda: mf._parse_whole(data, caps(data)))
    assert whole_peak > 3 * whole_kept, (whole_peak, whole_kept)


@pytest.mark.parametrize("value", [False, 0.0])
def test_a_literal_in_a_column_beside_one_in_a_sharding_is_rejected(docs, value):
    """``False`` or ``0.0`` as a shard offset of the second tensor of a later batch (the fast path
    compares it by value with the first's 0, which it equals: only a type check refuses it),
    beside a literal of the same kind in that tensor's sharding: the batch's literals are then not
    all in shardings, so its columns are type-checked. The control: the sharding's literal alone
    is accepted in pieces. (With the batch taken as free of literals, this test fails.)"""
    d = copy.deepcopy(docs["arrays"])
    d["tensors"]["b/3"]["sharding"] = {"flag": value}
    pieces, whole = agree(_text(d))
    assert pieces is not None and pieces.tensors["b/3"].sharding == {"flag": value}
    assert d["tensors"]["b/3"]["shards"]["offset"][0] == [0, 0]
    d["tensors"]["b/3"]["shards"]["offset"][0][0] = value
    pieces, whole = agree(_text(d))
    assert pieces is None and isinstance(whole, InvalidManifestError)
