"""The guide's runnable specimen, extended to the golden repositories, runs under Node.js
(spec/examples/distributed-checkpointing.test.mjs): the format is readable outside Python."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SPECIMEN = Path(__file__).resolve().parent.parent / "spec" / "examples" / "distributed-checkpointing.test.mjs"


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js (node) is not installed on this machine")
def test_guide_specimen_passes_on_the_golden_manifests():
    out = subprocess.run(["node", "--test", str(SPECIMEN)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "PASS: incomplete checkpoints stay private" in out.stdout
    assert "# pass 3" in out.stdout and "# fail 0" in out.stdout, out.stdout[-2000:]
