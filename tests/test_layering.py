"""The import graph runs one way (issue 14): ckptfmt <- bridges <- ckptfmt_tools.

ckptfmt imports neither bridges nor the tools (its one exception is ``ckptfmt/__main__.py``, the
command's entry point, which imports the tools' CLI when it runs); bridges never imports the
tools; the tools use only public bridge modules; ``import ckptfmt`` pulls in no tool and no CLI
dependency, and a missing CLI extra is reported with the extra to install. The core's third-party
imports are the dependencies pyproject.toml declares, and the docs name the same list.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

from devtools.archmetrics import imports_of  # the AST import reader the figures use too

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
    assert _offenders("ckptfmt", ("bridges", "ckptfmt_tools", "devtools"), allow=(ENTRY,)) == []
    assert _offenders("bridges", ("ckptfmt_tools", "devtools")) == []
    # The developer harnesses (devtools/, not packaged) use the packages; nothing packaged uses them.
    assert _offenders("ckptfmt_tools", ("devtools",)) == []
    # Broken control: the entry point is the one place ckptfmt names the tools, and it is seen.
    assert _offenders("ckptfmt", ("ckptfmt_tools",)) == ["ckptfmt/__main__.py imports ckptfmt_tools.cli"]


def _declared_dependencies() -> set[str]:
    """The import names of ``[project] dependencies`` in pyproject.toml (each distribution here is
    imported under its own name, with ``-`` read as ``_``)."""
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower().replace("-", "_") for d in deps}


def _undeclared(imports: dict[Path, set[str]], declared: set[str]) -> list[str]:
    return [f"{p.relative_to(ROOT)} imports {m}" for p, mods in imports.items() if p != ENTRY
            for m in sorted(mods) if m.split(".")[0] not in sys.stdlib_module_names | declared | {"ckptfmt"}]


def test_the_core_imports_only_its_declared_dependencies():
    """Every import in ckptfmt/ (function-level ones too) is the standard library, ckptfmt, or a
    dependency pyproject.toml declares, which never names jax, torch or flax; the README and the
    package docstring name that same list. Control: a module importing jax is reported."""
    declared = _declared_dependencies()
    assert declared == {"numpy", "tensorstore", "msgpack", "crc32c", "ml_dtypes"}
    assert _undeclared(_imports("ckptfmt"), declared) == []
    fake = {ROOT / "ckptfmt" / "x.py": {"numpy", "jax.numpy", "os.path"}}
    assert _undeclared(fake, declared) == ["ckptfmt/x.py imports jax.numpy"]
    said = "numpy, tensorstore, msgpack, crc32c and ml_dtypes only"
    for doc in ("README.md", "ckptfmt/__init__.py", "docs/getting-started.md", "docs/api/ckptfmt.md"):
        assert said in " ".join((ROOT / doc).read_text().split()), doc


def test_tools_use_public_bridge_apis_only():
    private = [f"{p.relative_to(ROOT)} imports {m}" for p, mods in _imports("ckptfmt_tools").items()
               for m in sorted(mods) if m.startswith("bridges.") and m.split(".")[1].startswith("_")]
    assert private == []


def _private_core_imports(imports: dict[Path, set[str]]) -> list[str]:
    return [f"{p.relative_to(ROOT)} imports {m}" for p, mods in imports.items() for m in sorted(mods)
            if m.startswith("ckptfmt.") and any(part.startswith("_") for part in m.split(".")[1:])]


def test_bridges_use_the_cores_named_interfaces_only():
    """No bridge imports a private core module (issue 49: 11 such lines before); what the bridges
    need is exported by a core subpackage's face. Control: a bridge module importing
    ckptfmt.manager._payload is reported."""
    assert _private_core_imports(_imports("bridges")) == []
    fake = {ROOT / "bridges" / "_x.py": {"ckptfmt.manager._payload", "ckptfmt.manager", "ckptfmt"}}
    assert _private_core_imports(fake) == ["bridges/_x.py imports ckptfmt.manager._payload"]


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_import_ckptfmt_loads_no_tool_and_no_cli_dependency():
    p = _python("import sys, ckptfmt, bridges; bad = [m for m in sys.modules if m.split('.')[0] in "
                "('ckptfmt_tools', 'typer', 'rich')]; assert not bad, bad")
    assert p.returncode == 0, p.stderr[-2000:]


FRAMEWORK_FACES = (("bridges.jax", "jax", "jax"), ("bridges.flax", "flax", "jax"),
                   ("bridges.torch", "torch", "torch"), ("bridges.dcp", "torch", "torch"))


def test_missing_framework_names_the_extra():
    """A bridge face imported without its framework (blocked in sys.modules, as if not installed)
    raises a ModuleNotFoundError that names the extra to install; control: with the framework
    installed, the same import works. (tests/test_wheel.py sees the same in a venv without jax.)"""
    for face, framework, extra in FRAMEWORK_FACES:
        code = (f"import sys; sys.modules[{framework!r}] = None\ntry:\n    import {face}\n"
                f"except ModuleNotFoundError as e:\n    print(e); sys.exit(3)")
        p = _python(code)
        assert p.returncode == 3, (face, p.returncode, p.stderr[-2000:])
        assert f"pip install 'ckptfmt[{extra}]'" in p.stdout and face in p.stdout, p.stdout
    for face in ("bridges.jax", "bridges.torch"):
        p = _python(f"import {face}")
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


# ------------------------------------------------------------------ subpackages (issue 25 item 6)
# The one table of ckptfmt's subpackages and what each may import. The reorganisation script writes
# the block between the two marker lines; everything else in this file reads it from here.
# FLOOR: top-level modules that every module may import and that import only each other.
# SHIMS: top-level modules kept so a public import path still works: name -> the module it re-exports.
# SUBPACKAGES: subpackage -> the subpackages it may import (the floor is always allowed).
# CROSSINGS: imports that break the table today, each with its reason; each must still exist.
# --- subpackage rules (written by the reorganisation) ---
FLOOR: tuple[str, ...] = ("_boxcols", "_types", "_version", "agree", "checksum", "coord", "dtypes", "errors", "gcpause", "geometry",
                          "layout", "plan", "rankstate", "readplan", "restoreplan", "state")
SHIMS: dict[str, str] = {"asyncsave": "ckptfmt.session.asyncsave"}
SUBPACKAGES: dict[str, tuple[str, ...]] = {
    "shard": (),
    "manifest": ("shard",),
    "storage": (),
    "reader": ("manifest", "storage", "shard"),
    "repository": ("manifest", "storage", "reader"),
    "session": ("manifest", "storage", "shard", "repository"),
    "interop": ("manifest", "storage", "reader", "repository", "session"),
    "manager": ("manifest", "reader", "repository", "session"),
}
CROSSINGS: dict[tuple[str, str], str] = {}
# --- end of subpackage rules ---
FACES = ("__init__", "__main__")  # the package's face and its entry point may import anything


def _group(root: Path, mod: str, floor: tuple[str, ...], shims: dict[str, str]) -> str:
    """"face", "floor", "shim", a subpackage's name, or "?" for a top-level module in no list."""
    parts = mod.split(".")[1:]
    if not parts:
        return "face"
    if len(parts) == 1 and not (root / "ckptfmt" / parts[0] / "__init__.py").is_file():
        name = parts[0]
        return "face" if name in FACES else "floor" if name in floor else "shim" if name in shims else "?"
    return parts[0]


