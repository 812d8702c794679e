"""Griffe extension for the API reference: the docstrings' Sphinx roles render as code.

The docstrings name other objects the Sphinx way (``:func:`save```, ``:class:`~ckptfmt.Repository```);
Markdown has no roles, so without this they show as ``:func:save``. Each becomes inline code (the
name, less a leading ``~``), which reads the same whether or not the target has a page.
"""
from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const|type):`~?([^`]+)`")


class SphinxRolesAsCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
