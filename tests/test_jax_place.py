"""bridges.jax._place: a restore's verified blocks placed as global arrays through JAX's one-call
runtime path and through the public path give the same arrays (values, shardings, committed),
and a CPU device keeps each block as its buffer on the runtime path."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np, ml_dtypes
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from bridges.jax._place import place_many
    from bridges.jax._tree import index_to_box
    from ckptfmt.reader._alloc import aligned_empty  # the reader's outputs: what a restore places
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    cases = [((8, 12), P("data", "model"), ml_dtypes.bfloat16), ((8, 12), P("model", None), np.float32),
             ((6,), P(), np.int32), ((), P(), np.uint32), ((4, 0), P("data"), np.float32)]

    def leaves():
        out, wants = [], []
        for shape, spec, dt in cases:
            sh = NamedSharding(mesh, spec)
            full = (rng.standard_normal(shape) * 100).astype(dt)
            pairs, used = [], set()
            for d, idx in sh.addressable_devices_indices_map(shape).items():
                box = index_to_box(idx, shape)
                block = aligned_empty(full[idx].shape, np.dtype(dt))
                block[...] = full[idx]
                pairs.append((d, block))  # a fresh block per device
            out.append((shape, sh, pairs))
            wants.append(full)
        return out, wants

    for runtime in (True, False):
        ls, wants = leaves()
        got = place_many(ls, runtime=runtime)
        for (shape, sh, pairs), arr, want, (_, spec, _) in zip(ls, got, wants, cases):
            assert arr.shape == shape and arr.dtype == want.dtype, (arr.shape, arr.dtype)
            assert arr.sharding == sh and arr.committed
            assert np.asarray(arr).tobytes() == want.tobytes()
            ptrs = {s.device: s.data.unsafe_buffer_pointer() for s in arr.addressable_shards}
            if want.size:  # no two device buffers share memory (a replicated block is copied)
                assert len(set(ptrs.values())) == len(ptrs), (shape, spec)
            if runtime and want.size and not sh.is_fully_replicated:  # CPU devices keep the blocks given

                assert all(ptrs[d] == b.ctypes.data for d, b in pairs), (shape, [(ptrs[d], b.ctypes.data) for d, b in pairs][:2])
    # control: a block of the wrong values is not silently fixed by either path
    ls, wants = leaves()
    ls[0][2][0][1][...] = 0
    for runtime in (True, False):
        arr = place_many([ls[0]], runtime=runtime)[0]
        assert np.asarray(arr).tobytes() != wants[0].tobytes()
    print("ok")
""")


def test_runtime_and_public_placement_agree():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.stdout.strip().endswith("ok"), r.stdout + r.stderr