def subpackage_offenders(root: Path, floor: tuple[str, ...], shims: dict[str, str],
                         subpackages: dict[str, tuple[str, ...]],
                         crossings: dict[tuple[str, str], str]) -> list[str]:
    """Every import inside ``root/ckptfmt`` that the rules forbid, as readable lines (empty: all
    kept). Eager, deferred and type-only imports all count; a crossing that no longer occurs is
    reported too, so that the table shrinks when the code improves."""
    mods, edges, _ = imports_of(root, "ckptfmt")
    out: list[str] = []
    group = {m: _group(root, m, floor, shims) for m in mods}
    for m, g in sorted(group.items()):
        if g == "?":
            out.append(f"{mods[m].relative_to(root)} is in no subpackage and not in FLOOR or SHIMS")
        elif g not in ("face", "floor", "shim") and g not in subpackages:
            out.append(f"{mods[m].relative_to(root)} is in subpackage {g!r}, which the table does not name")
    for sub, may in sorted(subpackages.items()):
        init = root / "ckptfmt" / sub / "__init__.py"
        if not init.is_file():
            out.append(f"the table names subpackage {sub!r} but ckptfmt/{sub}/__init__.py does not exist")
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        want = "May import: " + ", ".join(("floor",) + tuple(may)) + "."
        if want not in " ".join(doc.split()):
            out.append(f"ckptfmt/{sub}/__init__.py: its docstring must say {want!r} (the table's rule)")
    seen: set[tuple[str, str]] = set()
    for e in edges:
        gs, gd = group[e.src], group[e.dst]
        if gs == "face" or gs == gd:
            continue
        if gs == "shim":
            if e.dst == shims[e.src.split(".")[-1]]:
                continue
        elif gd == "floor" or (gs not in ("floor", "?") and gd in subpackages.get(gs, ())):
            continue
        if (e.src, e.dst) in crossings:
            seen.add((e.src, e.dst))
            continue
        allowed = "the floor only" if gs == "floor" else "its target only" if gs == "shim" else \
            "the floor" + "".join(f", {s}" for s in subpackages.get(gs, ()))
        out.append(f"{mods[e.src].relative_to(root)}:{e.line} ({gs}) imports {e.dst} ({gd}, {e.kind}); "
                   f"{gs} may import {allowed}")
    out += [f"crossing {a} -> {b} ({why}) no longer occurs: remove it from CROSSINGS"
            for (a, b), why in sorted(crossings.items()) if (a, b) not in seen]
    return out


