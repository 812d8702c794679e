"""The bridge contract (bridges/README.md): the same scenarios through every bridge.

Each bridge runs in a fresh process (JAX fixes its devices at import), which runs every scenario
of tests/bridgeproc/contract.py once; each (bridge, scenario) is reported here as its own test.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "bridgeproc", "contract.py")
BRIDGES = {"jax": ("jax", "flax"), "torch": ("torch",)}
SCENARIOS = ["signatures", "round_trip_extra_and_rank_state", "no_committed_step",
             "async_save_returns_the_core_handle", "topology_change_needs_a_policy", "strict_and_mapping",
             "batched_restore", "partial_restore", "cast_within_one_kind", "every_mismatch_in_one_error",
             "async_save_snapshots_numpy_extra", "unencodable_extra_raises_at_the_call",
             "a_bad_policy_raises_before_any_read"]
_results: dict[str, dict[str, str]] = {}


def _run(bridge: str, tmp_path_factory: Any) -> dict[str, str]:
    if bridge not in _results:
        missing = [m for m in BRIDGES[bridge] if importlib.util.find_spec(m) is None]
        if missing:
            pytest.skip(f"needs {missing}")
        out = tmp_path_factory.mktemp(f"contract-{bridge}") / "results.json"
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.run([sys.executable, SCRIPT, bridge, str(out)], env=env, capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-4000:]
        _results[bridge] = json.loads(out.read_text())
    return _results[bridge]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("bridge", sorted(BRIDGES))
def test_bridge_contract(bridge: str, scenario: str, tmp_path_factory: Any) -> None:
    results = _run(bridge, tmp_path_factory)
    assert sorted(results) == sorted(SCENARIOS), "the scenario list and tests/bridgeproc/contract.py differ"
    assert results[scenario] == "ok", results[scenario]
