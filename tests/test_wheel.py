"""What a user installs (issue 52 items 1 and 10): the sdist and the wheel build, the wheel holds the
library, the bridges and the user commands and no developer harness (devtools/), and it installs
into a bare venv where a core-only quickstart runs without jax or torch, and a JAX quickstart runs
once the ``jax`` extra's packages are there.

How the bare venv gets its dependencies, offline: the build runs setuptools' PEP 517 hooks in a
copy of the tree (what ``python -m build --no-isolation`` does: the sdist first, then the wheel
built from the unpacked sdist, so a file missing from the sdist is caught). The venv is made with
``python -m venv --without-pip``; the wheel is installed into it by pip with ``--no-index
--no-deps``. Its dependencies are not downloaded (the test runs without a network): the
requirements the wheel's own METADATA declares (``Requires-Dist``, with the extra's markers) are
resolved, recursively, against the distributions installed in the test's environment, and only
that closure is linked (each distribution's RECORD: its packages and its dist-info) into a folder
the venv reads through a ``.pth`` file. So the venv sees exactly what ``pip install ckptfmt`` (or
``ckptfmt[jax]``) would bring, at the test environment's versions: an undeclared dependency fails
to import there, and jax, torch and typer are absent from the core-only venv (checked). The
console script ``ckptfmt`` is the one pip wrote from the wheel's entry points.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # packaging: a requirement of pytest itself
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
#: What the wheel must hold (user-facing commands stay) and must not (developer harnesses, tests).
MUST_HOLD = ("ckptfmt/__init__.py", "ckptfmt/py.typed", "bridges/jax/__init__.py", "bridges/torch/__init__.py",
             "bridges/_requires.py", "ckptfmt_tools/cli/__init__.py", "ckptfmt_tools/demo.py",
             "ckptfmt_tools/drill/__init__.py", "ckptfmt_tools/faults/__init__.py",
             "ckptfmt_tools/bench/runner.py", "ckptfmt_tools/bench/states.py")
MUST_NOT_HOLD = ("devtools/", "tests/", "ckptfmt_tools/archmetrics.py", "ckptfmt_tools/bench/profile_save.py",
                 "ckptfmt_tools/bench/inode_churn.py", "ckptfmt_tools/bench/save_cpu.py",
                 "ckptfmt_tools/bench/dcp_writer.py", "ckptfmt_tools/bench/lora_adapters.py",
                 "ckptfmt_tools/bench/coop_restore.py")
SKIP = shutil.ignore_patterns(".git", ".venv", "site", "build", "dist", "*.egg-info", "__pycache__", "drill-out",
                              "bench-out", ".pytest_cache", ".hypothesis", "tests", "notebooks", "docs")

CORE_QUICKSTART = r"""
import sys
import numpy as np
import ckptfmt

w = np.arange(32, dtype=np.float32).reshape(8, 4)
halves = [ckptfmt.LocalShard("w", w.shape, w.dtype, ckptfmt.Box((r, 0), (4, 4)), w[r:r + 4]) for r in (0, 4)]
ckptfmt.save(sys.argv[1], 7, halves, state={"step": 7})
ckpt = ckptfmt.Repository(sys.argv[1]).open()
assert (ckpt.read("w") == w).all() and (ckpt.read("w", ckptfmt.Box((2, 1), (3, 2))) == w[2:5, 1:3]).all()
assert not [m for m in sys.modules if m.split(".")[0] in ("jax", "torch", "flax", "typer", "rich")]
for framework in ("jax", "torch", "typer"):
    try:
        __import__(framework)
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError(framework + " is importable in the core-only venv")
try:
    import bridges.jax
except ModuleNotFoundError as e:
    assert "pip install 'ckptfmt[jax]'" in str(e), e
    print("hint:", e)
else:
    raise AssertionError("bridges.jax imported without jax")
print("core ok", ckptfmt.__version__, ckptfmt.__file__)
"""

JAX_SAVE = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + sys.argv[2]
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import bridges.jax as bjax

mesh = jax.make_mesh((int(sys.argv[2]),), ("x",))
spec = NamedSharding(mesh, P("x"))
if sys.argv[3] == "save":
    state = {"w": jax.device_put(jnp.arange(64.0).reshape(16, 4), spec), "step": 3}
    bjax.save(sys.argv[1], state, step=3)
else:
    target = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=spec), "step": 0}
    got = bjax.restore(sys.argv[1], target)
    assert len(got["w"].sharding.device_set) == int(sys.argv[2]) and got["step"] == 3, got
    assert (np.asarray(got["w"]) == np.arange(64.0).reshape(16, 4)).all()
print("jax ok", sys.argv[2], sys.argv[3])
"""


def _dist_closure(requirements: list[str], extras: set[str]) -> dict[str, md.Distribution]:
    """The installed distributions that ``requirements`` (Requires-Dist lines, evaluated with
    ``extras``) need, recursively. A requirement that is not installed here fails the test."""
    out: dict[str, md.Distribution] = {}
    todo = [(r, frozenset(extras | {""})) for r in requirements]
    while todo:
        line, active = todo.pop()
        req = Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in active):
            continue
        name = canonicalize_name(req.name)
        if name in out:
            continue
        dist = md.distribution(req.name)  # PackageNotFoundError names a dependency this environment lacks
        assert req.specifier.contains(dist.version, prereleases=True), (line, dist.version)
        out[name] = dist
        todo += [(r, frozenset(req.extras | {""})) for r in dist.requires or ()]
    return out


