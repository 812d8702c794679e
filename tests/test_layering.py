"""The import graph runs one way (issue 14): ckptfmt <- bridges <- ckptfmt_tools.

ckptfmt imports neither bridges nor the tools (its one exception is ``ckptfmt/__main__.py``, the
command's entry point, which imports the tools' CLI when it runs); bridges never imports the
tools; the tools use only public bridge modules; ``import ckptfmt`` pulls in no tool and no CLI
dependency, and a missing CLI extra is reported with the extra to install.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRY = ROOT / "ckptfmt" / "__main__.py"


def _imports(package: str) -> dict[Path, set[str]]:
    out: dict[Path, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        mods: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module)
        out[path] = mods
    return out


def _offenders(package: str, forbidden: tuple[str, ...], allow: tuple[Path, ...] = ()) -> list[str]:
    return [f"{p.relative_to(ROOT)} imports {m}" for p, mods in _imports(package).items() if p not in allow
            for m in sorted(mods) if m.split(".")[0] in forbidden]


def test_the_import_graph_runs_one_way():
    assert _offenders("ckptfmt", ("bridges", "ckptfmt_tools"), allow=(ENTRY,)) == []
    assert _offenders("bridges", ("ckptfmt_tools",)) == []
    # Broken control: the entry point is the one place ckptfmt names the tools, and it is seen.
    assert _offenders("ckptfmt", ("ckptfmt_tools",)) == ["ckptfmt/__main__.py imports ckptfmt_tools.cli"]


def test_tools_use_public_bridge_apis_only():
    private = [f"{p.relative_to(ROOT)} imports {m}" for p, mods in _imports("ckptfmt_tools").items()
               for m in sorted(mods) if m.startswith("bridges.") and m.split(".")[1].startswith("_")]
    assert private == []


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_import_ckptfmt_loads_no_tool_and_no_cli_dependency():
    p = _python("import sys, ckptfmt, bridges; bad = [m for m in sys.modules if m.split('.')[0] in "
                "('ckptfmt_tools', 'typer', 'rich')]; assert not bad, bad")
    assert p.returncode == 0, p.stderr[-2000:]


def test_missing_cli_extra_names_the_extra():
    """Without typer (blocked in sys.modules), ``python -m ckptfmt`` says which extra to install
    and exits 2; the control, with typer, prints the help and exits 0."""
    run = "import runpy, sys; sys.argv = ['ckptfmt', '--help']; runpy.run_module('ckptfmt', run_name='__main__')"
    p = _python("import sys; sys.modules['typer'] = None; " + run)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "pip install 'ckptfmt[cli]'" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    p = _python(run)
    assert p.returncode == 0 and "Usage: ckptfmt" in p.stdout, p.stderr[-2000:]