def test_subpackages_import_only_what_they_may():
    if not SUBPACKAGES:  # the flat layout: a new subpackage must be entered in the table
        assert [p.parent.name for p in (ROOT / "ckptfmt").glob("*/__init__.py")] == []
        return
    assert subpackage_offenders(ROOT, FLOOR, SHIMS, SUBPACKAGES, CROSSINGS) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_a_forbidden_import_is_rejected(tmp_path):
    """Broken controls of the subpackage rules on a small tree: the tree as written passes; a
    lower subpackage importing a higher one, a floor module importing a subpackage, a module in no
    subpackage, a docstring that does not state its rule and a stale crossing are each named."""
    rules = dict(floor=("errors",), shims={"old": "ckptfmt.high.old"},
                 subpackages={"low": (), "high": ("low",)}, crossings={})
    files = {"ckptfmt/__init__.py": "from .high.old import f as f\n",
             "ckptfmt/errors.py": '"""Errors."""\n',
             "ckptfmt/old.py": "from ckptfmt.high.old import f as f\n",
             "ckptfmt/low/__init__.py": '"""Low. May import: floor."""\n',
             "ckptfmt/low/_a.py": "from ckptfmt.errors import *\n",
             "ckptfmt/high/__init__.py": '"""High. May import: floor, low."""\n',
             "ckptfmt/high/old.py": "from ckptfmt.low import _a\n\ndef f():\n    from ckptfmt.low._a import x\n"}
    _write(tmp_path, files)
    ok = lambda **kw: subpackage_offenders(tmp_path, **{**rules, **kw})  # noqa: E731
    assert ok() == []
    _write(tmp_path, {"ckptfmt/low/_a.py": "def g():\n    from ckptfmt.high import old\n"})
    assert ok() == ["ckptfmt/low/_a.py:2 (low) imports ckptfmt.high.old (high, deferred); low may import the floor"]
    assert ok(crossings={("ckptfmt.low._a", "ckptfmt.high.old"): "known"}) == []
    _write(tmp_path, files)
    assert ok(crossings={("ckptfmt.low._a", "ckptfmt.high.old"): "known"}) == [
        "crossing ckptfmt.low._a -> ckptfmt.high.old (known) no longer occurs: remove it from CROSSINGS"]
    _write(tmp_path, {"ckptfmt/errors.py": "from ckptfmt.low import _a\n"})
    assert ok() == ["ckptfmt/errors.py:1 (floor) imports ckptfmt.low._a (low, eager); floor may import the floor only"]
    _write(tmp_path, files)
    _write(tmp_path, {"ckptfmt/stray.py": "x = 1\n"})
    assert ok() == ["ckptfmt/stray.py is in no subpackage and not in FLOOR or SHIMS"]
    (tmp_path / "ckptfmt/stray.py").unlink()
    _write(tmp_path, {"ckptfmt/high/__init__.py": '"""High. May import: floor."""\n'})
    assert ok() == ["ckptfmt/high/__init__.py: its docstring must say 'May import: floor, low.' (the table's rule)"]


