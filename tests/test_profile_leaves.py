"""The per-leaf profile harness (``python -m devtools.profile_leaves``): its safetensors file of
empty tensors is one the library reads, and its table prints microseconds per leaf per phase.

No timing is asserted: the harness measures, docs/profile-save.md keeps the figures.
"""
from __future__ import annotations

from ckptfmt.interop import SafetensorsSource
from devtools.profile_leaves import empty_safetensors, table


def test_the_empty_tensors_file_is_read_by_the_library(tmp_path):
    path = str(tmp_path / "e.safetensors")
    empty_safetensors(path, 7)
    src = SafetensorsSource(path)
    assert sorted(src.keys()) == sorted(f"t{i}" for i in range(7))
    assert tuple(src.tensor("t3").shape) == (0,)


def test_the_table_gives_microseconds_per_leaf_and_milliseconds_per_phase():
    save = {"stage": 0.01, "plan": 0.02, "write": 0.1, "commit": 0.05, "total": 0.2}
    state = {"leaves": 1000, "bytes": 1 << 20, "describe": "d", "manifest_bytes": 10**6, "files_in_repository": 3,
             "saves": [save | {"total": 0.5}, save, save], "restores": [{"open": 0.001, "total": 0.1}],
             "parse_s": 0.004, "serialise_s": 0.002}
    text = table({"llama (1,000 leaves)": state}, {"n": 100, "wall_s": 0.5, "peak_rise": 10**6})
    assert "| save: write | 100.0 | 100.0 |" in text  # 0.1 s over 1,000 leaves: 100 µs per leaf
    assert "| save: total of the first save | 500.0 | 500.0 |" in text
    assert "| save: fsync | - | - |" in text  # a phase the save did not report
    assert "| manifest: parse | 4.0 | 4.0 |" in text
    assert "| `import_safetensors` | 100 | 5,000.0 | 0.50 | 1.0 | 10.00 |" in text
