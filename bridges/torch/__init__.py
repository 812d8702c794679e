"""The PyTorch bridge: save a state dict of tensors / DTensors, load one at any topology.

Verbs (the bridge contract, bridges/README.md): :func:`save`, :func:`load`, :func:`load_extra`,
:func:`load_rank_state`.

What a checkpoint holds is the PyTorch profile, normative in spec/FORMAT.md 13.3.

Key paths: nested dicts are flattened with ``/`` (``{"model": {"fc.weight": t}}`` ->
``model/fc.weight``); torch FQNs keep their dots. A tensor (``torch.Tensor`` or ``DTensor``)
becomes a checkpoint tensor; any other leaf (ints, floats, lists such as optimizer
``param_groups``) is non-tensor state, stored as msgpack in the global state under
``torch/objects`` — never pickle.

Sharding: a DTensor's local block is its global box, from
``compute_local_shape_and_global_offset`` (``Shard(d)`` incl. uneven and empty torch.chunk
shards, ``Replicate()``, 1-D and N-D meshes, several placements on one dimension); a strided
layout (``_StridedShard``, FSDP2 over tensor parallelism) is several boxes, each written and read
by global coordinates (:mod:`bridges.torch._dtensor`). ``replica_id`` is the rank's linear coordinate on
the replicated mesh dims; each replicated box is written once, by one of the ranks holding it,
and the ranks take turns (FORMAT.md 8.1). A plain tensor on a multi-rank world is treated as
replicated over all ranks (one rank's copy is written).

Load is target-driven and planned by the core's one restore planner
(:func:`ckptfmt.restoreplan.plan_restore`, the same for every bridge: bridges/README.md, "The
restore semantics"): every rank asks the core reader for exactly the boxes its target values hold
locally, in the checkpoint's coordinates (through a :mod:`bridges.mapping` chain when the layouts
differ), and assembles the blocks locally (:mod:`bridges.torch._load`). The reads go in batches of about
``RESTORE_BATCH_BYTES`` (``bridges._contract.read_batches``, as in every bridge); the core
verifies every byte of a batch before its values are built, nothing is returned before every
batch is verified, and the target is never modified.

Per-rank state (``rank_state`` and, with ``save_rng``, the torch RNG states) follows the bridge
contract on a topology change: :func:`load` raises TopologyChangedError unless
``rank_state_policy`` says what to do with it.

Subpackage ``bridges.torch`` owns the PyTorch bridge: the verbs (``_api``), the load path
(``_load``), tensor and DTensor conversion (``_conv``, ``_dtensor``), the coordinator over the
process group (``_coord``), the cooperative restore's all-gather (``_share``), the manager
(``_manager``) and its local tier's peer exchange (``_peer``). May import: ckptfmt's public faces,
``bridges._contract``, ``bridges._extra``, ``bridges.mapping`` (tests/test_layering.py).
"""
from __future__ import annotations

from bridges._requires import require

require("bridges.torch", "torch", "torch")  # before the framework imports: names the extra

from bridges.torch._api import save as save
from bridges.torch._api import load as load
from bridges.torch._api import load_extra as load_extra
from bridges.torch._api import load_rank_state as load_rank_state
from bridges.torch._api import Loaded as Loaded
from bridges.torch._api import rng_state as rng_state
from bridges.torch._api import set_rng_state as set_rng_state
from bridges.torch._api import local_box as local_box
from bridges.torch._api import to_numpy as to_numpy
from bridges.torch._api import from_numpy as from_numpy
from bridges.torch._api import layer_kinds as layer_kinds
from bridges.torch._api import RESTORE_BATCH_BYTES as RESTORE_BATCH_BYTES
from bridges.torch._manager import CheckpointManager as CheckpointManager

__all__ = ["save", "load", "Loaded", "CheckpointManager", "load_extra", "load_rank_state", "rng_state", "set_rng_state", "local_box", "to_numpy", "from_numpy", "layer_kinds", "RESTORE_BATCH_BYTES"]