def test_the_real_tree_rejects_an_injected_forbidden_import(tmp_path):
    """Broken control on a copy of the real tree: the copy passes as it is, and one import from the
    lowest subpackage up into the highest is named."""
    if not SUBPACKAGES:
        return  # the flat layout has no subpackage to break; the small tree above covers the rules
    shutil.copytree(ROOT / "ckptfmt", tmp_path / "ckptfmt", ignore=shutil.ignore_patterns("__pycache__"))
    assert subpackage_offenders(tmp_path, FLOOR, SHIMS, SUBPACKAGES, CROSSINGS) == []
    low = min(SUBPACKAGES, key=lambda s: (len(SUBPACKAGES[s]), s))
    high = max(SUBPACKAGES, key=lambda s: (len(SUBPACKAGES[s]), s))
    victim = sorted((tmp_path / "ckptfmt" / low).glob("*.py"))[-1]
    victim.write_text(victim.read_text() + f"\n\ndef _injected():\n    import ckptfmt.{high}\n")
    bad = subpackage_offenders(tmp_path, FLOOR, SHIMS, SUBPACKAGES, CROSSINGS)
    assert len(bad) == 1 and f"({low}) imports ckptfmt.{high} ({high}, deferred)" in bad[0], bad


def test_import_ckptfmt_loads_tensorstore_only_when_a_repository_opens(tmp_path):
    """``import ckptfmt`` stays quick (issue 30 item 4): tensorstore is imported when a repository
    (its storage) is opened. Control: opening one does import it, so the first check is not vacuous."""
    p = _python("import sys, ckptfmt; assert 'tensorstore' not in sys.modules, 'imported at import'")
    assert p.returncode == 0, p.stderr[-2000:]
    p = _python(f"import sys, ckptfmt; ckptfmt.Repository({str(tmp_path / 'r')!r}).steps(); "
                "assert 'tensorstore' in sys.modules, 'not imported by an open repository'")
    assert p.returncode == 0, p.stderr[-2000:]


def _module_graph() -> dict[str, set[str]]:
    """Module -> the ckptfmt modules it imports (eager and function-level; TYPE_CHECKING imports
    and the package face ``ckptfmt/__init__.py``, which may import anything, left out), read by the
    same AST reader as the architecture figures, subpackages included."""
    mods, edges, _ = imports_of(ROOT, "ckptfmt")
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges:
        if e.kind != "type-only" and e.src != "ckptfmt":
            graph[e.src].add(e.dst)
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
    assert _cycles(graph) == [{"ckptfmt.storage", "ckptfmt.storage._filestore", "ckptfmt.storage._kvstore"}]
    graph["ckptfmt.shard"] = graph["ckptfmt.shard"] | {"ckptfmt.session"}  # control: the record importing the protocol
    assert any({"ckptfmt.shard", "ckptfmt.session"} <= c for c in _cycles(graph))


