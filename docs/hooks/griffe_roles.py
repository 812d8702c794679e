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


class SignatureSections(griffe.Extension):
    """A function or method whose docstring (prose, not Google-style) has no parameter or return
    section gets them from its signature: each parameter's name, annotation and default, and the
    return annotation. The prose keeps saying what each one means; the table says what to pass."""

    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        if func.docstring is None or func.name.startswith("_") and func.name != "__init__":
            return
        sections = list(func.docstring.parse())
        kinds = {s.kind for s in sections}
        params = [p for p in func.parameters if p.name not in ("self", "cls")]
        if params and griffe.DocstringSectionKind.parameters not in kinds:
            sections.append(griffe.DocstringSectionParameters([
                griffe.DocstringParameter(("*" if p.kind is griffe.ParameterKind.var_positional else
                                           "**" if p.kind is griffe.ParameterKind.var_keyword else "") + p.name,
                                          description="", annotation=p.annotation, value=p.default)
                for p in params]))
        returns = func.returns
        if returns is not None and str(returns) != "None" and func.name != "__init__" \
                and griffe.DocstringSectionKind.returns not in kinds:
            sections.append(griffe.DocstringSectionReturns([griffe.DocstringReturn("", description="",
                                                                                    annotation=returns)]))
        func.docstring.__dict__["parsed"] = sections  # griffe's cached_property: the sections to render
