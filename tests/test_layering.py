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


def test_import_ckptfmt_loads_tensorstore_only_when_a_repository_opens(tmp_path):
    """``import ckptfmt`` stays quick (issue 30 item 4): tensorstore is imported when a repository
    (its storage) is opened. Control: opening one does import it, so the first check is not vacuous."""
    p = _python("import sys, ckptfmt; assert 'tensorstore' not in sys.modules, 'imported at import'")
    assert p.returncode == 0, p.stderr[-2000:]
    p = _python(f"import sys, ckptfmt; ckptfmt.Repository({str(tmp_path / 'r')!r}).steps(); "
                "assert 'tensorstore' in sys.modules, 'not imported by an open repository'")
    assert p.returncode == 0, p.stderr[-2000:]


def _module_graph() -> dict[str, set[str]]:
    """Module -> the ckptfmt modules it imports (relative imports anywhere in it, function-level
    included; TYPE_CHECKING blocks excluded)."""
    mods = {p.stem: p for p in (ROOT / "ckptfmt").glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()

        def visit(node: ast.AST) -> None:
            for ch in ast.iter_child_nodes(node):
                if isinstance(ch, ast.If) and "TYPE_CHECKING" in ast.unparse(ch.test):
                    continue
                if isinstance(ch, ast.ImportFrom) and ch.level == 1:
                    deps.update([ch.module.split(".")[0]] if ch.module else [a.name for a in ch.names])
                visit(ch)

        visit(ast.parse(path.read_text()))
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module."""
    reach = {m: set() for m in graph}
    for m in graph:
        todo = list(graph[m])
        while todo:
            d = todo.pop()
            if d not in reach[m]:
                reach[m].add(d)
                todo.extend(graph[d])
    comps = {frozenset({m} | {d for d in reach[m] if m in reach[d]}) for m in graph}
    return sorted((set(c) for c in comps if len(c) > 1), key=sorted)


def test_no_import_cycle_inside_ckptfmt():
    """Issue 25: the writer, reader and protocol no longer import each other. The one pair left is
    storage.open_storage importing the backends it picks (they subclass Storage, and import
    tensorstore, so they load when a repository opens). Control: a made-up back edge is found."""
    graph = _module_graph()
    assert _cycles(graph) == [{"storage", "_filestore", "_kvstore"}]
    graph["shard"] = graph["shard"] | {"session"}  # control: the writer's record importing the protocol
    assert any({"shard", "session"} <= c for c in _cycles(graph))
