"""ckptfmt: a distributed checkpoint format. The manifest is the commit.

The core imports numpy, tensorstore, msgpack, crc32c and ml_dtypes only; framework bridges live in
``bridges``.

Layout: the floor, the top-level modules every module may import (``_boxcols``, ``_types``,
``_version``, ``agree``, ``checksum``, ``coord``, ``dtypes``, ``errors``, ``geometry``, ``layout``,
``plan``, ``rankstate``, ``readplan``, ``restoreplan``, ``state``), and eight subpackages by concern (``manifest``, ``storage``, ``shard``,
``reader``, ``repository``, ``session``, ``interop``, ``manager``), each saying in its docstring
what it owns and what it may import (tests/test_layering.py enforces the table).
"""
from __future__ import annotations

from ._version import __version__

from ._types import Box as Box
from .agree import agree_step as agree_step
from ._types import LocalShard as LocalShard
from ._types import TensorSharding as TensorSharding
from .coord import Coordinator as Coordinator
from .coord import LocalCoordinator as LocalCoordinator
from .coord import TcpCoordinator as TcpCoordinator
from .errors import *  # noqa: F401,F403  (every name is listed in errors.__all__)
from .errors import __all__ as _error_names
from .manifest import Manifest as Manifest
from .manifest import TensorEntry as TensorEntry
from .manifest import parse_manifest as parse_manifest
from .reader import Checkpoint as Checkpoint
from .reader import ReadStats as ReadStats
from .repository import GcReport as GcReport
from .repository import Repository as Repository
from .session._saveopts import SaveOptions as SaveOptions
from .storage import StorageOptions as StorageOptions
from .session import save as save
from .asyncsave import SaveHandle as SaveHandle
from .asyncsave import save_async as save_async
from .manager import CheckpointManager as CheckpointManager
from .manager import RestoreResult as RestoreResult
from .manager import SaveFailurePolicy as SaveFailurePolicy
from .manager import SaveRecord as SaveRecord
from .manager import SkippedStep as SkippedStep

__all__ = ["__version__", "agree_step", "Box", "LocalShard", "TensorSharding", "Coordinator", "LocalCoordinator",
           "TcpCoordinator", "Manifest", "TensorEntry", "parse_manifest", "Checkpoint", "ReadStats",
           "GcReport", "Repository", "StorageOptions", "SaveOptions", "save", "save_async", "SaveHandle", "CheckpointManager",
           "RestoreResult", "SaveRecord", "SaveFailurePolicy", "SkippedStep", *_error_names]
