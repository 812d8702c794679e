"""No test replaces a private method of a ckptfmt class, or a private function of a ckptfmt
module (STYLE.md: "tests that monkeypatch private methods: pass the collaborator in"). A broken
control passes a weakened collaborator instead, such as a :class:`ckptfmt.reader.BlockChecks`
subclass given to ``Repository(..., checks=...)``, a weaker last look given to gc's
``collect(..., look=...)`` or other owners given to ``plan_save(..., owners=...)``.

The scan reads every test file's AST and finds ``setattr(X, "_name", ...)``,
``monkeypatch.setattr(X, "_name", ...)``, ``monkeypatch.setattr("pkg.X._name", ...)`` and
``patch.object(X, "_name", ...)`` where ``X`` resolves, through the file's imports, to a class
defined under ``ckptfmt`` or to a ckptfmt module; and a dotted path ``"ckptfmt.x.Y._name"`` held in
a table (a tuple or list, such as a parametrize list whose targets a loop hands to
``monkeypatch.setattr``) as a pair ``(path, value)``: the same patch, one step removed.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
#: (file, line, what) that may patch a private method of a ckptfmt class or a private function of a
#: ckptfmt module: none.
ALLOWED: set[tuple[str, int, str]] = set()


def _imports(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted path, for the names a file imports from ckptfmt."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "ckptfmt":
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "ckptfmt":
                    names[a.asname or a.name.split(".")[0]] = a.name if a.asname else "ckptfmt"
    return names


def _dotted(expr: ast.expr, names: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in names:
        return None
    return ".".join([names[expr.id], *reversed(parts)])


def _resolve(path: str) -> Any:
    """The object at a dotted path (the longest importable module, then attributes), or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            return None
        return obj
    return None


def _is_ckptfmt_class(path: str | None) -> bool:
    """A class defined under ckptfmt, or a ckptfmt module (whose private functions count too)."""
    obj = _resolve(path) if path else None
    if inspect.ismodule(obj):
        return obj.__name__.split(".")[0] == "ckptfmt"
    return inspect.isclass(obj) and obj.__module__.split(".")[0] == "ckptfmt"


_DOTTED = re.compile(r"ckptfmt(\.[A-Za-z_]\w*)+")


def _private_target(path: str) -> bool:
    """``path`` names a private attribute of a ckptfmt class or module."""
    owner, _, attr = path.rpartition(".")
    return attr.startswith("_") and not attr.startswith("__") and _is_ckptfmt_class(owner)


def private_patches(source: str, filename: str = "<test>") -> list[tuple[str, int, str]]:
    """Every place in ``source`` that sets a private attribute on a ckptfmt class, or holds the
    dotted path of one in a table."""
    tree = ast.parse(source, filename)
    names = _imports(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2:  # ("ckptfmt.x._y", value): a patch by table
            e = node.elts[0]
            if (isinstance(e, ast.Constant) and isinstance(e.value, str) and _DOTTED.fullmatch(e.value)
                    and not inspect.ismodule(_resolve(e.value)) and _private_target(e.value)):
                found.append((filename, e.lineno, e.value))
            continue
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if fname not in ("setattr", "object") or not node.args:
            continue
        if fname == "object" and not (isinstance(f, ast.Attribute) and isinstance(f.value, (ast.Name, ast.Attribute))
                                      and (f.value.attr if isinstance(f.value, ast.Attribute) else f.value.id) == "patch"):
            continue
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):  # monkeypatch.setattr("a.B._c", v)
            if _private_target(first.value):
                found.append((filename, node.lineno, first.value))
            continue
        if len(node.args) < 2 or not (isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            continue
        attr = node.args[1].value
        if attr.startswith("_") and not attr.startswith("__"):
            owner_path = _dotted(first, names)
            if _is_ckptfmt_class(owner_path):
                found.append((filename, node.lineno, f"{owner_path}.{attr}"))
    return found


def test_no_test_patches_a_private_method_of_a_ckptfmt_class():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = str(path.relative_to(TESTS.parent))
        found += private_patches(path.read_text(), rel)
    assert set(found) - ALLOWED == set(), "pass the collaborator in instead: " + repr(sorted(set(found) - ALLOWED))
    assert not ALLOWED


def test_control_the_scan_finds_the_old_broken_controls():
    """The monkeypatches this replaced, in each spelling, are found, a module's private function
    too; a public method or function is not."""
    src = '''
from ckptfmt.reader import Checkpoint
from ckptfmt import reader as rd
import ckptfmt.repository
from ckptfmt.repository import _gc
from unittest import mock

def test_x(monkeypatch):
    monkeypatch.setattr(Checkpoint, "_check_chunk", staticmethod(lambda *a, **k: None))
    monkeypatch.setattr(rd.Checkpoint, "_starts", None)
    setattr(ckptfmt.repository.Repository, "_read_manifest_bytes", None)
    monkeypatch.setattr("ckptfmt.reader.Checkpoint._plain_dirs", None)
    mock.patch.object(Checkpoint, "_threads")
    monkeypatch.setattr(_gc, "_settle", None)
    monkeypatch.setattr(Checkpoint, "read", None)
    monkeypatch.setattr("ckptfmt.plan._regular_owners", None)
    monkeypatch.setattr("ckptfmt.session.excluded", None)
    monkeypatch.setattr(_gc, "collect", None)
'''
    got = sorted((line, what) for _, line, what in private_patches(src))
    assert got == [(9, "ckptfmt.reader.Checkpoint._check_chunk"), (10, "ckptfmt.reader.Checkpoint._starts"),
                   (11, "ckptfmt.repository.Repository._read_manifest_bytes"),
                   (12, "ckptfmt.reader.Checkpoint._plain_dirs"), (13, "ckptfmt.reader.Checkpoint._threads"),
                   (14, "ckptfmt.repository._gc._settle"), (16, "ckptfmt.plan._regular_owners")]


def test_control_the_scan_finds_a_patch_through_a_table():
    """The gc controls of before named their targets in a parametrize table and patched them in a
    loop: each private target in the table is found; a public one, and a private name that is not
    a ckptfmt path, are not."""
    src = '''
import pytest

@pytest.mark.parametrize("name, patches", [
    ("gc-not-a-repository", [("ckptfmt.repository._gc._recognise", lambda *a: None)]),
    ("gc-shared-save-id", [("ckptfmt.repository._gc._mentions", lambda data, candidates: set()),
                           ("ckptfmt.repository._gc._DECLARED", None)]),
    ("gc-symlink-escape", [("ckptfmt.storage._filestore.LocalFileStorage.delete_prefix", None)]),
    ("other", [("numpy._core", None), ("ckptfmt.repository._gc.GcChecks", None)]),
])
def test_x(name, patches, monkeypatch):
    for target, value in patches:
        monkeypatch.setattr(target, value)
'''
    got = sorted((line, what) for _, line, what in private_patches(src))
    assert got == [(5, "ckptfmt.repository._gc._recognise"), (6, "ckptfmt.repository._gc._mentions"),
                   (7, "ckptfmt.repository._gc._DECLARED")]