def _link(dists: dict[str, md.Distribution], into: Path) -> None:
    """Link each distribution's top-level files (packages, modules, dist-info) into ``into``."""
    into.mkdir()
    for dist in dists.values():
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            src, dst = base / top, into / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)


def _requires_dist(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def _run(args: list[str], *, cwd: Path | None = None, env: dict | None = None, timeout: int = 300):
    p = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, (args, p.stdout[-3000:], p.stderr[-3000:])
    return p


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("wheel")
    tree, dist = base / "tree", base / "dist"
    shutil.copytree(ROOT, tree, ignore=SKIP)
    dist.mkdir()
    hook = "import sys; from setuptools import build_meta as b; print(getattr(b, sys.argv[1])(sys.argv[2]))"
    sdist = dist / _run([sys.executable, "-c", hook, "build_sdist", str(dist)], cwd=tree).stdout.split()[-1]
    with tarfile.open(sdist) as t:
        t.extractall(base / "unpacked", filter="data")
    (unpacked,) = (base / "unpacked").iterdir()
    wheel = dist / _run([sys.executable, "-c", hook, "build_wheel", str(dist)], cwd=unpacked).stdout.split()[-1]
    return {"sdist": sdist, "wheel": wheel, "base": base}


def test_wheel_holds_the_library_and_user_commands_and_no_developer_harness(built):
    with zipfile.ZipFile(built["wheel"]) as z:
        names = z.namelist()
        entry = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    missing = [m for m in MUST_HOLD if m not in names]
    assert not missing, missing
    stray = [n for n in names if n.startswith(MUST_NOT_HOLD)]
    assert not stray, stray
    assert "ckptfmt = ckptfmt.__main__:main" in entry and any(n.endswith("licenses/LICENSE") for n in names)
    # Control: the same check finds a harness in a listing that holds one.
    assert [n for n in names + ["devtools/profile_save.py"] if n.startswith(MUST_NOT_HOLD)] == ["devtools/profile_save.py"]
    with tarfile.open(built["sdist"]) as t:
        assert any(n.endswith("/README.md") for n in t.getnames()) and any(n.endswith("/LICENSE") for n in t.getnames())
    requires = _requires_dist(built["wheel"])
    for extra in ("jax", "torch", "hf", "cli"):
        assert any(f'extra == "{extra}"' in r for r in requires), (extra, requires)


def _venv(built, name: str, extras: set[str]) -> tuple[Path, dict]:
    venv = built["base"] / name
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index", "--no-deps",
          str(built["wheel"])], timeout=300)
    deps = built["base"] / f"{name}-deps"
    _link(_dist_closure([r for r in _requires_dist(built["wheel"])], extras), deps)
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (purelib / "declared-deps.pth").write_text(str(deps) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(JAX_PLATFORMS="cpu", PATH=str(venv / "bin") + os.pathsep + env.get("PATH", ""))
    return venv, env


def test_core_only_quickstart_in_a_bare_venv(built, tmp_path):
    venv, env = _venv(built, "core", set())
    script = tmp_path / "quickstart.py"
    script.write_text(CORE_QUICKSTART)
    out = _run([str(venv / "bin" / "python"), str(script), str(tmp_path / "repo")], cwd=tmp_path, env=env).stdout
    assert "core ok" in out and str(venv) in out, out  # the installed copy, not the checkout
    assert "pip install 'ckptfmt[jax]'" in out, out
    # The console script without the cli extra names the extra to install.
    p = subprocess.run([str(venv / "bin" / "ckptfmt"), "ls", str(tmp_path / "repo")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "pip install 'ckptfmt[cli]'" in p.stderr, (p.returncode, p.stderr[-2000:])


def test_jax_extra_quickstart_saves_on_8_and_restores_on_4(built, tmp_path):
    pytest.importorskip("jax")
    pytest.importorskip("typer")
    venv, env = _venv(built, "jax", {"jax", "cli"})
    py = str(venv / "bin" / "python")
    script = tmp_path / "jax_quickstart.py"
    script.write_text(JAX_SAVE)
    repo = str(tmp_path / "repo")
    assert "jax ok 8 save" in _run([py, str(script), repo, "8", "save"], cwd=tmp_path, env=env).stdout
    assert "jax ok 4 restore" in _run([py, str(script), repo, "4", "restore"], cwd=tmp_path, env=env).stdout
    p = subprocess.run([py, "-c", "import torch"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "No module named 'torch'" in p.stderr  # the jax extra brings no torch
    ls = _run([str(venv / "bin" / "ckptfmt"), "ls", "--json", repo], cwd=tmp_path, env=env).stdout
    assert [s["step"] for s in json.loads(ls)["steps"]] == [3], ls
