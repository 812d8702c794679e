"""ckptfmt as ``torch.distributed.checkpoint`` (DCP) storage: a StorageWriter and a StorageReader.

``dcp.save(state_dict, storage_writer=CkptfmtStorageWriter(url, step=step))`` (or
``dcp.async_save``) writes one committed ckptfmt step from every rank: tensors and DTensors as
boxes of the whole tensor, non-tensor state (optimizer ``param_groups``, schedulers, ``Stateful``
objects) as msgpack, never a pickle (the writer: ``bridges/dcp/_writer.py``).
``dcp.load(state_dict, storage_reader=CkptfmtStorageReader(url))`` loads a ckptfmt checkpoint
(written by DCP, ``bridges.torch`` or ``bridges.jax``) through DCP's own planner, which computes
the resharding (DTensor, ShardedTensor, plain tensors), at any world size.

The reader's call order (DCP drives it, every rank): ``reset`` -> ``read_metadata`` -> ``set_up_storage_reader``
-> ``prepare_local_plan`` -> (coordinator) ``prepare_global_plan`` -> ``read_data``.

* ``read_metadata`` translates our manifest into DCP's :class:`Metadata`: one
  ``TensorStorageMetadata`` per tensor with one ``ChunkStorageMetadata`` per stored shard (its
  true extent, not the padded edge). Nothing is unpickled or pickled; DCP's ``.metadata`` file is
  never read or written.
* ``read_data`` turns every ``ReadItem`` (a box inside a stored chunk) into one global box and
  reads them all with one verified core ``read_boxes`` call; nothing is copied into the state
  dict until every byte has passed its checksum.
* Keys: checkpoint key paths use ``/``; DCP flattens nested dicts with ``.``. By default ``/``
  becomes ``.`` (``model/fc.weight`` -> ``model.fc.weight``); pass ``fqn=`` to change that.
* Non-tensor values (the torch profile's ``torch.objects``: optimizer ``param_groups``, a
  scheduler's state, what a ``Stateful`` returned) are served to DCP's ``BYTE_IO`` items from
  the msgpack state, never through a pickle: each object is offered under its fqn and under the
  fqn of every value nested in it (``optim.param_groups.0.lr``, as DCP flattens a list of maps),
  and the decoded value is placed in the planner's state dict directly, as
  ``DefaultLoadPlanner.load_bytes`` places what it unpickles. A planner that is not a
  ``DefaultLoadPlanner`` gets a KeyMismatchError for a non-tensor entry.

The writer is :class:`CkptfmtStorageWriter` (``bridges/dcp/_writer.py``).

**Errors arrive wrapped.** DCP runs the writer and the reader inside its own collectives and
raises what any rank raised wrapped in ``torch.distributed.checkpoint.api.CheckpointException``,
which derives from ``BaseException``: around ``dcp.save`` / ``dcp.load`` (and an
``async_save`` future's ``result()``), ``except ckptfmt.CheckpointError`` and ``except Exception``
do not catch a ckptfmt refusal. Catch ``CheckpointException`` and look inside with
:func:`unwrap`, which returns the first ckptfmt error (lowest rank first), or None:

```python
from torch.distributed.checkpoint.api import CheckpointException
from bridges.dcp import unwrap

try:
    dcp.save(state, storage_writer=CkptfmtStorageWriter(url, step=step))
except CheckpointException as e:  # a BaseException: `except Exception` passes it by
    err = unwrap(e)  # StepAlreadyCommittedError, InvalidStateError, ChecksumMismatchError, ...
    if err is None:
        raise  # not ckptfmt's: DCP's own planner, or another rank's untyped error
    raise err from e  # now `except ckptfmt.CheckpointError` (and `except Exception`) catch it
```

``e.failures`` (rank -> (exception, traceback)) holds every rank's error.

Subpackage ``bridges.dcp`` owns the ``torch.distributed.checkpoint`` storage reader (``_reader``)
and writer (``_writer``). May import: ckptfmt's public faces, ``bridges.torch``,
``bridges._contract``, ``bridges._extra``, ``bridges.mapping`` (tests/test_layering.py).
"""
from __future__ import annotations

from bridges._requires import require

require("bridges.dcp", "torch", "torch")  # before the framework imports: names the extra

from bridges.dcp._reader import CkptfmtStorageReader as CkptfmtStorageReader
from bridges.dcp._writer import CkptfmtStorageWriter as CkptfmtStorageWriter
from bridges.dcp._reader import unwrap as unwrap

__all__ = ["CkptfmtStorageReader", "CkptfmtStorageWriter", "unwrap"]
