"""The JAX half of tests/test_interop_families.py: one process x 4 CPU devices, a (2, 2)
("data", "model") mesh.

usage: jax_families.py PORT RANK WORKDIR   (one process: PORT and RANK are unused)

For each family in ``WORKDIR/families.json``, ``WORKDIR/<family>/hf`` (``save_pretrained``: Qwen2-
MoE and Mixtral one tensor per expert, as hub checkpoints are) is restored with
``bridges.jax.restore`` straight onto the mesh through ``preset_mapping(...).inverse()``, heads,
ffn, vocabulary and experts split per :func:`spec`. Writes ``<family>/jax.npz`` (the restored
arrays, host copies), ``<family>/logits.npy`` (the jitted JAX forward of tests/torchproc/
jax_families.py on the restored arrays) and ``<family>/result.json`` (bytes read, share,
shardings kept). Broken control (``wrong.npz``, ``wrong_logits.npy``): the rotary layout
(``rope="interleaved"``) for Qwen3 and Gemma 2, the experts read in the reverse order for the MoEs.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bridges import jax as bj  # noqa: E402
from bridges.jax._tree import flatten_with_keys, index_to_box, nest  # noqa: E402
from bridges.interop import preset_mapping  # noqa: E402
from bridges.mapping import Mapping, Reorder  # noqa: E402
from torchproc.jax_families import FORWARDS  # noqa: E402

#: Partition specs by key suffix (first match): heads and ffn over "model", d over "data",
#: experts over "model"; the rest (norms, q/k norms, the shared expert's gate) replicated.
SPECS = (("attn/o/kernel", P(None, "model", None, "data")), ("/bias", P(None, "model")),
         ("attn/q/kernel", P(None, "data", "model")), ("attn/k/kernel", P(None, "data", "model")),
         ("attn/v/kernel", P(None, "data", "model")), ("moe/router/kernel", P(None, None, "model")),
         ("moe/shared_gate/kernel", P()), ("shared/down/kernel", P(None, "model", "data")),
         ("shared/gate/kernel", P(None, "data", "model")), ("shared/up/kernel", P(None, "data", "model")),
         ("moe/gate/kernel", P(None, "model", "data")), ("moe/up/kernel", P(None, "model", "data")),
         ("moe/down/kernel", P(None, "model", "data")), ("mlp/down/kernel", P(None, "model", "data")),
         ("mlp/gate/kernel", P(None, "data", "model")), ("mlp/up/kernel", P(None, "data", "model")),
         ("embed/embedding", P("model", "data")), ("lm_head/kernel", P("data", "model")))


def spec(key: str) -> P:
    return next((s for suffix, s in SPECS if key.endswith(suffix)), P())


def experts_reversed(m: Mapping, experts: int) -> Mapping:
    """The broken control: every expert tensor read in the reverse expert order."""
    rev = (Reorder(1, tuple(reversed(range(experts)))),)
    return Mapping(tuple(replace(r, transforms=rev + r.transforms) if "experts" in r.target else r for r in m.rules),
                   m.ignore, m.keep, m.source_sep, m.target_sep, m.tiers)


def run(job: dict, mesh: jax.sharding.Mesh, ids: np.ndarray, work: str) -> None:
    out = os.path.join(work, job["family"])
    hf = os.path.join(out, "hf")
    cfg = json.load(open(os.path.join(hf, "config.json")))
    target = {"model": nest({k: jax.ShapeDtypeStruct(tuple(s), np.float32, sharding=NamedSharding(mesh, spec(k)))
                             for k, s in job["shapes"].items()})}
    right = preset_mapping(job["preset"], cfg, **job["kwargs"])
    if "experts" in job["kwargs"]:
        wrong = experts_reversed(right, job["experts"])
    else:
        wrong = preset_mapping(job["preset"], cfg, **dict(job["kwargs"], rope="interleaved"))
    fwd = jax.jit(lambda p, x: FORWARDS[job["family"]](p, x, cfg))
    x = jax.device_put(ids, NamedSharding(mesh, P()))
    for name, m in (("jax", right), ("wrong", wrong)):
        stats: dict = {}
        restored = bj.restore(hf, target, mapping=m.inverse(), stats=stats)
        flat = {k.split("/", 1)[1]: v for k, v in flatten_with_keys(restored)[0]}
        np.save(os.path.join(out, f"{name}_logits.npy" if name == "wrong" else "logits.npy"), np.asarray(fwd(flat, x)))
        np.savez(os.path.join(out, f"{name}.npz"), **{k.replace("/", "."): np.asarray(v) for k, v in flat.items()})
        if name == "jax":
            kept = [k for k, v in flat.items() if v.sharding.is_equivalent_to(NamedSharding(mesh, spec(k)), v.ndim)]
            total = sum(v.size * v.dtype.itemsize for v in flat.values())  # one process: all of it
            json.dump({"bytes_read": stats["reader"]["bytes_read"], "total": total, "kept": len(kept),
                       "leaves": len(flat), "split": sum(not v.sharding.is_fully_replicated for v in flat.values()),
                       "unexpected": len(stats["report"].unexpected)}, open(os.path.join(out, "result.json"), "w"))


def main() -> None:
    work = sys.argv[3]
    spec_file = json.load(open(os.path.join(work, "families.json")))
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    ids = np.asarray(spec_file["ids"], np.int32)
    for job in spec_file["families"]:
        run(job, mesh, ids, work)
        print(f"{job['family']}: restored", file=sys.stderr)


if __name__ == "__main__":
    main()
