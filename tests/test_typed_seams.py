"""The typed seams between the core and the bridges (issue 49 item 2): a parameter, return or
field that holds a repository, checkpoint, storage, restore source, manifest or mapping chain
names its concrete type or a Protocol, never ``Any``, so that a reader or a tool can follow a
restore from the bridge through the planner into the mapping.

The count is read from the AST of ``ckptfmt/`` and ``bridges/``, and it is zero: ALLOWED is empty,
and an entry put there must still exist (remove it when it is typed). The bridges' mapping classes satisfy the core's Protocols (the core never imports them).
"""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import numpy as np

import ckptfmt
from ckptfmt import Box, LocalShard
from ckptfmt.interop import SafetensorsSource, export_safetensors, open_source
from ckptfmt.restoreplan import KeyMap, MappingChain, Resolution, RestoreManifest, TargetLeaf, plan_restore

from bridges.mapping import Chain, Mapping, Resolved, Rule

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ckptfmt", "bridges")
#: What a seam's name says it holds (the names the issue's grep matched).
SEAM = re.compile(r"repo|repository|ckpt|checkpoint|storage|source|chain|manifest", re.I)

#: The seams still ``Any``: none. Adding one is what this test refuses.
ALLOWED: frozenset[str] = frozenset()


def _is_any(node: ast.expr | None) -> bool:
    """``Any`` (or ``typing.Any``, ``"Any"``), alone or as a member of a union or an Optional."""
    if isinstance(node, ast.Name):
        return node.id == "Any"
    if isinstance(node, ast.Attribute):
        return node.attr == "Any"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return _is_any(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return False
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _is_any(node.left) or _is_any(node.right)
    if isinstance(node, ast.Subscript) and getattr(node.value, "id", getattr(node.value, "attr", None)) in ("Optional", "Union"):
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return any(_is_any(e) for e in elts)
    return False


def seams(rel: str, source: str) -> list[str]:
    """Each ``Any`` seam of one module: ``path::qualname(param)`` for a parameter,
    ``path::qualname.field`` for an annotated field (``self.x: Any`` too), ``path::qualname() -> Any``
    for the return of a function whose name says it gives one of those things."""
    out: list[str] = []

    def visit(node: ast.AST, qual: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{qual}{child.name}"
                a = child.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]:
                    if SEAM.search(arg.arg) and _is_any(arg.annotation):
                        out.append(f"{rel}::{name}({arg.arg})")
                if SEAM.search(child.name) and _is_any(child.returns):
                    out.append(f"{rel}::{name}() -> Any")
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{qual}{child.name}.")
            elif isinstance(child, ast.AnnAssign):
                t = child.target
                field = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else ""
                if field and SEAM.search(field) and _is_any(child.annotation):
                    owner = qual.rsplit(".", 2)[0] + "." if isinstance(t, ast.Attribute) and qual.endswith("__init__.") else qual
                    out.append(f"{rel}::{owner}{field}")
            else:
                visit(child, qual)

    visit(ast.parse(source), "")
    return out


def _repository_seams() -> list[str]:
    return sorted(s for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
                  for s in seams(str(p.relative_to(ROOT)), p.read_text()))


def test_no_seam_is_any_but_the_allowed_ones():
    found = _repository_seams()
    new = [s for s in found if s not in ALLOWED]
    assert not new, f"type these with the concrete class or a Protocol (ckptfmt.restoreplan, ckptfmt.agree): {new}"
    stale = sorted(ALLOWED - set(found))
    assert not stale, f"typed now: remove from ALLOWED {stale}"
    assert len(found) <= len(ALLOWED) == 0


def test_the_count_sees_a_new_seam():
    """Controls: each way of writing ``Any`` on a seam is counted; a typed seam, and ``Any`` on a
    name that holds none of those things, are not."""
    src = '''
from typing import Any, Optional
import typing
def f(repo: Any, step: Any, *, ckpt: "Any" = None, **source_kw: Any) -> None: ...
def open_checkpoint(url: str) -> Any: ...
def g(repo: Repository, storage: Storage | None, source: Optional[Any], chain: Any | None) -> Any: ...
class C:
    manifest: typing.Any
    step: Any
    def __init__(self) -> None:
        self.storage: Any = None
'''
    assert seams("x.py", src) == ["x.py::f(repo)", "x.py::f(ckpt)", "x.py::f(source_kw)", "x.py::open_checkpoint() -> Any",
                                  "x.py::g(source)", "x.py::g(chain)", "x.py::C.manifest", "x.py::C.storage"]
    assert seams("x.py", "def f(repo: Repository, chain: MappingChain | None = None) -> None: ...\n") == []


def _members(proto: type) -> set[str]:
    return {n for n in vars(proto) if not n.startswith("_")}


def _lacks(proto: type, obj: object) -> list[str]:
    """The Protocol's members ``obj`` lacks, and its methods whose parameter names differ."""
    out = []
    for name in sorted(_members(proto)):
        if not hasattr(obj, name):
            out.append(name)
            continue
        want = vars(proto)[name]
        if inspect.isfunction(want):
            got = getattr(obj, name)
            names = list(inspect.signature(want).parameters)[1:]
            if list(inspect.signature(got).parameters) != names:
                out.append(f"{name}{inspect.signature(got)}")
    return out


def test_the_bridges_mapping_satisfies_the_cores_protocols(tmp_path):
    """A restore through a mapping: its TensorPlan.chain is the bridges' Chain, which has what
    MappingChain names (so a tool can follow the restore into the mapping); Mapping and Resolved
    have what KeyMap and Resolution name; both sources' manifests have what RestoreManifest names.
    Control: an object without ``assemble`` is reported."""
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    url = str(tmp_path / "repo")
    ckptfmt.save(url, 1, [LocalShard("params/a/w", w.shape, w.dtype, Box.full(w.shape), w)])
    mapping = Mapping((Rule("params/{m}/w", "{m}.weight", {2: (1, 0)}),), source_sep="/", target_sep=".")
    src = open_source(url)
    plan = plan_restore(src, [TargetLeaf("a.weight", "array", (3, 2), np.dtype("float32"))], mapping)
    chain = plan.by_key["a.weight"].chain
    assert isinstance(chain, Chain) and _lacks(MappingChain, chain) == []
    assert chain.target_shape == (3, 2) and chain.reads(Box.full((3, 2))) == [("params/a/w", Box.full((2, 3)))]
    res = mapping.resolve("a.weight", 2, set(src.keys()))
    assert isinstance(res, Resolved) and _lacks(Resolution, res) == [] and _lacks(KeyMap, mapping) == []
    export_safetensors(url, str(tmp_path / "st"))
    st = open_source(str(tmp_path / "st"))
    assert isinstance(st, SafetensorsSource) and not isinstance(st.manifest, ckptfmt.Manifest)
    assert _lacks(RestoreManifest, src.manifest) == [] and _lacks(RestoreManifest, st.manifest) == []

    class NoAssemble:
        target_shape, target_dtype = (1,), np.dtype("float32")

        def reads(self, box: Box) -> list: ...

    assert _lacks(MappingChain, NoAssemble()) == ["assemble"]
