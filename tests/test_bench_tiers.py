"""The tiers bench (issue 29's figures): the paired blocked figures, and one tiny real run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from ckptfmt_tools.bench.tiers import _paired

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_blocked_saves_are_paired_by_round():
    """Local less persistent per round; "no more than" counts ties. Control: a local save that
    blocks longer in a round is not counted, and moves the median."""
    even = _paired({"persistent": [0.004, 0.003, 0.005], "local": [0.003, 0.003, 0.004], "both": []})
    assert even["rounds"] == 3 and even["local_not_more"] == 3 and abs(even["median_diff_s"] + 0.001) < 1e-12
    worse = _paired({"persistent": [0.004, 0.003, 0.005], "local": [0.009, 0.003, 0.004], "both": []})
    assert worse["local_not_more"] == 2 and abs(worse["median_diff_s"] + 0.0) < 1e-12
    assert _paired({"persistent": [], "local": [], "both": []})["median_diff_s"] is None


def test_tiers_bench_runs_end_to_end_tiny(tmp_path):
    """2 processes x 4 devices, 16 MiB, 2 rounds: every save committed, the local restore read only
    the own tiers and was exact, and the two kinds alternated (one pair per round)."""
    out = subprocess.run([sys.executable, "-m", "ckptfmt_tools.bench.tiers", "--mib", "16", "--saves", "2", "--json"],
                         cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    f = json.loads(out.stdout)
    assert f["restore_local_exact"] and f["blocked_paired"]["rounds"] == 2
    assert all(t["persistent"] == 0 and t["peer"] == 0 and t["local"] > 0 for t in f["restore_local_tiers"])
    assert [len(v) for v in f["blocked_runs_s"].values()] == [2, 2, 2]
    assert not os.listdir(tmp_path)  # its work directory went
