"""Unit checks of bridges.jax / bridges.flax, run in ONE fresh process with 8 CPU devices.

tests/test_jax_bridge.py runs this once and reports each check as its own test.
usage: bridge_checks.py OUT_JSON [check ...]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import bridges.jax as bj  # noqa: E402
from ckptfmt import KeyMismatchError, Repository, ShapeMismatchError  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
DEV = jax.devices()
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def mesh(shape, names, devices=None):
    devs = np.asarray(DEV if devices is None else devices)[: int(np.prod(shape))]
    return Mesh(devs.reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def put(x, m, spec):
    return jax.device_put(x, NamedSharding(m, spec))


def bits(a):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    a = np.asarray(a)
    return a.dtype.name, a.shape, a.tobytes()


def same(a, b):
    assert bits(a) == bits(b), f"{bits(a)[:2]} != {bits(b)[:2]}"


def sds(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def tensors(url, step):
    return Repository(url).manifest(step).tensors


# ----------------------------------------------------------------------------------- checks


@check
def named_1d(d):
    m8 = mesh((8,), ("x",))
    a = put(jnp.arange(64 * 6, dtype=jnp.float32).reshape(64, 6), m8, P("x"))
    bj.save(d, {"a": a}, step=1)
    t = tensors(d, 1)["a"]
    assert t.array.shard_shape == (8, 6), t.array.shard_shape
    assert t.sharding["partition"] == [["x"], None] and t.sharding["mesh_shape"] == [8], t.sharding
    for target_mesh, spec in ((mesh((4,), ("y",)), P("y")), (mesh((2,), ("y",), DEV[5:7]), P(None, "y"))):
        r = bj.restore(d, {"a": sds(a, NamedSharding(target_mesh, spec))})
        same(r["a"], a)
        assert r["a"].sharding == NamedSharding(target_mesh, spec)


@check
def named_2d(d):
    m = mesh((4, 2), ("data", "model"))
    a = put(jax.random.normal(jax.random.key(0), (16, 8)), m, P("data", "model"))
    bj.save(d, {"w": a}, step=1)
    t = tensors(d, 1)["w"]
    assert t.array.shard_shape == (4, 4) and len(t.shards.writer) == 8
    assert t.sharding["replicated_axes"] == [], t.sharding
    m2 = mesh((2, 2), ("a", "b"), DEV[4:])
    r = bj.restore(d, {"w": sds(a, NamedSharding(m2, P("b", "a")))})  # transposed layout
    same(r["w"], a)
    assert {s.device.id for s in r["w"].addressable_shards} == {4, 5, 6, 7}
    same(bj.restore(d)["w"], a)  # host numpy


@check
def fully_replicated(d):
    m = mesh((4, 2), ("data", "model"))
    a = put(jnp.arange(12.0).reshape(3, 4), m, P())
    shards, _ = bj._api._to_shards({"a": a}, copy=False)
    assert len(shards) == 8 and sum(s.data is not None for s in shards) == 1  # only replica 0 offers data
    bj.save(d, {"a": a}, step=1)
    t = tensors(d, 1)["a"]
    assert [int(w) for w in t.shards.writer] == [0] and len(t.shards.writer) == 1
    assert t.sharding["replicated_axes"] == ["data", "model"], t.sharding
    same(bj.restore(d, {"a": sds(a, NamedSharding(mesh((2,), ("x",)), P(None, "x")))})["a"], a)


@check
def partially_replicated(d):
    m = mesh((4, 2), ("data", "model"))
    a = put(jnp.arange(32.0).reshape(16, 2), m, P("data"))  # replicated over "model"
    shards, _ = bj._api._to_shards({"a": a}, copy=False)
    live = [s for s in shards if s.data is not None]
    assert len(shards) == 8 and len(live) == 4 and all(s.replica_id == 0 for s in live)
    assert len({s.box for s in live}) == 4
    bj.save(d, {"a": a}, step=1)
    t = tensors(d, 1)["a"]
    assert len(t.shards.writer) == 4 and t.sharding["replicated_axes"] == ["model"]
    same(bj.restore(d, {"a": sds(a, NamedSharding(m, P(None, "model")))})["a"], a)


@check
def single_device(d):
    a = jax.device_put(jnp.arange(10, dtype=jnp.int32), DEV[3])
    bj.save(d, {"a": a, "b": jnp.ones((2, 3))}, step=1)
    assert tensors(d, 1)["a"].sharding is None
    r = bj.restore(d, {"a": sds(a, SingleDeviceSharding(DEV[6])), "b": jax.ShapeDtypeStruct((2, 3), jnp.float32)})
    same(r["a"], a)
    assert r["a"].devices() == {DEV[6]} and r["b"].devices() == {jax.local_devices()[0]}


@check
def uneven_shapes(d):
    # Shapes that do not split evenly on the saving or the restoring mesh along every dimension.
    a = put(jnp.arange(7 * 12, dtype=jnp.float32).reshape(7, 12), mesh((4,), ("x",)), P(None, "x"))
    b = put(jnp.arange(10 * 3, dtype=jnp.int16).reshape(10, 3), mesh((5,), ("x",)), P("x"))
    bj.save(d, {"a": a, "b": b}, step=1)
    assert tensors(d, 1)["a"].array.shard_shape == (7, 3) and tensors(d, 1)["b"].array.shard_shape == (2, 3)
    # 12 columns in 3s restored in 4s; 10 rows in 2s restored in 5s (boundaries do not line up).
    r = bj.restore(d, {"a": sds(a, NamedSharding(mesh((3,), ("y",)), P(None, "y"))),
                       "b": sds(b, NamedSharding(mesh((2,), ("y",), DEV[3:]), P("y")))})
    same(r["a"], a)
    same(r["b"], b)


@check
def scalars_and_leaves(d):
    state = {"step": 7, "lr": 0.5, "flag": True, "name": "run-1", "none": None, "blob": b"\x00\x01",
             "np_i": np.int64(2 ** 40), "np_h": np.float16(1.5), "big": 2 ** 80,
             "j0": jnp.float32(3.25), "np0": np.array(4, dtype=np.uint8), "arr": np.arange(5.0)}
    bj.save(d, state, step=1)
    assert set(tensors(d, 1)) == {"j0", "np0", "arr"}
    host = bj.restore(d)
    for k in ("step", "lr", "flag", "name", "blob", "big"):
        assert host[k] == state[k] and type(host[k]) is type(state[k]), (k, host[k])
    assert type(host["np_i"]) is np.int64 and host["np_i"] == 2 ** 40 and type(host["np_h"]) is np.float16
    assert "none" not in host  # None is an empty pytree node, not a leaf
    same(host["j0"], state["j0"])
    same(host["np0"], state["np0"])
    target = dict(state, j0=jax.ShapeDtypeStruct((), jnp.float32, sharding=SingleDeviceSharding(DEV[2])),
                  np0=np.zeros((), np.uint8), arr=np.zeros(5))
    r = bj.restore(d, target)
    assert isinstance(r["j0"], jax.Array) and r["j0"].devices() == {DEV[2]}
    assert isinstance(r["np0"], np.ndarray) and r["step"] == 7 and r["name"] == "run-1"
    same(r["arr"], state["arr"])


@check
def low_precision_dtypes(d):
    m = mesh((4, 2), ("data", "model"))
    x = jax.random.normal(jax.random.key(1), (8, 4))
    state = {"bf16": put(x.astype(jnp.bfloat16), m, P("data", "model")),
             "f8": put(x.astype(jnp.float8_e4m3fn), m, P("data")), "b": put(x > 0, m, P(None, "model")),
             "f16": jnp.arange(8, dtype=jnp.float16)}
    bj.save(d, state, step=1)
    assert tensors(d, 1)["bf16"].dtype == "bfloat16"
    r = bj.restore(d, bj.abstract_target(state, NamedSharding(mesh((2,), ("x",)), P())))
    for k in state:
        same(r[k], state[k])
    stats = {}  # bfloat16 -> float32: one kind, cast and reported
    wide = bj.restore(d, {"bf16": jax.ShapeDtypeStruct((8, 4), jnp.float32)}, stats=stats)
    assert wide["bf16"].dtype == jnp.float32 and stats["report"].cast == ("bf16: bfloat16 -> float32",)
    assert np.array_equal(np.asarray(wide["bf16"]), np.asarray(state["bf16"]).astype(np.float32))
    try:
        bj.restore(d, {"bf16": jax.ShapeDtypeStruct((8, 4), jnp.int32)})
        raise AssertionError("dtype mismatch not detected")
    except ShapeMismatchError as e:  # across kinds
        assert e.key == "bf16" and "bfloat16" in str(e)


@check
def typed_and_raw_keys(d):
    m = mesh((4, 2), ("data", "model"))
    fry = put(jax.random.split(jax.random.key(3), 8), m, P("data"))
    rbg = jax.random.split(jax.random.key(4, impl="rbg"), 4)
    raw = jax.random.PRNGKey(5)
    bj.save(d, {"fry": fry, "rbg": rbg, "one": jax.random.key(9), "raw": raw}, step=1)
    t = tensors(d, 1)
    assert t["fry"].dtype == "uint32" and t["fry"].shape == (8, 2) and t["rbg"].shape == (4, 4)
    glob = Repository(d).open(1).state()["bridge"]["prng_impls"]
    assert glob == {"fry": "threefry2x32", "rbg": "rbg", "one": "threefry2x32"}, glob
    m2 = mesh((2,), ("x",), DEV[2:])
    target = {"fry": sds(fry, NamedSharding(m2, P("x"))), "rbg": sds(rbg, NamedSharding(m2, P())),
              "one": jax.eval_shape(lambda: jax.random.key(0)), "raw": sds(raw, NamedSharding(m2, P()))}
    r = bj.restore(d, target)
    for k in ("fry", "rbg", "raw"):
        same(r[k], {"fry": fry, "rbg": rbg, "raw": raw}[k])
    assert r["fry"].dtype == fry.dtype and r["rbg"].dtype == rbg.dtype and r["raw"].dtype == jnp.uint32
    assert r["fry"].sharding == NamedSharding(m2, P("x"))
    same(jax.random.normal(r["fry"][3], (4,)), jax.random.normal(fry[3], (4,)))
    host = bj.restore(d)
    assert host["one"].dtype == jax.random.key(0).dtype and host["raw"].dtype == np.uint32
    for bad in ({"fry": jax.ShapeDtypeStruct((8,), jax.random.key(0, impl="rbg").dtype)},  # wrong impl
                {"fry": jax.ShapeDtypeStruct((4,), fry.dtype)},  # wrong shape
                {"raw": jax.ShapeDtypeStruct((), jax.random.key(0).dtype)}):  # raw saved, typed asked
        try:
            bj.restore(d, bad)
            raise AssertionError(f"mismatch not detected: {bad}")
        except ShapeMismatchError as e:
            assert e.key in bad, e


@check
def missing_key_and_shape_mismatch(d):
    a = jnp.zeros((4, 4))
    bj.save(d, {"a": a, "b": 1}, step=1)
    for target, err, key in (({"a": jax.ShapeDtypeStruct((4, 5), jnp.float32)}, ShapeMismatchError, "a"),
                             ({"a": a, "zz": a}, KeyMismatchError, "zz"),
                             ({"a": a, "c": 3}, KeyMismatchError, "c")):
        try:
            bj.restore(d, target)
            raise AssertionError("not detected")
        except err as e:
            assert e.key == key, e


@check
def host_structure(d):
    state = {"layers": [{"w": jnp.ones(2)}, {"w": jnp.zeros(2)}], "opt": (jnp.ones(1), 3), "s": {"t": 1.0}}
    bj.save(d, state, step=1)
    host = bj.restore(d)
    assert set(host) == {"layers", "opt", "s"} and set(host["layers"]) == {"0", "1"}
    assert isinstance(host["layers"]["1"]["w"], np.ndarray) and host["opt"]["1"] == 3
    r = bj.restore(d, state)  # with a target the structure comes back as it was (lists, tuples)
    assert isinstance(r["layers"], list) and isinstance(r["opt"], tuple)
    assert jax.tree_util.tree_structure(r) == jax.tree_util.tree_structure(state)


@check
def key_paths(d):
    from bridges.jax._tree import flatten_with_keys

    import optax

    params = {"dense": {"kernel": jnp.ones((2, 2))}}
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.linear_schedule(1.0, 0.1, 10))).init(params)
    keys = [k for k, _ in flatten_with_keys({"opt": opt, "l": [1, (2, 3)], "m": {5: 1.0}})[0]]
    assert "opt/1/0/mu/dense/kernel" in keys and "opt/1/0/count" in keys and "l/1/0" in keys and "m/5" in keys, keys
    for bad, exc in (({"a/b": 1}, ValueError), ({0: 1, "0": 2}, ValueError), ({"": 1}, ValueError),
                     ({(1, 2): 1}, ValueError), ({"a": object()}, TypeError), (jnp.ones(2), ValueError)):
        try:
            bj.save(d, bad, step=9)
            raise AssertionError(f"accepted {bad!r}")
        except exc:
            pass
    assert Repository(d).steps() == [], "a rejected state wrote a step"


@check
def linen_trainstate(d):
    import flax.linen as linen
    import optax
    from flax.training import train_state

    class Net(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(3)(linen.relu(linen.Dense(8)(x)))

    net = Net()
    params = net.init(jax.random.key(0), jnp.ones((1, 4)))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.cosine_decay_schedule(1e-2, 100)))
    st = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)
    grads = jax.grad(lambda p: jnp.sum(net.apply(p, jnp.ones((2, 4)))))(st.params)
    st = st.apply_gradients(grads=grads)
    m = mesh((4, 2), ("data", "model"))
    st = jax.tree_util.tree_map(lambda x: put(x, m, P()), st)
    bj.save(d, {"train": st}, step=int(st.step))
    keys = set(tensors(d, 1))
    assert "train/params/params/Dense_0/kernel" in keys and "train/opt_state/1/0/nu/params/Dense_1/bias" in keys, keys
    fresh = train_state.TrainState.create(apply_fn=net.apply, params=net.init(jax.random.key(1), jnp.ones((1, 4))),
                                          tx=tx)
    r = bj.restore(d, {"train": bj.abstract_target(fresh, NamedSharding(mesh((2,), ("x",)), P()))})["train"]
    assert isinstance(r, train_state.TrainState) and r.apply_fn == net.apply, r
    assert int(r.step) == 1, r.step
    for x, y in zip(jax.tree_util.tree_leaves(r), jax.tree_util.tree_leaves(st)):
        same(x, y)


@check
def nnx_model_and_optimizer(d):
    import optax
    from flax import nnx

    from bridges.flax import nnx_load, nnx_state, nnx_target, tree_equal_bits

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])

        def __call__(self, x):
            x = self.drop(self.l1(x))
            for b in self.blocks:
                x = b(x)
            return x

    model = Net(nnx.Rngs(0, dropout=1))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((2, 4)))))(model)
    opt.update(model, grads)
    state = {"model": nnx_state(model), "opt": nnx_state(opt)}
    bj.save(d, state, step=1)
    keys = set(tensors(d, 1))
    assert {"model/blocks/1/kernel", "model/drop/rngs/key", "opt/opt_state/0/mu/blocks/0/bias"} <= keys, keys
    model2 = Net(nnx.Rngs(5, dropout=6))
    opt2 = nnx.Optimizer(model2, optax.adamw(1e-2), wrt=nnx.Param)
    m = mesh((2,), ("x",))
    target = {"model": nnx_target(model2, NamedSharding(m, P())), "opt": nnx_target(opt2, NamedSharding(m, P()))}
    r = bj.restore(d, target)
    nnx_load(model2, r["model"])
    nnx_load(opt2, r["opt"])
    assert tree_equal_bits(nnx_state(model2), state["model"]) and tree_equal_bits(nnx_state(opt2), state["opt"])
    same(model2(jnp.ones((1, 4))), model(jnp.ones((1, 4))))  # same dropout stream too


@check
def extra_rank_state_and_latest(d):
    bj.save(d, {"a": jnp.ones(2)}, step=1, extra={"note": "first"})
    bj.save(d, {"a": jnp.zeros(2)}, step=2, extra={"note": "second", "cursor": [1, 2]},
            rank_state={"np_rng": np.random.default_rng(1).bit_generator.state})
    assert bj.load_extra(d) == {"note": "second", "cursor": [1, 2]} and bj.load_extra(d, 1) == {"note": "first"}
    same(bj.restore(d)["a"], jnp.zeros(2))
    same(bj.restore(d, step=1)["a"], jnp.ones(2))
    rs = bj.load_rank_state(d)
    g = np.random.default_rng()
    g.bit_generator.state = rs["np_rng"]
    assert g.integers(1 << 30) == np.random.default_rng(1).integers(1 << 30)
    assert bj.load_rank_state(d, 1) is None
    # An unknown policy is a usage error naming the accepted ones (ValueError, not a topology fault).
    for call in (lambda: bj.restore(d, rank_state_policy="bogus"),
                 lambda: bj.load_rank_state(d, rank_state_policy="bogus")):
        try:
            call()
            raise AssertionError("unknown policy accepted")
        except ValueError as e:
            assert "'drop', 'rank0', 'same-rank'" in str(e), e
    assert bj.load_rank_state(d, rank_state_policy="same-rank")["np_rng"] == rs["np_rng"]  # control


@check
def reference_cycles(d):
    """A pytree, extra or rank_state that contains itself: ReferenceCycleError naming where the
    cycle closes, nothing written, and the interpreter still sound (jax.tree_util raised a
    SystemError on such a list)."""
    from ckptfmt import ReferenceCycleError

    loop = [jnp.ones(3)]
    loop.append(loop)
    ex = {"note": 1}
    ex["self"] = ex
    rs = [1]
    rs.append(rs)
    cases = [({"l": loop}, {}, "l/1"), ({"a": jnp.ones(2)}, {"extra": ex}, "extra/self"),
             ({"a": jnp.ones(2)}, {"rank_state": {"r": rs}}, "rank_state/r/1")]
    for _ in range(2):  # twice: the first failure leaves nothing behind
        for state, kw, where in cases:
            try:
                bj.save(d, state, step=1, **kw)
                raise AssertionError(f"a cycle at {where} was saved")
            except ReferenceCycleError as e:
                assert e.key == where and where in str(e), e
            assert not os.path.exists(d), os.listdir(d)  # raised before anything was written
    # Control: the same process saves and restores a normal state, and a shared (acyclic) subtree.
    sub = {"w": jnp.arange(3.0)}
    bj.save(d, {"p": sub, "q": sub, "l": [jnp.ones(3)]}, step=1, extra={"a": [1], "b": [1]})
    got = bj.restore(d)
    same(got["p"]["w"], sub["w"])
    same(got["q"]["w"], sub["w"])
    assert jax.tree_util.tree_structure({"x": [1, 2]}).num_leaves == 2


@check
def profile_record_checked(d):
    # FORMAT.md 13.1/13.2: a malformed JAX profile record is refused (InvalidStateError), never
    # guessed at; each bad record sits beside the good one it was derived from (the control).
    import ckptfmt
    from ckptfmt import Box, InvalidStateError, LocalShard

    def core_save(url, bridge):
        x, k = np.arange(3, dtype=np.float32), np.array([0, 42], np.uint32)
        shards = [LocalShard("x", (3,), x.dtype, Box.full((3,)), x), LocalShard("k", (2,), k.dtype, Box.full((2,)), k)]
        ckptfmt.save(url, 1, shards, state={"bridge": bridge, "extra": None})

    good = {"name": "jax", "version": 1, "leaves": {"n": 3}, "prng_impls": {"k": "threefry2x32"}}
    bad = [dict(good, version=2), dict(good, version=True), dict(good, name="flax"), dict(good, leaves=[1]),
           dict(good, prng_impls={"x": "threefry2x32"}), dict(good, prng_impls={"k": 5}),
           dict(good, prng_impls={"nope": "threefry2x32"}), dict(good, leaves={"x": 1}), "jax"]
    for i, b in enumerate(bad):
        url = os.path.join(d, f"bad{i}")
        core_save(url, b)
        try:
            bj.restore(url)
            raise AssertionError(f"malformed profile record accepted: {b!r}")
        except InvalidStateError as e:
            assert e.key == "bridge", e
    url = os.path.join(d, "good")
    core_save(url, good)
    got = bj.restore(url)
    assert got["n"] == 3 and str(jax.random.key_impl(got["k"])) == "threefry2x32"
    assert np.asarray(jax.random.key_data(got["k"])).tolist() == [0, 42]


@check
def nonblocking_save(d):
    a = jnp.arange(8.0)
    pending = bj.save(d, {"a": a}, step=3, blocking=False)
    try:
        bj.save(d, {"a": a}, step=4)
        second = "accepted"
    except Exception as e:  # noqa: BLE001
        second = type(e).__name__
    import ckptfmt

    assert isinstance(pending, ckptfmt.SaveHandle) and pending.snapshot_bytes == a.nbytes  # the core's handle
    manifest = pending.result(60)
    assert manifest.step == 3 and pending.done()
    assert second in ("SaveInProgressError", "accepted"), second  # accepted only if it already finished
    same(bj.restore(d, step=3)["a"], a)


@check
def restore_stats_and_partial(d):
    m = mesh((4, 2), ("data", "model"))
    state = {"big": put(jnp.ones((64, 64)), m, P("data", "model")), "small": jnp.ones(3)}
    bj.save(d, state, step=1)
    stats = {}
    r = bj.restore(d, {"small": jax.ShapeDtypeStruct((3,), jnp.float32)}, stats=stats)  # partial restore
    same(r["small"], state["small"])
    assert stats["bytes_restored"] == 12 and stats["reader"]["bytes_read"] < 64 * 64 * 4, stats
    for k in ("open_s", "plan_s", "read_s", "build_s"):
        assert stats[k] >= 0
    # Restoring onto 2 of the 8 devices, sharded: each box is read once even if replicated.
    m2 = mesh((2,), ("x",), DEV[:2])
    stats = {}
    bj.restore(d, {"big": sds(state["big"], NamedSharding(m2, P("x")))}, stats=stats)
    assert stats["boxes"] == 2 and stats["bytes_restored"] == 64 * 64 * 4, stats
    stats = {}
    bj.restore(d, {"big": sds(state["big"], NamedSharding(m2, P()))}, stats=stats)
    assert stats["boxes"] == 1 and stats["bytes_restored"] == 64 * 64 * 4, stats  # deduplicated


@check
def mapping_strict_and_report(d):
    """restore(mapping=...): torch-style per-layer keys into one stacked, transposed, sharded
    tensor; a rule that does not fit names itself; strict=False keeps a missing leaf as given
    (abstract stays abstract), reports it and warns; strict=True raises (the control)."""
    import warnings

    from bridges.mapping import KeptValuesWarning, Mapping, MappingError, Merge, Rule, Select, Transpose

    layers = {f"layers.{i}.w": np.arange(24, dtype=np.float32).reshape(4, 6) + 100 * i for i in range(4)}
    bj.save(d, layers, step=1)
    fwd = Mapping((Rule("stacked", "layers.{i}.w", transforms=(Select(0, "i", 4), Transpose((1, 0)))),),
                  source_sep="/", target_sep=".")
    m = mesh((4, 2), ("data", "model"))
    sharding = NamedSharding(m, P("data", "model"))
    target = {"stacked": jax.ShapeDtypeStruct((4, 6, 4), jnp.float32, sharding=sharding)}
    stats = {}
    got = bj.restore(d, target, mapping=fwd.inverse(), stats=stats)
    assert np.array_equal(np.asarray(got["stacked"]), np.stack([v.T for v in layers.values()]))
    assert got["stacked"].sharding.is_equivalent_to(sharding, 3)
    assert stats["report"].loaded == ("stacked",) and stats["report"].missing == (), stats["report"]
    bad = Mapping((Rule("stacked", "layers.{i}.w", transforms=(Select(0, "i", 4), Merge(0, (2, 3)))),),
                  source_sep="/", target_sep=".")
    try:
        bj.restore(d, target, mapping=bad.inverse())
        raise AssertionError("a rule that does not fit restored")
    except MappingError as e:
        assert "Unmerge" in str(e) and "'layers.{i}.w' -> 'stacked'" in str(e), str(e)
    absent = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(m, P()))
    try:
        bj.restore(d, dict(target, absent=absent), mapping=fwd.inverse())
        raise AssertionError("strict restore of a missing key")
    except KeyMismatchError as e:
        assert e.key == "absent"
    stats = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = bj.restore(d, dict(target, absent=absent), mapping=fwd.inverse(), strict=False, stats=stats)
    assert got["absent"] is absent and isinstance(got["stacked"], jax.Array)
    assert stats["report"].missing == ("absent",) and stats["report"].kept == ("absent",)
    assert [w.category for w in caught] == [KeptValuesWarning] and "absent" in str(caught[0].message)


@check
def default_placement(d):
    """Issue 47 item 9: a leaf JAX placed by default (uncommitted: optax's count, a fresh jnp array)
    comes back uncommitted, so a jitted step beside mesh arrays runs; a committed leaf keeps its
    placement, one device included. The control: the same count committed to device 0 (as
    restores placed it before) makes that step raise."""
    m = mesh((8,), ("x",))
    w = put(jnp.arange(16.0).reshape(8, 2), m, P("x"))
    state = {"w": w, "count": jnp.zeros((), jnp.int32), "key": jax.random.key(3),
             "pinned": jax.device_put(jnp.ones(2), DEV[3])}
    assert not state["count"].committed and state["pinned"].committed
    bj.save(d, state, step=1)
    target = bj.abstract_target(state)
    assert target["count"].sharding is None and target["key"].sharding is None
    assert target["w"].sharding == w.sharding and target["pinned"].sharding == SingleDeviceSharding(DEV[3])
    assert state["count"].committed is False and state["w"] is w  # the caller's tree is untouched

    @jax.jit
    def step(w, count, key):
        return w * (count + 1).astype(w.dtype) + jax.random.uniform(key, w.shape), count + 1

    for got in (bj.restore(d, target), bj.restore(d, state)):  # abstract and live targets alike
        for k in state:
            same(got[k], state[k])
        assert not got["count"].committed and not got["key"].committed
        assert got["pinned"].committed and got["pinned"].devices() == {DEV[3]}
        assert got["w"].sharding == w.sharding
        _, count = step(got["w"], got["count"], got["key"])
        assert int(count) == 1
    pinned = bj.restore(d, {"count": sds(state["count"], SingleDeviceSharding(DEV[0]))})["count"]
    assert pinned.committed
    try:
        step(w, pinned, state["key"])
        raise AssertionError("the control: a count committed to device 0 beside mesh arrays ran")
    except ValueError as e:
        assert "incompatible devices" in str(e), e


def _empty_state(m):
    return {"e": jnp.zeros((0, 4)), "es": put(jnp.zeros((8, 0), jnp.bfloat16), m, P("x")),
            "n": np.zeros((0,), np.int16), "keys": jax.random.split(jax.random.key(0), 0), "w": jnp.ones(3)}


def _check_empties(got, state, target):
    for k in ("e", "es", "keys"):
        assert isinstance(got[k], jax.Array) and not isinstance(got[k], jax.ShapeDtypeStruct), (k, type(got[k]))
        assert got[k].shape == state[k].shape and got[k].dtype == state[k].dtype, (k, got[k])
        assert (got[k].sharding == target[k].sharding) if target[k].sharding is not None else not got[k].committed, k
    assert isinstance(got["n"], np.ndarray) and got["n"].shape == (0,) and got["n"].dtype == np.int16
    assert got["n"] is not state["n"]  # a fresh array, never the caller's own
    assert jnp.concatenate([got["e"], jnp.ones((1, 4))]).shape == (1, 4)  # a resumed state computes
    same(got["w"], state["w"])


@check
def empty_arrays(d):
    """Issue 47 item 10: a size-0 tensor restores as a real array of the target's shape, dtype and
    sharding (it has no shards to read: FORMAT.md 5.7), on the saving topology and another."""
    m = mesh((8,), ("x",))
    state = _empty_state(m)
    bj.save(d, state, step=1)
    assert {"e", "es", "n", "keys", "w"} == set(tensors(d, 1))
    target = bj.abstract_target(state)
    _check_empties(bj.restore(d, target), state, target)
    m4 = mesh((4,), ("y",))  # another topology
    resharded = dict(target, es=sds(state["es"], NamedSharding(m4, P("y"))))
    _check_empties(bj.restore(d, resharded), state, resharded)


@check
def empty_arrays_targetless(d):
    """Issue 47 item 10: without a target, every tensor of the manifest comes back (FORMAT.md 13.2),
    the size-0 ones as empty arrays."""
    state = _empty_state(mesh((8,), ("x",)))
    bj.save(d, state, step=1)
    flat = bj.restore(d)
    assert set(flat) == {"e", "es", "n", "keys", "w"}, sorted(flat)
    for k in ("e", "es", "n"):
        assert isinstance(flat[k], np.ndarray) and flat[k].shape == state[k].shape, (k, flat[k])
        assert flat[k].dtype == np.dtype(state[k].dtype), (k, flat[k].dtype)
    assert flat["keys"].shape == (0,) and jax.dtypes.issubdtype(flat["keys"].dtype, jax.dtypes.prng_key)


@check
def empty_arrays_manager(d):
    """Issue 47 item 10 through CheckpointManager.restore (the persistent tier, then a local tier)."""
    from ckptfmt.manager import LocalTier

    m = mesh((8,), ("x",))
    state = _empty_state(m)
    target = bj.abstract_target(state)
    with bj.CheckpointManager(d) as mgr:
        mgr.save(1, state, force=True)
        mgr.wait()
        _check_empties(mgr.restore(target).state, state, target)
    with bj.CheckpointManager(d + "-tiered", local=LocalTier(d + "-local", every=1)) as mgr:
        mgr.save(1, state, force=True)
        mgr.wait()
        r = mgr.restore(target)
        assert r.stats["tiers"]["local"] > 0, r.stats
        _check_empties(r.state, state, target)


@check
def layout_cache_follows_sharding(d):
    """The bridge computes each (shape, dtype, sharding)'s shard layout once: a later save of the
    same key with another sharding takes the new layout (its boxes and description), and the
    same sharding again takes the first (the control)."""
    x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    a, b = mesh((2, 4), ("data", "model")), mesh((4, 2), ("data", "model"))
    placed = [put(x, a, P("data", "model")), put(x + 1, b, P("model", "data")), put(x + 2, a, P("data", "model"))]
    for step, arr in enumerate(placed, 1):
        bj.save(d, {"w": arr}, step=step)
    repo = Repository(d)
    for step, arr in enumerate(placed, 1):
        t = repo.manifest(step).tensors["w"]
        want = sorted({tuple(s.start or 0 for s in sh.index) for sh in arr.addressable_shards})
        assert sorted(map(tuple, t.shards.offset.tolist())) == want, (step, t.shards.offset.tolist(), want)
        mesh_shape = (2, 4) if step != 2 else (4, 2)
        assert list(t.sharding["mesh_shape"]) == list(mesh_shape), (step, t.sharding)
        same(bj.restore(d, step=step)["w"], arr)
    assert repo.manifest(2).tensors["w"].sharding["partition"] != repo.manifest(1).tensors["w"].sharding["partition"]


@check
def manager_tier_and_persistent_copy_once(d):
    """A manager step where the local tier and the persistent save are both due copies the state
    to host memory once (bj._api._HOST_COPIES), and both saves hold it exactly; the control is one
    asynchronous bridge save of the same state, which copies the same bytes once."""
    from ckptfmt.manager import LocalTier

    m = mesh((2, 4), ("data", "model"))
    state = {"w": put(jnp.arange(64.0 * 32).reshape(64, 32), m, P("data", "model")),
             "r": put(jnp.arange(8.0), m, P()), "n": 3}
    before = bj._api._HOST_COPIES.bytes
    bj.save(d + "-control", state, step=1, blocking=False).result(60)
    once = bj._api._HOST_COPIES.bytes - before
    assert once == 64 * 32 * 4 + 8 * 4, once  # every box once: the replicated one from its lowest replica
    with bj.CheckpointManager(d, save_every_steps=2, local=LocalTier(d + "-local", every=2)) as mgr:
        before = bj._api._HOST_COPIES.bytes
        assert mgr.save(2, state)
        mgr.wait()
        assert bj._api._HOST_COPIES.bytes - before == once, (bj._api._HOST_COPIES.bytes - before, once)
        assert mgr.tier_history[-1].committed and mgr.tier_history[-1].own_bytes == once
        r = mgr.restore(bj.abstract_target(state))
        assert r.stats["tiers"]["local"] > 0, r.stats
        same(r.state["w"], state["w"])
        same(r.state["r"], state["r"])
        assert r.state["n"] == 3
    got = bj.restore(d, bj.abstract_target(state), step=2)
    same(got["w"], state["w"])
    same(got["r"], state["r"])


@check
def key_path_cache_is_exact(d):
    """flatten_with_keys renders a structure's key paths once (bridges/jax/_tree.py _KEYS): a tree
    of an equal structure takes them from the cache, and one the treedef calls equal but renders
    differently is rendered anew: ``{True: x}`` equals ``{1: x}`` as a treedef and must still be
    refused. Control: ``{1: x}`` renders ``1`` both times, and a refused tree is refused again."""
    from bridges.jax import _tree

    x = jnp.ones(2)
    first = _tree.flatten_with_keys({"a": {1: x}, "b": [x, x]})[0]
    again = _tree.flatten_with_keys({"a": {1: x + 1}, "b": [x, x]})[0]
    assert [k for k, _ in first] == [k for k, _ in again] == ["a/1", "b/0", "b/1"], (first, again)
    assert float(again[0][1][0]) == 2.0, again  # the leaves are the new tree's
    assert jax.tree_util.tree_structure({"a": {True: x}}) == jax.tree_util.tree_structure({"a": {1: x}})
    _tree.flatten_with_keys({"a": {1: x}})
    for _ in range(2):
        try:
            _tree.flatten_with_keys({"a": {True: x}})
            raise AssertionError("a bool dict key was accepted from the cache of an int key")
        except ValueError as e:
            assert "only str and int keys" in str(e), e
    cached = len(_tree._KEYS)
    for _ in range(3):
        _tree.flatten_with_keys({"a": {1: x}})
    assert len(_tree._KEYS) == cached, (len(_tree._KEYS), cached)


@check
def offered_shards_are_addressable_data(d):
    """The caller's copy takes the offered shards from jax's per-device list in one call
    (bridges/jax/_api.py _offered_data): each is the array ``addressable_data`` gives for that
    position (same device, same values), for sharded, partially and fully replicated and
    one-device arrays, and its host view (_host_views: the direct path for ml_dtypes, numpy's
    otherwise) is read-only and holds the shard's values; a deleted array still raises jax's own
    error. Control: a layout of another sharding (a different shard count) falls back to
    ``addressable_data``."""
    from bridges.jax import _api

    m = mesh((2, 4), ("data", "model"))
    for dtype in (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.int8):
        x = jnp.arange(16 * 8).reshape(16, 8).astype(dtype)
        cases = [put(x, m, P("data", "model")), put(x, m, P("data")), put(x, m, P()),
                 jax.device_put(x, SingleDeviceSharding(DEV[3]))]
        for arr in cases:
            lay = _api._layout(arr)
            assert lay.unbuffered == (np.dtype(dtype).kind == "V"), (dtype, lay.unbuffered)
            got, views = _api._offered_data(arr, lay), _api._host_views(arr, lay)
            assert len(got) == len(views) == len(lay.offered) >= 1, (arr.sharding, len(got), lay.offered)
            for i, g, v in zip(lay.offered, got, views):
                want = arr.addressable_data(i)
                assert g.devices() == want.devices(), (arr.sharding, i, g.devices(), want.devices())
                same(g, want)
                assert v.dtype == np.dtype(dtype) and not v.flags.writeable, (dtype, v.dtype, v.flags)
                assert v.tobytes() == np.asarray(want).tobytes(), (dtype, arr.sharding, i)
    other = _api._layout(put(x, mesh((2,), ("data",)), P("data")))
    fallback = _api._offered_data(cases[0], other)
    assert [g.devices() for g in fallback] == [cases[0].addressable_data(i).devices() for i in other.offered]
    gone = put(x, m, P("data", "model"))
    lay = _api._layout(gone)
    gone.delete()
    try:
        _api._offered_data(gone, lay)
        raise AssertionError("a deleted array was staged")
    except RuntimeError as e:
        assert "deleted" in str(e), e


def _donating_step():
    """A jitted training step that donates its state (``donate_argnums=0``)."""
    return jax.jit(lambda t: jax.tree.map(lambda a: a * 2 + 1, t), donate_argnums=0)


@check
def async_save_survives_a_donating_step(d):
    """An asynchronous save, then at once a jitted step that donates the saved state (the usual
    ``donate_argnums`` training step): the save holds views of the buffers taken at the call, so
    the donation is refused for those buffers and the checkpoint holds the values at the call.
    Control: jax's per-device arrays alone (a copy deferred past the call) are deleted by the
    same donation on this backend, so the check would catch a save that deferred them."""
    m = mesh((2, 4), ("data", "model"))
    step = _donating_step()
    state = step({"w": put(jnp.arange(64.0 * 32).reshape(64, 32), m, P("data", "model")),
                  "b": put(jnp.arange(32.0, dtype=jnp.bfloat16), m, P("model")), "r": put(jnp.arange(8.0), m, P())})
    want = {k: np.asarray(v).copy() for k, v in state.items()}
    h = bj.save(d, state, step=1, blocking=False)
    nxt = step(state)
    jax.block_until_ready(nxt)
    h.result(60)
    got = bj.restore(d, bj.abstract_target(nxt), step=1)
    for k in want:
        assert np.array_equal(np.asarray(got[k]), want[k]), k
    with bj.CheckpointManager(d + "-mgr", save_every_steps=1) as mgr:
        cur = step(nxt)
        want = {k: np.asarray(v).copy() for k, v in cur.items()}
        assert mgr.save(2, cur)
        cur = step(cur)
        mgr.wait()
        got = mgr.restore(bj.abstract_target(cur)).state
        for k in want:
            assert np.array_equal(np.asarray(got[k]), want[k]), k
    control = step(cur)
    held = control["w"].addressable_data(0)
    step(control)
    assert control["w"].is_deleted() and held.is_deleted(), "the donation did not delete the buffers"


@check
def finished_async_save_lets_go_of_the_state(d):
    """Once an asynchronous save has committed, nothing of it holds the saved state's buffers: a
    donating step can reuse them (the save's worker let go of its finished job, whose host views
    of the state would otherwise pin a second copy of the state until the next save). Control:
    one view of a buffer, held, makes the same donation be refused (the array stays alive)."""
    import gc
    import time

    from bridges.jax import _api

    m = mesh((2, 4), ("data", "model"))
    step = _donating_step()
    state = step({"w": put(jnp.arange(64.0 * 32).reshape(64, 32), m, P("data", "model")),
                  "b": put(jnp.arange(32.0, dtype=jnp.bfloat16), m, P("model"))})
    bj.save(d, state, step=1, blocking=False).result(60)
    deadline = time.monotonic() + 10
    while any(isinstance(o, _api._Staged) for o in gc.get_objects()) and time.monotonic() < deadline:
        time.sleep(0.05)
    step(state)
    assert state["w"].is_deleted() and state["b"].is_deleted(), "a finished save still pins the state's buffers"
    kept = step({"w": put(jnp.arange(64.0 * 32).reshape(64, 32), m, P("data", "model"))})
    view = np.asarray(kept["w"].addressable_data(0))
    step(kept)
    assert not kept["w"].is_deleted() and view.shape == (32, 8), "a held view did not stop the donation"


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:] or list(CHECKS)
    results = {}
    for name in names:
        with tempfile.TemporaryDirectory() as d:
            try:
                CHECKS[name](os.path.join(d, "repo"))
                results[name] = "ok"
            except Exception:  # noqa: BLE001 - reported per check
                results[name] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
