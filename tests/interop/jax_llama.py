"""The JAX half of the Llama interop acceptance: 2 processes x 4 CPU devices = 8 devices, one
(4, 2) ("fsdp", "tensor") mesh over both (run by tests/test_interop.py).

usage: jax_llama.py PORT RANK WORKDIR

1. The NNX Llama of tests/torchproc/jax_models.py, random-initialised from the tiny config, laid
   out on the mesh and saved with ``bridges.jax.save`` from the 8 devices (``WORKDIR/llama_jax``);
   its logits on EVAL_IDS (rank 0 writes ``jax_logits.npy``).
2. ``WORKDIR/hf`` (written by ``save_pretrained(max_shard_size=...)`` in the test) restored with
   ``bridges.jax.restore`` straight from the safetensors directory onto the same mesh through the
   inverse preset; its logits (``direct_logits.npy``), and per process: the bytes it read, its
   share (the distinct boxes its devices hold) and the replicated tensors' bytes
   (``direct-<rank>.json``).
"""
from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 "
                           "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bridges import jax as bj  # noqa: E402
from bridges.jax._tree import flatten_with_keys, index_to_box, nest  # noqa: E402
from bridges.flax import nnx_load, nnx_state, nnx_target  # noqa: E402
from bridges.interop import preset_mapping  # noqa: E402
from torchproc.hf_configs import EVAL_IDS, LLAMA  # noqa: E402
from torchproc.jax_models import LLAMA_SPECS, Llama, spec_for  # noqa: E402


def _place(model, m) -> None:
    """Every array of the model onto the global mesh from this process's host copy (the same on
    both processes: one seed), without device_put across processes."""
    flat = flatten_with_keys(nnx_state(model))[0]
    placed = {}
    for k, v in flat:
        host = np.asarray(v)
        placed[k] = jax.make_array_from_callback(host.shape, NamedSharding(m, spec_for(LLAMA_SPECS, k)),
                                                 lambda idx, h=host: h[idx])
    nnx_load(model, nest(placed))


def _logits(fwd, model, m) -> np.ndarray:
    ids = jax.make_array_from_callback(EVAL_IDS.shape, NamedSharding(m, P()), lambda idx: EVAL_IDS[idx])
    return np.asarray(multihost_utils.process_allgather(fwd(model, ids), tiled=True))


def main() -> None:
    t0 = time.perf_counter()
    port, rank, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from ckptfmt_tools.jaxjoin import join as join_jax
    join_jax(port, 2, rank, timeout=120)
    m = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    cfg = SimpleNamespace(**LLAMA)
    fwd = nnx.jit(lambda mdl, ids: mdl(ids))

    model = Llama(cfg, nnx.Rngs(0))
    _place(model, m)
    t1 = time.perf_counter()
    bj.save(os.path.join(work, "llama_jax"), {"model": nnx_state(model)}, step=1, extra={"config": LLAMA})
    t2 = time.perf_counter()
    jax_logits = _logits(fwd, model, m)
    t3 = time.perf_counter()

    abstract = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(1)))
    target = {"model": nnx_target(abstract, lambda k, leaf: NamedSharding(m, spec_for(LLAMA_SPECS, k)))}
    stats: dict = {}
    restored = bj.restore(os.path.join(work, "hf"), target, mapping=preset_mapping("hf_llama_from_nnx", LLAMA).inverse(),
                          stats=stats)
    fresh = Llama(cfg, nnx.Rngs(2))
    _place(fresh, m)
    nnx_load(fresh, restored["model"])
    t4 = time.perf_counter()
    direct_logits = _logits(fwd, fresh, m)
    print(f"rank {rank}: start+init {t1 - t0:.1f} s, save {t2 - t1:.1f} s, forward {t3 - t2:.1f} s, "
          f"direct restore {t4 - t3:.1f} s, forward again {time.perf_counter() - t4:.1f} s", file=sys.stderr)

    share = replicated = 0
    for _, leaf in flatten_with_keys(restored)[0]:
        boxes = {index_to_box(s.index, leaf.shape) for s in leaf.addressable_shards}
        n = sum(b.size for b in boxes) * leaf.dtype.itemsize
        share += n
        if leaf.sharding.is_fully_replicated:
            replicated += n
    total = sum(int(np.prod(v.shape)) * v.dtype.itemsize for _, v in flatten_with_keys(restored)[0])
    from ckptfmt.interop import open_source
    headers = open_source(os.path.join(work, "hf")).header_bytes
    with open(os.path.join(work, f"direct-{rank}.json"), "w") as fh:
        json.dump({"bytes_read": stats["reader"]["bytes_read"], "share": share, "replicated": replicated,
                   "headers": headers,
                   "total": total, "leaves": len(flatten_with_keys(restored)[0])}, fh)
    if rank == 0:
        np.save(os.path.join(work, "jax_logits.npy"), jax_logits)
        np.save(os.path.join(work, "direct_logits.npy"), direct_logits)
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    main()
