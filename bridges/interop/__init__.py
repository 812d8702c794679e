"""Getting weights in and out: export to Hugging Face safetensors through a mapping, in one or
several processes; import Orbax and torch DCP checkpoints (docs/INTEROP.md).

Verbs:

* :func:`export` -- a committed step -> ``model-XXXXX-of-YYYYY.safetensors`` + index (+
  ``config.json``), names and layouts through a :class:`bridges.mapping.Mapping` (a preset by
  name, :func:`preset_mapping`, or a mapping file, :func:`load_mapping`); ``processes=N`` starts
  N-1 more writer processes, each writing whole files of its own (no gather).
* :func:`export_peft` -- a step's LoRA pairs (``nnx.LoRA`` / ``nnx.LoRALinear``, or the user's
  own) -> a PEFT adapter directory, or merged into the base weights (:mod:`bridges.interop._peft`).
* :func:`import_orbax` -- a checkpoint written by Orbax's ``StandardCheckpointer`` /
  ``PyTreeCheckpointer`` (OCDBT on or off), read through Orbax itself, leaf by leaf.
* :func:`import_dcp` -- a ``torch.distributed.checkpoint`` directory, read through torch's own
  ``FileSystemReader``. DCP's ``.metadata`` is a pickle: reading it runs code from the file, so
  import only checkpoints you trust (the CLI asks for ``--trust-pickle``).
* the safetensors import and the direct restore are in the core: :mod:`ckptfmt.interop`.

This module imports no framework: ``import_orbax`` and ``import_dcp`` import their importer
(``_orbax``, which needs jax and Orbax; ``_dcp``, which needs torch) when called.

Subpackage ``bridges.interop`` owns export and import: safetensors export through a mapping
(``_api``, ``_export_map``, ``_export_worker``), PEFT adapters (``_peft``), Orbax and DCP imports
(``_orbax``, ``_dcp``). May import: ``bridges.mapping``, ``bridges.presets``, and ``bridges.jax`` /
``bridges.torch`` from ``_orbax`` / ``_dcp`` only, the two modules that need a framework
(tests/test_layering.py).
"""
from __future__ import annotations

from bridges.interop._api import export as export
from bridges.interop._api import export_peft as export_peft
from bridges.interop._api import PeftReport as PeftReport
from bridges.interop._api import import_checkpoint as import_checkpoint
from bridges.interop._api import import_orbax as import_orbax
from bridges.interop._api import import_dcp as import_dcp
from bridges.interop._api import import_safetensors as import_safetensors
from bridges.interop._api import load_mapping as load_mapping
from bridges.interop._api import preset_mapping as preset_mapping
from bridges.interop._api import IMPORT_FORMATS as IMPORT_FORMATS
from bridges.interop._api import InvalidMappingError as InvalidMappingError
from bridges.interop._api import Coverage as Coverage
from bridges.interop._api import export_tensors as export_tensors
from bridges.interop._api import strip_target_prefix as strip_target_prefix
from bridges.interop._api import mapping_to_json as mapping_to_json
from bridges.interop._api import mapping_from_json as mapping_from_json
from bridges.interop._api import mapped_tensors as mapped_tensors
from bridges.interop._api import PRESETS as PRESETS

__all__ = ["export", "export_peft", "PeftReport", "import_checkpoint", "import_orbax", "import_dcp", "import_safetensors", "load_mapping", "preset_mapping", "IMPORT_FORMATS", "Coverage", "export_tensors", "strip_target_prefix", "mapping_to_json", "mapping_from_json", "mapped_tensors", "PRESETS", "InvalidMappingError"]
