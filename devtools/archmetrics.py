"""Architecture figures of a checkout, printed as markdown: ``python -m devtools.archmetrics [ROOT]``.

Reads the source with the standard library's ``ast`` only (nothing of the project is imported or
run), so it measures any tree, before or after a reorganisation, with one command:

- the import graph inside ``ckptfmt/`` (or ``bridges/``, ``--package bridges``): its layers, its
  cycles and the imports that run back up;
- the function-level imports in that package;
- the longest functions and the modules at or over 500 lines in ``ckptfmt/`` and ``bridges/``;
- for a tree with subpackages, which subpackage imports which.

An import is *eager* (module level, run at import), *type-only* (under ``if TYPE_CHECKING:``) or
*deferred* (inside a function). Layer 1 holds the modules that eagerly import no other module of
the package; a module's layer is one above the highest it imports eagerly (the members of an eager
cycle share one layer). An import runs back up when it reaches a module on the importer's layer or
above. The package's own ``__init__.py`` (its face) and ``__main__.py`` are left out of the graph.
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "ckptfmt"
LIBRARY = ("ckptfmt", "bridges")
LONG_MODULE = 500
LONG_FUNCTION = (50, 80)


@dataclass(frozen=True)
class Import:
    """One import of a package module by another: who, whom, where, and when it runs."""
    src: str
    dst: str
    line: int
    kind: str  # "eager", "type-only" or "deferred"


@dataclass(frozen=True)
class Function:
    path: str
    name: str
    line: int
    lines: int


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root/package`` (a package's
    ``__init__.py`` is named by the package)."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_imports(tree: ast.Module):
    """Yield (node, kind) for every import statement in the module."""
    def visit(node: ast.AST, kind: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(child, "deferred")
            elif isinstance(child, ast.If) and kind == "eager" and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), "type-only")
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from visit(child, kind)
    yield from visit(tree, "eager")


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(root: Path, package: str) -> tuple[dict[str, Path], list[Import], list[tuple[str, int, str]]]:
    """The package's modules, its imports of its own modules, and every function-level import
    statement (module, line, what it imports) whatever it imports."""
    mods = module_names(root, package)
    edges: list[Import] = []
    deferred: list[tuple[str, int, str]] = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_pkg = path.name == "__init__.py"
        for node, kind in _walk_imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
                targets = names
            else:
                base = _absolute(mod, is_pkg, node)
                names = [f"{base}.{a.name}" if base else a.name for a in node.names]
                targets = [n if n in mods else base for n in names]
            if kind == "deferred":
                deferred.append((mod, node.lineno, ", ".join(sorted(set(names if isinstance(node, ast.Import)
                                                                      else [_absolute(mod, is_pkg, node)])))))
            for t in dict.fromkeys(targets):
                while t and t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != mod:
                    edges.append(Import(mod, t, node.lineno, kind))
    return mods, edges, deferred


def strongly_connected(nodes: list[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively; components in reverse topological order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(succ.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def layers(nodes: list[str], edges: list[Import]) -> dict[str, int]:
    """Layer of each module over the eager imports (a cycle's members share a layer)."""
    succ: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        if e.kind == "eager":
            succ[e.src].add(e.dst)
    comps = strongly_connected(nodes, succ)
    comp_of = {m: i for i, c in enumerate(comps) for m in c}
    layer_of_comp: dict[int, int] = {}
    for i, comp in enumerate(comps):  # reverse topological: what a component imports comes first
        below = [layer_of_comp[comp_of[d]] for m in comp for d in succ[m] if comp_of[d] != i]
        layer_of_comp[i] = 1 + max(below, default=0)
    return {m: layer_of_comp[comp_of[m]] for m in nodes}


def cycles(nodes: list[str], edges: list[Import], kinds: tuple[str, ...]) -> list[list[str]]:
    succ: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        if e.kind in kinds:
            succ[e.src].add(e.dst)
    return sorted((c for c in strongly_connected(nodes, succ) if len(c) > 1), key=lambda c: (-len(c), c))


def functions(root: Path, package: str) -> list[Function]:
    out: list[Function] = []
    for path in sorted((root / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    out.append(Function(str(path.relative_to(root)), name, child.lineno,
                                        child.end_lineno - child.lineno + 1))
                    visit(child, name + ".")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
        visit(tree, "")
    return out


def module_lines(root: Path, package: str) -> list[tuple[str, int]]:
    return [(str(p.relative_to(root)), len(p.read_text().splitlines())) for p in sorted((root / package).rglob("*.py"))]


def _short(mod: str, package: str = PACKAGE) -> str:
    return mod[len(package) + 1:] if mod.startswith(package + ".") else mod


def report(root: Path, package: str = PACKAGE) -> str:
    """The figures of ``root/package`` (``ckptfmt``, or ``bridges``: the same graph, layers and
    function-level imports; the longest functions and modules cover both packages either way)."""
    mods, edges, deferred = imports_of(root, package)
    graph_nodes = [m for m in mods if m not in (package, f"{package}.__main__")]
    edges = [e for e in edges if e.src in graph_nodes and e.dst in graph_nodes]
    layer = layers(graph_nodes, edges)
    subpackages = sorted(m for m, p in mods.items() if p.name == "__init__.py" and m != package)
    out: list[str] = [f"# Architecture figures of `{root.name}`", ""]
    out.append(f"`{package}/`: {len(mods)} modules ({len(subpackages)} subpackages"
               + (": " + ", ".join(f"`{_short(s, package)}/`" for s in subpackages) if subpackages else "") + "), "
               f"{sum(n for _, n in module_lines(root, package))} lines.")
    out += ["", f"## Import graph inside `{package}/`", ""]
    kinds = defaultdict(int)
    for e in edges:
        kinds[e.kind] += 1
    out.append(f"- imports between its modules: {len(edges)} ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})")
    out.append(f"- layers (over eager imports): **{max(layer.values(), default=0)}**")
    for title, ks in (("cycles at run time (eager + deferred imports)", ("eager", "deferred")),
                      ("cycles of eager imports alone", ("eager",)),
                      ("cycles counting type-only imports too", ("eager", "deferred", "type-only"))):
        cs = cycles(graph_nodes, edges, ks)
        out.append(f"- {title}: **{len(cs)}**")
        for c in cs:
            out.append(f"  - {len(c)} modules: " + ", ".join(f"`{_short(m, package)}`" for m in c))
    up = sorted((e for e in edges if layer[e.dst] >= layer[e.src]), key=lambda e: (e.kind, e.src, e.line))
    out.append(f"- imports that run back up (to the importer's layer or above): **{len(up)}** "
               f"({', '.join(f'{k} {sum(1 for e in up if e.kind == k)}' for k in ('deferred', 'type-only', 'eager'))})")
    for e in up:
        out.append(f"  - `{_short(e.src, package)}` (layer {layer[e.src]}) -> `{_short(e.dst, package)}` (layer {layer[e.dst]}), "
                   f"{e.kind}, line {e.line}")
    out += ["", "<details><summary>layer of each module</summary>", ""]
    by_layer: dict[int, list[str]] = defaultdict(list)
    for m, n in layer.items():
        by_layer[n].append(_short(m, package))
    for n in sorted(by_layer, reverse=True):
        out.append(f"- {n}: " + ", ".join(f"`{m}`" for m in sorted(by_layer[n])))
    out += ["", "</details>", ""]

    if subpackages:
        out += ["## Imports between subpackages", "",
                f"Rows import columns (number of import statements; `.` = the top level of `{package}`).", ""]

        def group(m: str) -> str:
            rest = m[len(package) + 1:].split(".")
            return rest[0] if len(rest) > 1 or f"{m}" in subpackages else "."
        groups = sorted({group(m) for m in graph_nodes})
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for e in edges:
            if group(e.src) != group(e.dst):
                counts[group(e.src), group(e.dst)] += 1
        out.append("| imports -> | " + " | ".join(groups) + " |")
        out.append("|---" * (len(groups) + 1) + "|")
        for g in groups:
            out.append(f"| **{g}** | " + " | ".join(str(counts.get((g, h), "")) for h in groups) + " |")
        gedges = [Import(group(e.src), group(e.dst), e.line, e.kind) for e in edges
                  if group(e.src) != group(e.dst) and "." not in (group(e.src), group(e.dst))]
        gcycles = cycles(groups, gedges, ("eager", "deferred", "type-only"))
        out.append(f"Subpackage layers (over eager imports): **{max(layers(groups, gedges).values(), default=0)}**; "
                   f"cycles between subpackages (any import): **{len(gcycles)}**"
                   + "".join(f"; {' <-> '.join(c)}" for c in gcycles))
        out.append("")

    internal = [d for d in deferred if d[2].split(".")[0] in LIBRARY]
    out += [f"## Function-level imports in `{package}`", "",
            f"**{len(deferred)}** import statements inside functions: {len(internal)} of the library's own modules (ckptfmt, bridges), "
            f"{len(deferred) - len(internal)} of other packages.", ""]
    for mod, line, what in sorted(deferred):
        out.append(f"- `{mods[mod].relative_to(root)}:{line}` imports `{what}`")
    out.append("")

    fns = [f for pkg in LIBRARY if (root / pkg).is_dir() for f in functions(root, pkg)]
    fns.sort(key=lambda f: (-f.lines, f.path, f.line))
    out += ["## Longest functions in `ckptfmt/` and `bridges/`", "",
            f"Functions over {LONG_FUNCTION[0]} lines: **{sum(1 for f in fns if f.lines > LONG_FUNCTION[0])}**; "
            f"over {LONG_FUNCTION[1]} lines: **{sum(1 for f in fns if f.lines > LONG_FUNCTION[1])}** "
            "(a method counts on its own; a nested function counts inside its parent too).", "",
            "| lines | function | where |", "|---:|---|---|"]
    for f in fns[:10]:
        out.append(f"| {f.lines} | `{f.name}` | `{f.path}:{f.line}` |")
    out.append("")

    big = sorted(((p, n) for pkg in LIBRARY if (root / pkg).is_dir() for p, n in module_lines(root, pkg)
                  if n >= LONG_MODULE), key=lambda x: -x[1])
    out += [f"## Modules at or over {LONG_MODULE} lines in `ckptfmt/` and `bridges/`: **{len(big)}**", ""]
    out += [f"- `{p}`: {n}" for p, n in big] or ["- none"]
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m devtools.archmetrics", description=__doc__.split("\n")[0])
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent),
                    help="the checkout to measure (default: the one this file lies in)")
    ap.add_argument("--package", choices=LIBRARY, default=PACKAGE, help="the package to draw (default: ckptfmt)")
    args = ap.parse_args(argv)
    sys.stdout.write(report(Path(args.root).resolve(), args.package) + "\n")


if __name__ == "__main__":
    main()
