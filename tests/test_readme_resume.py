"""Issue 47 item 9: README.md's checkpoint-manager example resumes and trains, as printed.

tests/jaxproc/readme_resume.py runs the README's block (with only ``opt`` and ``train_step``
supplied, as the README leaves them to the user) for two users: the block exactly as printed, with
a train step that lays the state over a mesh, and a Flax NNX model with its ``nnx.Optimizer`` on
the mesh. One process on 8 CPU devices trains 3 steps and is preempted (the README's own SIGTERM
branch saves step 3); fresh processes on 8 and on 4 devices resume through
``mgr.restore(bjax.abstract_target(state))`` and take three jitted steps each. Before the fix the
first step after the restore raised ``ValueError: Received incompatible devices for jitted
computation``: optax's ``count`` (and the README's whole fresh state) came back committed to
device 0 while the step's other arrays lay on the mesh.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("jax", "flax", "optax")),
                       reason="needs the [jax] extra: pip install -e '.[jax]'"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "jaxproc", "readme_resume.py")
USERS = ("readme", "nnx")


def _run(devices: int, root, out) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, SCRIPT, str(devices), str(root), str(out)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    base = tmp_path_factory.mktemp("readme_resume")
    saved = _run(8, base / "save", base / "save.json")
    out = {"save": saved}
    for devices in (8, 4):  # each resumes from its own copy of the saved step
        shutil.copytree(base / "save", base / f"resume{devices}")
        out[f"resume{devices}"] = _run(devices, base / f"resume{devices}", base / f"resume{devices}.json")
    return out


@pytest.mark.parametrize("user", USERS)
def test_readme_example_saves_on_preemption(runs, user):
    r = runs["save"][user]
    assert r["error"] is None, r.get("traceback")
    assert r["calls"] == 3 and r["final_step"] == 3, r


@pytest.mark.parametrize("devices", (8, 4))
@pytest.mark.parametrize("user", USERS)
def test_readme_example_resumes_and_trains(runs, user, devices):
    saved, r = runs["save"][user], runs[f"resume{devices}"][user]
    assert r["error"] is None, r.get("traceback")
    # The first step received the saved state bit for bit, and three jitted steps ran after it.
    assert r["first"] == saved["final"], sorted(k for k in saved["final"] if r["first"].get(k) != saved["final"][k])
    assert r["calls"] == 3 and r["final_step"] == 6 and all(math.isfinite(x) for x in r["losses"]), r


@pytest.mark.parametrize("user", USERS)
def test_readme_example_same_losses_on_8_and_4_devices(runs, user):
    a, b = runs["resume8"][user]["losses"], runs["resume4"][user]["losses"]
    assert len(a) == len(b) == 3 and all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a, b)), (a, b)
