"""The documentation site (issue 30 item 5): ``mkdocs build --strict`` of mkdocs.yml passes, its API
reference renders every public name (each package's ``__all__``), and a strict build is rejected
for a broken link, a link to a repository file that does not exist, an unresolved cross-reference
and a missing API reference (broken controls, on a small copy of the site's own config and hook).
The README's python blocks parse and take only public names from the bridges (a renamed name is
caught: the control).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("mkdocs")
pytest.importorskip("material")
pytest.importorskip("mkdocstrings_handlers.python")

ROOT = Path(__file__).resolve().parent.parent
API_MODULES = ("ckptfmt", "bridges.jax", "bridges.flax", "bridges.torch", "bridges.dcp", "bridges.torchtitan",
               "bridges.presets", "bridges.mapping", "bridges.interop")


class _Loader(yaml.SafeLoader):
    """mkdocs.yml as data: its ``!ENV [NAME, default]`` tags read as the default."""


_Loader.add_constructor("!ENV", lambda loader, node: loader.construct_sequence(node)[-1])


def _build(config: Path, site: Path, *, execute: bool = False) -> subprocess.CompletedProcess:
    """``mkdocs build --strict``; the notebooks rendered without running them unless ``execute``
    (tests/test_notebooks.py runs every one; test_a_notebook_renders_with_its_outputs one here)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "CKPTFMT_DOCS_EXECUTE": "true" if execute else "false",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=config.parent)


