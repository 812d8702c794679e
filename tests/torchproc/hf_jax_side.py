"""The JAX half of the Hugging Face acceptance tests (one process, 8 host CPU devices).

``produce <workdir>``: the NNX Llama and GPT-2 of ``jax_models`` train TRAIN_STEPS adamw steps on
the (4, 2) ("fsdp", "tensor") mesh and save ``{"model", "optimizer"}`` with ``bridges.jax.save``
(``<workdir>/llama``, ``<workdir>/gpt2``, step TRAIN_STEPS); their logits on EVAL_IDS go to
``jax_logits.npz``.

``roundtrip <workdir>``: restores what the torch side saved after one more step, for each model
twice, onto the mesh: ``<name>_mapped`` (written by ``bridges.torch.save(mapping=preset)``, in the
JAX layout: no mapping needed) and ``<name>_plain`` (the HF state dict as is, through
``preset.inverse()``); writes whether the two agree bit for bit and the restored Llama's logits
(``roundtrip.npz``), and saves the restored state again with ``bridges.jax.save``
(``<name>_back``) for the torch side to load. The target is the real ``nnx.Optimizer``'s
(optax's int32 ``count``, NNX's uint32 ``step``): the preset casts torch's float32 ``step``.

JAX -> torch -> JAX (also in ``roundtrip``): ``llama_j2t`` (the trained checkpoint loaded into
``LlamaForCausalLM`` + AdamW and saved straight back with ``mapping=preset``) restores into the
``nnx.Optimizer`` target with every leaf equal to the original's (``j2t_same``); ``llama_j2t_nocast``
(the same save through the preset with its Casts removed) must fail (``nocast_error``).

``llama_logits <url> <out.npz>``: restores the model of the newest step of a torch-written
checkpoint (``llama_e2e``: saved through DCP by 4 FSDP2 + TP ranks, the HF layout) into the JAX
Llama on the (4, 2) mesh through ``hf_llama_from_nnx(LLAMA).inverse()``, with no policy; writes
its logits on EVAL_IDS, and those of a restore through the wrong rotary layout (the control).
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from bridges import jax as bj  # noqa: E402
from bridges.jax._tree import flatten_with_keys  # noqa: E402
from bridges.flax import nnx_load, nnx_state, nnx_target, tree_equal_bits  # noqa: E402
from bridges.presets import hf_gpt2_from_nnx, hf_llama_from_nnx  # noqa: E402
from torchproc.hf_configs import EVAL_IDS, GPT2, LLAMA, SEQ, TRAIN_STEPS  # noqa: E402
from torchproc.jax_models import GPT2_SPECS, LLAMA_SPECS, Llama, GPT2 as GPT2Model, mesh, place, spec_for, train  # noqa: E402

MODELS = {"llama": (Llama, LLAMA, LLAMA_SPECS, hf_llama_from_nnx, 0),
          "gpt2": (GPT2Model, GPT2, GPT2_SPECS, hf_gpt2_from_nnx, 1)}


def produce(workdir: str) -> None:
    logits = {}
    for name, (cls, cfg, specs, _, seed) in MODELS.items():
        model = cls(SimpleNamespace(**cfg), nnx.Rngs(seed))
        opt, probe = train(model, specs, TRAIN_STEPS, cfg["vocab_size"], SEQ, seed, EVAL_IDS)
        bj.save(os.path.join(workdir, name), {"model": nnx_state(model), "optimizer": nnx_state(opt)},
                step=TRAIN_STEPS, extra={"config": cfg})
        logits[name] = probe()  # last: its update is thrown away
    np.savez(os.path.join(workdir, "jax_logits.npz"), **logits)


def _jax_torch_jax(workdir: str, target: dict) -> dict[str, np.ndarray]:
    """The trained Llama restored as JAX saved it, and after a trip through torch: bit for bit."""
    kw = dict(step=TRAIN_STEPS, rank_state_policy="drop")
    original = bj.restore(os.path.join(workdir, "llama"), target, **kw)
    back = bj.restore(os.path.join(workdir, "llama_j2t"), target, **kw)
    leaves = flatten_with_keys(original)[0]
    try:
        bj.restore(os.path.join(workdir, "llama_j2t_nocast"), target, **kw)
        error = ""
    except Exception as e:  # reported to the test, which checks the kind and the text
        error = f"{type(e).__name__}: {e}"
    return {"j2t_same": np.array(tree_equal_bits(original, back)), "j2t_leaves": np.array(len(leaves)),
            "j2t_keys": np.array(sorted(k for k, _ in leaves)), "nocast_error": np.array(error)}


def roundtrip(workdir: str) -> None:
    m = mesh()
    out = {}
    for name, (cls, cfg, specs, preset, seed) in MODELS.items():
        abstract = nnx.eval_shape(lambda: cls(SimpleNamespace(**cfg), nnx.Rngs(seed)))  # noqa: B023
        shard = lambda k, leaf: NamedSharding(m, spec_for(specs, k))  # noqa: E731,B023
        params = nnx_target(abstract, shard)
        abstract_opt = nnx.eval_shape(lambda: nnx.Optimizer(  # noqa: B023
            cls(SimpleNamespace(**cfg), nnx.Rngs(seed)), optax.adamw(1e-2, weight_decay=0.01), wrt=nnx.Param))
        target = {"model": params, "optimizer": nnx_target(abstract_opt, shard)}
        if name == "llama":
            out.update(_jax_torch_jax(workdir, target))
        step = TRAIN_STEPS + 1
        mapped = bj.restore(os.path.join(workdir, f"{name}_mapped"), target, step=step, rank_state_policy="drop")
        plain = bj.restore(os.path.join(workdir, f"{name}_plain"), target, step=step, rank_state_policy="drop",
                           mapping=preset(cfg).inverse())
        out[f"{name}_same"] = np.array(tree_equal_bits(mapped, plain))
        out[f"{name}_sharded"] = np.array(all(
            v.sharding.is_equivalent_to(shard(k, v), v.ndim)
            for k, v in flatten_with_keys(plain)[0]))
        if name == "llama":
            model = cls(SimpleNamespace(**cfg), nnx.Rngs(seed))
            place(model, specs, m)
            nnx_load(model, plain["model"])
            out["llama_logits"] = np.asarray(nnx.jit(lambda mdl, ids: mdl(ids))(model, jnp.asarray(EVAL_IDS)))
        bj.save(os.path.join(workdir, f"{name}_back"), plain, step=step)
    np.savez(os.path.join(workdir, "roundtrip.npz"), **out)


def llama_logits(url: str, out: str) -> None:
    m = mesh()
    cfg = SimpleNamespace(**LLAMA)
    abstract = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))
    target = {"model": nnx_target(abstract, lambda k, leaf: NamedSharding(m, spec_for(LLAMA_SPECS, k)))}
    model = Llama(cfg, nnx.Rngs(1))
    place(model, LLAMA_SPECS, m)
    forward = nnx.jit(lambda mdl, ids: mdl(ids))
    res = {}
    for name, rope in (("logits", "halves"), ("wrong_rope", "interleaved")):
        got = bj.restore(url, target, mapping=hf_llama_from_nnx(LLAMA, rope=rope).inverse())
        nnx_load(model, got["model"])
        res[name] = np.asarray(forward(model, jnp.asarray(EVAL_IDS)))
    np.savez(out, **res)


if __name__ == "__main__":
    if sys.argv[1] == "llama_logits":
        llama_logits(sys.argv[2], sys.argv[3])
    else:
        {"produce": produce, "roundtrip": roundtrip}[sys.argv[1]](sys.argv[2])