# ------------------------------------------------------------------ the bridges' subpackages (issue 49)
#: What each part of ``bridges`` may import of the others (besides ckptfmt's public faces); the
#: faces' docstrings say the same. ``mapping`` and ``presets`` import no framework.
BRIDGES_MAY_IMPORT: dict[str, set[str]] = {
    "_contract": set(), "_extra": set(), "_requires": set(),
    "mapping": set(),
    "presets": {"mapping"},
    "jax": {"_contract", "_extra", "_requires", "mapping"},
    "torch": {"_contract", "_extra", "_requires", "mapping"},
    "flax": {"jax", "_requires"},
    "dcp": {"torch", "_contract", "_extra", "_requires", "mapping"},
    "torchtitan": {"dcp"},
    "interop": {"jax", "torch", "mapping", "presets", "_contract", "_extra", "_requires"},
}


def _bridge_part(path: Path) -> str:
    rel = path.relative_to(ROOT / "bridges").parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _bridge_crossings(imports: dict[Path, set[str]]) -> list[str]:
    bad = []
    for p, mods in imports.items():
        part = _bridge_part(p)
        if part == "__init__":
            continue
        for m in sorted(mods):
            bits = m.split(".")
            if bits[0] != "bridges" or len(bits) < 2 or bits[1] == part:
                continue
            if bits[1] not in BRIDGES_MAY_IMPORT.get(part, set()):
                bad.append(f"{p.relative_to(ROOT)} imports {m}")
    return bad


def _bridge_imports() -> dict[Path, set[str]]:
    out = _imports("bridges")
    for p in out:  # "from bridges import presets" names a part too
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "bridges":
                out[p] |= {f"bridges.{a.name}" for a in node.names}
    return out


def test_bridges_parts_import_only_what_they_may():
    """The bridges' subpackages by concern import each other one way (BRIDGES_MAY_IMPORT): the
    mapping language at the bottom, then the presets and the frameworks' bridges, then DCP, flax
    and interop. Control: the mapping importing the JAX bridge is reported."""
    assert set(BRIDGES_MAY_IMPORT) == {_bridge_part(p) for p in (ROOT / "bridges").rglob("*.py")} - {"__init__"}
    assert _bridge_crossings(_bridge_imports()) == []
    fake = {ROOT / "bridges" / "mapping" / "_rules.py": {"bridges.jax._tree", "bridges.mapping._chain"}}
    assert _bridge_crossings(fake) == ["bridges/mapping/_rules.py imports bridges.jax._tree"]
    # Within interop, only the two importers that need a framework import a framework's bridge.
    importers = {ROOT / "bridges" / "interop" / "_orbax.py", ROOT / "bridges" / "interop" / "_dcp.py"}
    assert importers <= set((ROOT / "bridges" / "interop").glob("*.py"))
    assert [f"{p.relative_to(ROOT)} imports {m}" for p, mods in _bridge_imports().items()
            if _bridge_part(p) == "interop" and p not in importers
            for m in sorted(mods) if m.split(".")[:2] in (["bridges", "jax"], ["bridges", "torch"])] == []


def _bridge_module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for p, mods in _bridge_imports().items():
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m for m in mods if m.startswith("bridges.")}
    return {k: {m for m in v if m in graph and m != k} for k, v in graph.items()}


def test_no_import_cycle_inside_bridges():
    """No two bridge modules import each other, directly or through others (faces excepted:
    a package's face imports its own modules, and those never import the face)."""
    graph = _bridge_module_graph()
    faces = {k for k in graph if (ROOT / k.replace(".", "/") / "__init__.py").exists()}
    inner = {k: v - faces for k, v in graph.items() if k not in faces}
    assert _cycles(inner) == []
    assert _cycles({"bridges.a": {"bridges.b"}, "bridges.b": {"bridges.a"}}) != []  # control


