"""MkDocs hook: build the site from the repository's own markdown, at the repository's own paths.

Every page keeps the path it has in the repository (``README.md`` is the home page,
``docs/INTEROP.md`` is ``docs/INTEROP/``, ``spec/FORMAT.md`` is ``spec/FORMAT/``), so a relative link
means the same thing on the site as it does on GitHub and in an editor: one source of truth, no
copies, no link rewriting.

- The pages under ``docs/`` (mkdocs' ``docs_dir``) are re-rooted at the repository root;
  ``REPO_PAGES`` adds the markdown that lives outside ``docs/`` (the README, the spec, the bridges'
  contract and mapping guide).
- A relative link from a page to a repository file that is not a page (a notebook, the JSON Schema,
  a source file) is published as that file, copied into the site, when the file exists in the
  repository. A link to a file that does not exist is left alone, so ``mkdocs build --strict``
  fails on it, as it fails on a link to a missing page or anchor.
"""
from __future__ import annotations

import os
import re

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

# Markdown outside docs_dir that the site publishes, by repository path.
REPO_PAGES = (
    "README.md",
    "spec/FORMAT.md",
    "spec/examples/README.md",
    "bridges/README.md",
    "bridges/MAPPING.md",
)

# The notebooks' folder: each notebook is a page of the site, rendered by mkdocs-jupyter.
NOTEBOOKS = "notebooks"

# The target of an inline markdown link or image: ](target) or ](target "title").
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//|#)", re.IGNORECASE)


def _root(config: MkDocsConfig) -> str:
    return os.path.dirname(os.path.abspath(config.config_file_path))


def _repo_file(rel: str, config: MkDocsConfig, root: str, like: File | None = None) -> File:
    f = File(rel, root, config.site_dir, config.use_directory_urls)
    if like is not None:
        f.inclusion = like.inclusion  # exclude_docs / not_in_nav keep their effect
    return f


def _linked_files(page: File, root: str) -> list[str]:
    """Repository paths of existing non-markdown files that ``page`` links to (inside the repository)."""
    found = []
    for target in _LINK.findall(page.content_string):
        if _EXTERNAL.match(target):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not path or path.endswith(".md") or path.endswith("/"):
            continue
        rel = os.path.normpath(os.path.join(os.path.dirname(page.src_uri), path)).replace(os.sep, "/")
        if rel.startswith("../") or rel == "..":
            continue
        if os.path.isfile(os.path.join(root, rel)):
            found.append(rel)
    return found


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns the notebooks added here into pages
def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Re-root docs_dir's files at the repository root, add REPO_PAGES and the files pages link to."""
    root = _root(config)
    docs_dir = os.path.abspath(config.docs_dir)
    prefix = os.path.relpath(docs_dir, root).replace(os.sep, "/")
    out = Files([])
    for f in files:
        if f.abs_src_path and os.path.abspath(f.abs_src_path).startswith(docs_dir + os.sep):
            out.append(_repo_file(f"{prefix}/{f.src_uri}", config, root, like=f))
        else:
            out.append(f)  # the theme's and plugins' own files
    for rel in REPO_PAGES:
        out.append(_repo_file(rel, config, root))
    notebooks = os.path.join(root, NOTEBOOKS)
    for rel in sorted(os.listdir(notebooks)) if os.path.isdir(notebooks) else ():  # pages, by mkdocs-jupyter
        if rel.endswith(".ipynb"):
            out.append(_repo_file(f"{NOTEBOOKS}/{rel}", config, root))
    for page in list(out.documentation_pages()):
        for rel in _linked_files(page, root):
            if out.get_file_from_path(rel) is None:
                out.append(_repo_file(rel, config, root))
    return out
