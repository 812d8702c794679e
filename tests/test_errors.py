"""CheckpointError.to_json / from_json: the one inverse every rank uses to raise a peer's error."""
from __future__ import annotations

import json

import pytest

import ckptfmt.errors as errors
from ckptfmt.errors import CheckpointError, KeyMismatchError, error_class


def _classes() -> list[type[CheckpointError]]:
    return [getattr(errors, n) for n in errors.__all__]


@pytest.mark.parametrize("cls", _classes(), ids=lambda c: c.__name__)
def test_every_error_class_round_trips(cls: type[CheckpointError]) -> None:
    e = cls("it broke", key="model/w", object="step-1/shard-0", expected=[4, 2], found=(4, 3))
    doc = json.loads(json.dumps(e.to_json()))  # through the wire, as a peer sends it
    back = CheckpointError.from_json(doc)
    assert type(back) is cls and str(back) == str(e).replace("(4, 3)", "[4, 3]"), (back, e)
    assert (back.message, back.key, back.object, back.expected, back.found) == \
        ("it broke", "model/w", "step-1/shard-0", [4, 2], [4, 3])
    assert back.to_json() == doc
    pre = CheckpointError.from_json(doc, prefix="rank 0: ")
    assert type(pre) is cls and pre.message == "rank 0: it broke"


def test_unknown_or_untyped_class_gives_a_checkpoint_error_naming_it() -> None:
    doc = {"error": "FutureShardError", "message": "from a newer version", "key": "w"}
    e = CheckpointError.from_json(doc, prefix="rank 1: ")
    assert type(e) is CheckpointError and e.message == "rank 1: FutureShardError: from a newer version" and e.key == "w"
    # A plain exception a peer marked untyped keeps its own name even when it spells one of ours.
    e = CheckpointError.from_json({"error": "StorageError", "message": "bug", "untyped": True})
    assert type(e) is CheckpointError and e.message == "StorageError: bug"
    # The control: the same document, typed, is the class itself.
    assert type(CheckpointError.from_json({"error": "StorageError", "message": "bug"})) is errors.StorageError
    bad = CheckpointError.from_json(["not", "a", "map"])  # type: ignore[arg-type]
    assert type(bad) is CheckpointError and bad.found == "list"
    assert error_class("FutureShardError") is None and error_class("KeyMismatchError") is KeyMismatchError


def test_loaded_subclasses_round_trip() -> None:
    from bridges.mapping import MappingError  # a subclass outside ckptfmt.errors
    e = CheckpointError.from_json(MappingError("rule 0 does not fit", key="w").to_json())
    assert type(e) is MappingError and e.key == "w"