# ------------------------------------------------------------------ function-level imports (issue 49)
#: Every import inside a function in the library, with why it cannot stand at the top of its module.
#: Each of the others that issue 49 found (46 in bridges/) hid a circle that was not there any more,
#: a module that already needed its framework, or a name taken from a sibling; they moved to the
#: top. A new one fails the test below: fix the structure (move the shared piece down, pass an
#: object in), or enter it here with its reason.
FUNCTION_LEVEL_IMPORTS: dict[tuple[str, str], str] = {
    ("ckptfmt.__main__", "ckptfmt_tools.cli"):
        "the command's entry point: `import ckptfmt` loads no tool and no CLI dependency",
    ("ckptfmt.shard._codec", "tensorstore"): "`import ckptfmt` stays quick: tensorstore loads when a shard is decoded",
    ("ckptfmt.storage", "ckptfmt.storage._filestore"):
        "the backends subclass Storage and import tensorstore: loaded when a repository opens",
    ("ckptfmt.storage", "ckptfmt.storage._kvstore"): "as ckptfmt.storage._filestore",
    ("ckptfmt.session._shardwriter", "ckptfmt.storage._kvstore"): "tensorstore's zarr.json: loaded once a save runs",
    ("bridges.interop._api", "bridges.interop._orbax"):
        "bridges.interop imports no framework; the Orbax importer needs jax and Orbax",
    ("bridges.interop._api", "bridges.interop._dcp"): "bridges.interop imports no framework; the DCP importer needs torch",
    ("bridges.jax._peer", "jax.experimental"):
        "jax.experimental.transfer is experimental, and a multi-process local tier alone needs it",
}


def function_level_offenders(root: Path, allowed: dict[tuple[str, str], str]) -> list[str]:
    """Each function-level import in ``root``'s ckptfmt/ and bridges/ that ``allowed`` does not list,
    and each listed one that no longer occurs (so that the table shrinks with the code)."""
    found: dict[tuple[str, str], list[str]] = {}
    for package in ("ckptfmt", "bridges"):
        if (root / package).is_dir():
            mods, _, deferred = imports_of(root, package)
            for mod, line, what in deferred:
                found.setdefault((mod, what), []).append(f"{mods[mod].relative_to(root)}:{line}")
    out = [f"{where} imports {what} inside a function, and FUNCTION_LEVEL_IMPORTS gives no reason"
           for (mod, what), wheres in sorted(found.items()) if (mod, what) not in allowed for where in wheres]
    return out + [f"{mod} no longer imports {what} inside a function: remove it from FUNCTION_LEVEL_IMPORTS"
                  for (mod, what) in sorted(allowed) if (mod, what) not in found]


def test_function_level_imports_are_the_listed_ones():
    assert function_level_offenders(ROOT, FUNCTION_LEVEL_IMPORTS) == []
    assert all(why.strip() for why in FUNCTION_LEVEL_IMPORTS.values())


def test_a_new_function_level_import_is_named(tmp_path):
    """Broken control on a small tree: a listed import passes; an unlisted one, and a listed one
    that is gone, are each named."""
    _write(tmp_path, {"bridges/__init__.py": "", "bridges/a.py": "def f():\n    import torch\n",
                      "bridges/b.py": "from bridges import a\n"})
    listed = {("bridges.a", "torch"): "needs torch"}
    assert function_level_offenders(tmp_path, listed) == []
    _write(tmp_path, {"bridges/b.py": "def g():\n    from bridges.a import f\n"})
    assert function_level_offenders(tmp_path, listed) == [
        "bridges/b.py:2 imports bridges.a inside a function, and FUNCTION_LEVEL_IMPORTS gives no reason"]
    _write(tmp_path, {"bridges/a.py": "import torch\n", "bridges/b.py": ""})
    assert function_level_offenders(tmp_path, listed) == [
        "bridges.a no longer imports torch inside a function: remove it from FUNCTION_LEVEL_IMPORTS"]
