"""One name, one idea (STYLE.md): no class, and no public function, is defined under the same
name in two modules of ``ckptfmt`` and ``bridges``, unless :data:`SAME_IDEA` says why the two are
one idea. The modules are read as source (``ast``), so that the check needs neither jax nor torch:
a top-level ``def`` or ``class`` is exactly what ``obj.__module__ == module`` would find.

A private function (``_fail``, ``_open``) is its module's own helper, not a word of the format's
vocabulary, and is not checked.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ckptfmt", "bridges")

_VERB = "the same verb in the core and in each framework's bridge (STYLE.md: every bridge has the same verbs)"
_PEER = "the same verb of the local tier's peer answer in each framework's bridge (_jaxpeer, _torchpeer)"
_FACE = "bridges.interop's public face over the importer module of the same name, with the same arguments"
#: Names defined in several modules on purpose: the same idea each time.
SAME_IDEA = {
    "save": _VERB,                # ckptfmt.session, bridges.jax, bridges.torch
    "CheckpointManager": _VERB,   # ckptfmt.manager, bridges.jax._manager, bridges.torch._manager
    "load_rank_state": _VERB,     # bridges.jax._restore, bridges.torch._load
    "load_extra": _VERB,
    "requests": _PEER, "build": _PEER,
    "import_dcp": _FACE, "import_orbax": _FACE,
    "dtype_name": "the format's name of a framework's dtype: numpy's (ckptfmt.dtypes), torch's (bridges.torch._conv)",
    "main": "a process's entry point (python -m ckptfmt; the export worker)",
    "closest_key": "the key most like a missing one, for an error message (the core's also matches its kind)",
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, str]:
    return {_module(p): p.read_text() for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _top_level(body: list[ast.stmt]) -> list[str]:
    """Names a module body defines with ``def`` or ``class``, in ``if``/``try`` blocks too."""
    out: list[str] = []
    for node in body:
        if isinstance(node, ast.ClassDef):
            out.append(node.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            out.append(node.name)
        elif isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                out += _top_level(block)
    return out


def _definitions(sources: dict[str, str]) -> dict[str, list[str]]:
    """name -> the modules that define it."""
    where: dict[str, list[str]] = defaultdict(list)
    for module, text in sources.items():
        for name in dict.fromkeys(_top_level(ast.parse(text).body)):
            where[name].append(module)
    return dict(where)


def _duplicates(sources: dict[str, str]) -> dict[str, list[str]]:
    return {n: ms for n, ms in _definitions(sources).items() if len(ms) > 1 and n not in SAME_IDEA}


def test_no_name_is_defined_twice_with_two_meanings():
    """Issue 49: JaxExchange, TorchExchange, pack_boxes and Lease each named two things (now
    JaxPeerExchange, TorchPeerExchange, pack_payload, StoredLease). Control: a second ``Lease``
    class, and a second ``pack_boxes``, are reported."""
    sources = _sources()
    assert len(sources) > 50 and "ckptfmt.layout" in sources and "bridges.presets" in sources
    assert _duplicates(sources) == {}
    fake = dict(sources, **{"bridges._fake": "class Lease:\n    pass\n\nif True:\n    def pack_boxes(): ...\n"})
    assert _duplicates(fake) == {"Lease": ["ckptfmt.layout", "bridges._fake"],
                                 "pack_boxes": ["ckptfmt._boxcols", "bridges._fake"]}
    private = dict(sources, **{"bridges._fake": "def _fail(): ...\n"})
    assert _duplicates(private) == {}  # a module's own helper is not checked


def test_every_allowed_duplicate_is_still_defined_twice():
    """An entry of SAME_IDEA whose duplicate is gone is removed with it, so that the table stays
    the list of real exceptions. Control: a name defined once is reported."""
    where = _definitions(_sources())
    assert [n for n in SAME_IDEA if len(where.get(n, ())) < 2] == []
    assert [n for n in ("Lease",) if len(where.get(n, ())) < 2] == ["Lease"]
