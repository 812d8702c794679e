"""The framework each bridge face needs, and the error that names the extra to install.

A face (``bridges.jax``, ``bridges.flax``, ``bridges.torch``, ``bridges.dcp``) calls
:func:`require` before its own imports, so a user without the framework reads which extra of
``ckptfmt`` brings it instead of a bare ``ModuleNotFoundError``. The error stays a
``ModuleNotFoundError`` (``except ImportError`` keeps working), since it is about the environment,
not about a checkpoint. May import: the standard library only.
"""
from __future__ import annotations

import importlib

__all__ = ["require"]


def require(face: str, extra: str, *modules: str) -> None:
    """Import each of ``modules``; when one is not installed, raise ``ModuleNotFoundError`` naming
    ``face``, the missing module and ``pip install 'ckptfmt[<extra>]'``. Nothing else is caught:
    a framework that is installed but fails to import raises its own error unchanged."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or e.name.split(".")[0] != module.split(".")[0]:
                raise
            raise ModuleNotFoundError(
                f"{face} needs {module}, which is not installed in this environment "
                f"({e}): pip install 'ckptfmt[{extra}]' (from a clone of the repository: "
                f"pip install -e '.[{extra}]')", name=module) from e
