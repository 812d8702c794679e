"""JAX bridge: save a pytree of sharded ``jax.Array``s, restore it onto any topology.

Verbs (the bridge contract, bridges/README.md): :func:`save`, :func:`restore`, :func:`load_extra`,
:func:`load_rank_state`.

What a checkpoint holds (the JAX profile, normative in spec/FORMAT.md 13.2; summarised here):

* Every array leaf (``jax.Array``, ``numpy.ndarray``) is one tensor. Its key path is the pytree
  path rendered by :func:`bridges.jax._tree.render_path` (dict keys and attribute names as they
  are, sequence indices in decimal, joined with ``/``). Each process offers the boxes of its
  addressable shards (``Shard.index``) with their ``replica_id``, and the data of its lowest
  replica of each box; each box is written once, and the processes holding a replicated box take
  turns (FORMAT.md 8.1). A ``numpy.ndarray`` leaf is taken to be the same on every process; one copy is written.
* Typed PRNG keys (``jax.random.key``) are stored as ``jax.random.key_data`` (a ``uint32``
  tensor with the key dimensions last), and the implementation name is recorded in the global
  state under ``bridge.prng_impls[<key path>]``. Raw ``uint32`` keys are ordinary tensors.
* Every other leaf (Python ``bool``/``int``/``float``/``str``/``bytes``/``None``, numpy scalars)
  goes into the global msgpack state under ``bridge.leaves[<key path>]``.
* ``extra`` (any msgpack-able value, and anything ``json.dumps`` takes: dict keys are stored as
  JSON writes them, ``1`` -> ``"1"``, see ``bridges/_extra.py``) is stored beside it in the
  global state: ``{"bridge": {...}, "extra": extra}``; read it back with :func:`load_extra`.
* ``rank_state`` is per-process state (numpy/Python RNG state, iterator position), stored as
  format v1 rank state. **Topology-change policy**: when the number of processes at restore
  differs from the number that saved, rank state has no owner. :func:`restore` and
  :func:`load_rank_state` then raise :class:`TopologyChangedError` unless the caller passes
  ``rank_state_policy``: ``"drop"`` (discard it; every process starts its per-rank state
  afresh), ``"rank0"`` (every process receives rank 0's state) or ``"same-rank"`` (process ``r``
  gets rank ``r``'s state where one was saved, None otherwise). With the same process count,
  process ``r`` gets rank ``r``'s state and no policy is needed.

Restore reads, for each target leaf, only the boxes of its addressable shards (identical boxes on
several local devices are read once), in batches of about RESTORE_BATCH_BYTES
(``bridges._contract.read_batches``, the batched restore of every bridge); the core reader
verifies every byte of a batch before it is built, and nothing is returned before every batch
has been read and verified. Arrays are then built with
``jax.make_array_from_callback``; a sharded target is never assembled whole on the host.

Subpackage ``bridges.jax`` owns the JAX bridge: the verbs (``_api``), the restore path
(``_restore``), pytree key paths and shardings (``_tree``), the coordinator over ``jax.distributed``
(``_coord``), the cooperative restore's all-gather (``_share``), the manager (``_manager``) and its
local tier's peer exchange (``_peer``). May import: ckptfmt's public faces, ``bridges._contract``,
``bridges._extra``, ``bridges.mapping`` (tests/test_layering.py holds the table).
"""
from __future__ import annotations

from bridges._requires import require

require("bridges.jax", "jax", "jax")  # before the framework imports: names the extra

from bridges.jax._api import save as save
from bridges.jax._api import restore as restore
from bridges.jax._api import load_extra as load_extra
from bridges.jax._api import load_rank_state as load_rank_state
from bridges.jax._api import abstract_target as abstract_target
from bridges.jax._api import flatten_with_keys as flatten_with_keys
from bridges.jax._api import RANK_STATE_POLICIES as RANK_STATE_POLICIES
from bridges.jax._api import RESTORE_BATCH_BYTES as RESTORE_BATCH_BYTES
from bridges.jax._manager import CheckpointManager as CheckpointManager

__all__ = ["save", "restore", "abstract_target", "CheckpointManager", "load_extra", "load_rank_state", "flatten_with_keys", "RANK_STATE_POLICIES", "RESTORE_BATCH_BYTES"]