def _public_names(module: str) -> list[str]:
    """``__all__`` read from the source (bridges.jax imports jax; the reference must not need it)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    for node in ast.parse(Path(spec.origin).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            names = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
            if module == "ckptfmt":  # its __all__ ends with *errors.__all__
                names += _public_names("ckptfmt.errors")
            return names
    raise AssertionError(f"{module} has no __all__")


def test_site_builds_strict_with_every_public_name(tmp_path: Path) -> None:
    out = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    for module in API_MODULES:
        page = tmp_path / "site" / "docs" / "api" / Path(*module.split(".")) / "index.html"  # docs/api/bridges/jax.md
        html = page.read_text()
        missing = [n for n in _public_names(module) if f'id="{module}.{n}"' not in html]
        assert not missing, f"{page}: no reference entry for {module}.{missing}"
        assert ":func:" not in html and ":class:" not in html, f"{page}: a Sphinx role left unrendered"
    # Pages outside docs/ keep their repository paths, so their relative links work here as on GitHub.
    for page in ("index.html", "spec/FORMAT/index.html", "bridges/index.html", "bridges/MAPPING/index.html",
                 "spec/examples/index.html", "docs/INTEROP/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def _small_site(root: Path, page: str) -> Path:
    """The real config and hooks around ``docs/page.md``; the repository's pages that the hook publishes
    (``REPO_PAGES``) are stubs, so the build costs little (the real pages are built above)."""
    shutil.copytree(ROOT / "docs" / "hooks", root / "docs" / "hooks", ignore=shutil.ignore_patterns("__pycache__"))
    hook = root / "docs" / "hooks" / "repo_files.py"
    spec = importlib.util.spec_from_file_location("repo_files", hook)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for rel in module.REPO_PAGES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("# Stub\n\n## 4.1 Addressing\n")
    (root / "ckptfmt").mkdir()
    shutil.copy(ROOT / "ckptfmt" / "errors.py", root / "ckptfmt" / "errors.py")
    (root / "docs" / "page.md").write_text(page)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)
    config["nav"] = list(module.REPO_PAGES) + ["docs/page.md"]
    config["watch"] = []
    (root / "mkdocs.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    return root / "mkdocs.yml"


def test_strict_build_rejects_broken_links_and_missing_references(tmp_path: Path) -> None:
    good = ("# Page\n\n[the spec](../spec/FORMAT.md#41-addressing), [a source](../ckptfmt/errors.py), "
            "[save][ckptfmt.save]\n\n::: ckptfmt.save\n")
    out = _build(_small_site(tmp_path / "good", good), tmp_path / "good-site")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "good-site" / "ckptfmt" / "errors.py").is_file()  # a linked repository file is published

    # The same copy, each kind of broken link once: an anchor, a repository file, a page, a cross-reference.
    # One strict build reports them all and fails.
    bad = (good.replace("#41-addressing", "#41-no-such-section").replace("errors.py", "no_such_module.py")
           .replace("[ckptfmt.save]", "[ckptfmt.no_such_function]") + "\n[gone](no-such-page.md)\n")
    out = _build(_small_site(tmp_path / "bad", bad), tmp_path / "bad-site")
    log = out.stdout + out.stderr
    assert out.returncode != 0, log
    for needle in ("#41-no-such-section", "no_such_module.py", "no-such-page.md", "ckptfmt.no_such_function"):
        assert needle in log, f"{needle} not reported:\n{log}"

    # A missing API reference stops the build at that page.
    out = _build(_small_site(tmp_path / "ref", good.replace("::: ckptfmt.save", "::: ckptfmt.NoSuchClass")),
                 tmp_path / "ref-site")
    assert out.returncode != 0 and "ckptfmt.NoSuchClass" in out.stdout + out.stderr, out.stdout + out.stderr


def _notebook_outputs(html: str) -> list[str]:
    return re.findall(r'class="[^"]*jp-OutputArea-output[^"]*"', html)


def test_a_notebook_renders_with_its_outputs(tmp_path: Path) -> None:
    """The site's notebooks are pages (mkdocs-jupyter), executed while the site builds: notebook 01
    (the fastest) is rendered with the outputs it printed; the control, the same build without
    executing, renders its code and no output."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)
    plugin = next(p for p in config["plugins"] if isinstance(p, dict) and "mkdocs-jupyter" in p)["mkdocs-jupyter"]
    plugin["execute_ignore"] = ["*/0[2-9]_*.ipynb"]  # notebook 01 only: the others cost minutes
    runs = {}
    one = ROOT / f".mkdocs-test-{os.getpid()}.yml"  # beside mkdocs.yml: its paths are the repository's
    try:
        for execute in (True, False):
            plugin["execute"] = execute  # as CKPTFMT_DOCS_EXECUTE sets it in mkdocs.yml
            one.write_text(yaml.safe_dump(config, sort_keys=False))
            runs[execute] = _build(one, tmp_path / f"site-{execute}", execute=execute)
    finally:
        one.unlink(missing_ok=True)
    for execute, out in runs.items():
        assert out.returncode == 0, out.stdout + out.stderr
    page = "notebooks/01_format_tour/index.html"
    ran, plain = ((tmp_path / f"site-{e}" / page).read_text() for e in (True, False))
    assert len(_notebook_outputs(ran)) >= 5 and "crc32c" in ran, len(_notebook_outputs(ran))
    assert _notebook_outputs(plain) == [] and "crc32c" in plain  # control: the code, no outputs
    nav = (tmp_path / "site-True" / "index.html").read_text()
    assert all(f"notebooks/{p.stem}/" in nav for p in (ROOT / "notebooks").glob("*.ipynb"))


def _readme_name_problems(readme: str) -> list[str]:
    """Every python block of ``readme`` parses, and every name it takes from a bridges module is in that
    module's ``__all__`` (the blocks themselves run outside the suite: they train and load a Llama)."""
    problems = []
    for block in re.findall(r"```python\n(.*?)```", readme, re.S):
        tree = ast.parse(block)
        modules: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("bridges.")})
            elif isinstance(node, ast.ImportFrom) and node.module == "bridges":
                modules.update({a.asname or a.name: f"bridges.{a.name}" for a in node.names})
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bridges."):
                problems += [f"{node.module}.{a.name}" for a in node.names if a.name not in _public_names(node.module)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                if node.attr not in _public_names(modules[node.value.id]):
                    problems.append(f"{modules[node.value.id]}.{node.attr}")
    return problems


def test_readme_code_uses_public_names() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.count("```python") == 5 and not _readme_name_problems(readme), _readme_name_problems(readme)
    # Controls: a renamed class in an import, a renamed function through a module alias.
    broken = readme.replace("CkptfmtStorageWriter", "CkptfmtWriter").replace("bjax.abstract_target", "bjax.target")
    assert sorted(_readme_name_problems(broken)) == ["bridges.dcp.CkptfmtWriter", "bridges.jax.target"]
