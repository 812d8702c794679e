"""The pure planner: grids, chunk shapes, owners, read items. No I/O."""
import numpy as np
import pytest

from ckptfmt import Box, StepMismatchError, ShapeMismatchError
from ckptfmt.plan import TensorGeometry, chunk_shape_for, plan_reads, plan_save, shard_grid


def test_shard_grid_regular_and_uneven():
    assert shard_grid((16, 4), [Box((i * 2, 0), (2, 4)) for i in range(8)]) == (2, 4)
    # torch.chunk 10 over 4 ranks: 3,3,3,1
    assert shard_grid((10, 4), [Box((0, 0), (3, 4)), Box((3, 0), (3, 4)), Box((6, 0), (3, 4)), Box((9, 0), (1, 4))]) == (3, 4)
    # 10 over 8: 2,2,2,2,2,0,0,0 (empty boxes ignored)
    boxes = [Box((min(10, 2 * i), 0), (max(0, min(10, 2 * i + 2) - min(10, 2 * i)), 4)) for i in range(8)]
    assert shard_grid((10, 4), boxes) == (2, 4)
    assert shard_grid((), [Box((), ())]) == ()
    assert shard_grid((0, 3), []) == (1, 3)


def test_chunk_shape_divides_and_is_bounded():
    for shape in [(2048, 1024), (3, 7), (1000, 3), (64, 64, 64), (1,)]:
        c = chunk_shape_for(shape, 4, 4096)
        assert all(s % x == 0 for s, x in zip(shape, c))
        assert np.prod(c) * 4 <= 4096
    assert chunk_shape_for((2048, 1024), 4, 4 << 20) == (1024, 1024)


def _divisor_rule(shard_shape, itemsize, target):
    """The rule before issue 47 (FORMAT.md 14.1 up to 1.2.x): split the largest dimension by its
    smallest prime factor while the chunk exceeds the target, however small it gets."""
    chunk = list(shard_shape)
    while np.prod(chunk, dtype=object) * itemsize > target:
        d = next((d for d in sorted(range(len(chunk)), key=lambda d: -chunk[d]) if chunk[d] > 1), None)
        if d is None:
            break
        chunk[d] //= next(p for p in range(2, chunk[d] + 1) if chunk[d] % p == 0)
    return tuple(chunk)


@pytest.mark.parametrize("shard, itemsize, want", [
    ((1_048_583,), 4, (1_048_583,)),               # a prime: 4 MiB + 28 B is one chunk, not 1,048,583
    ((4_194_319,), 1, (4_194_319,)),               # 4 MiB + 15 B of uint8, a prime
    ((16_777_259,), 1, (16_777_259,)),             # a prime above 2^24 elements: was over the chunk-row cap
    ((2 * 1_048_583,), 4, (1_048_583,)),           # 2p: the prime part stays whole
    ((1733 * 29, 768), 4, (1733, 384)),            # GPT-2's vocabulary (29 x 1733) x 768: not (1, 768)
    ((1_048_583, 3), 2, (1_048_583, 1)),
])
def test_chunk_shape_is_bounded_for_every_length(shard, itemsize, want):
    """Issue 47 item 5: a dimension with a large prime factor no longer makes chunks of a few bytes.
    The chunk divides the shard, is at least target/64 (or the whole shard), and the shard's chunk
    count is at most 64 x its bytes / target. The control: the old divisor rule's count for the
    same shard is huge (its chunk far below the target)."""
    target = 4 << 20
    c = chunk_shape_for(shard, itemsize, target)
    assert c == want
    assert all(s % x == 0 for s, x in zip(shard, c))
    shard_bytes, chunk_bytes = int(np.prod(shard, dtype=object)) * itemsize, int(np.prod(c, dtype=object)) * itemsize
    assert chunk_bytes >= min(shard_bytes, target // 64)
    assert shard_bytes // chunk_bytes <= max(1, 64 * shard_bytes // target)
    old = _divisor_rule(shard, itemsize, target)
    assert int(np.prod(old, dtype=object)) * itemsize < target // 64  # the old rule went far below the target
    assert shard_bytes // (int(np.prod(old, dtype=object)) * itemsize) >= 768  # >= 768 chunks, up to 16.7 M


def test_chunk_shape_keeps_the_divisor_rule_where_it_is_near_the_target():
    """Layouts the divisor rule already bounded are unchanged (golden files, earlier saves): over
    many shapes and targets, the new rule differs from the old only where the old chunk was below
    target/64, and then the new chunk is larger."""
    rng = np.random.default_rng(47)
    shapes = [(2048, 1024), (3, 7), (1000, 3), (64, 64, 64), (1,), (50257, 768), (11008, 4096), (151936, 4096),
              (128256, 4096), (14336, 4096), (5, 3), (1024,), (4, 3, 5)]
    shapes += [tuple(int(x) for x in rng.integers(1, 5000, size=rng.integers(1, 4))) for _ in range(200)]
    changed = 0
    for shape in shapes:
        for itemsize in (1, 2, 4):
            for target in (12, 256, 4096, 1 << 16, 4 << 20):
                old, new = _divisor_rule(shape, itemsize, target), chunk_shape_for(shape, itemsize, target)
                small = int(np.prod(old, dtype=object)) * itemsize < target // 64
                assert (old == new) or small, (shape, itemsize, target, old, new)
                if old != new:
                    changed += 1
                    assert np.prod(new, dtype=object) > np.prod(old, dtype=object)
    assert changed  # the control: some shapes do change (those with a large prime factor)


def test_owner_is_lowest_replica_then_rank():
    inv = {"w": ((8, 2), "float32", 4)}
    full = Box((0, 0), (8, 2))
    plans = plan_save(inv, [{"w": [(full, 1)]}, {"w": [(full, 0)]}, {"w": [(full, 0)]}])
    assert {it.writer for it in plans[0].items} == {1}  # tensor 0, cell 0: the first candidate


def test_replicated_shards_take_turns_over_their_holders():
    """(data=2, model=4) over 2 ranks, every tensor split over model and replicated over data:
    each rank writes half of every tensor's shards (FORMAT.md 8.1)."""
    inv = {f"t{i}": ((4, 8), "float32", 4) for i in range(3)}
    cols = [Box((0, 2 * c), (4, 2)) for c in range(4)]
    boxes = [{k: [(b, r) for b in cols] for k in inv} for r in range(2)]
    for p in plan_save(inv, boxes):
        assert p.writers.tolist() == [(p.index + c) % 2 for c in range(4)], p.key
    # A rank holding two replicas of a box is one candidate: one process alone writes everything.
    assert all((p.writers == 0).all() for p in plan_save(inv, [{k: [(b, r) for b in cols for r in (0, 1)] for k in inv}]))


def test_a_holder_without_data_is_never_picked():
    """Holders that offer no data only prove the box is held (offering only replica 0's data keeps
    the assignment before 1.0.4); with none offering it, every holder is a candidate. The
    control: both offering data take turns."""
    inv = {"a": ((4,), "float32", 4), "b": ((4,), "float32", 4)}
    full = Box((0,), (4,))
    only0 = [{k: [(full, 0, True)] for k in inv}, {k: [(full, 1, False)] for k in inv}]
    assert [p.writers.tolist() for p in plan_save(inv, only0)] == [[0], [0]]
    both = [{k: [(full, 0, True)] for k in inv}, {k: [(full, 1, True)] for k in inv}]
    assert [p.writers.tolist() for p in plan_save(inv, both)] == [[0], [1]]
    nobody = [{k: [(full, 1, False)] for k in inv}, {k: [(full, 0, False)] for k in inv}]
    assert [p.writers.tolist() for p in plan_save(inv, nobody)] == [[1], [0]]


def test_gap_is_rejected_and_complete_layout_is_accepted():
    inv = {"w": ((8, 2), "float32", 4)}
    ok = [{"w": [(Box((0, 0), (4, 2)), 0)]}, {"w": [(Box((4, 0), (4, 2)), 0)]}]
    assert len(plan_save(inv, ok)[0].items) == 2            # control: accepted
    with pytest.raises(StepMismatchError):                   # broken: rank 1 holds nothing
        plan_save(inv, [ok[0], {}])


def test_out_of_bounds_box_and_unknown_key_rejected():
    inv = {"w": ((8, 2), "float32", 4)}
    with pytest.raises(StepMismatchError):
        plan_save(inv, [{"w": [(Box((0, 0), (9, 2)), 0)]}])
    with pytest.raises(StepMismatchError):
        plan_save(inv, [{"w": [(Box((0, 0), (8, 2)), 0)], "x": [(Box((0,), (1,)), 0)]}])
    with pytest.raises(StepMismatchError, match="wrong rank"):
        plan_save(inv, [{"w": [(Box((0,), (8,)), 0)]}])
    assert plan_save(inv, [{"w": [(Box((0, 0), (8, 2)), 0)]}])[0].items_for(0)  # control


def test_plan_reads_covers_request_exactly():
    g = TensorGeometry((10, 6), (3, 6), (1, 3), 4)
    offsets = np.array([[0, 0], [3, 0], [6, 0], [9, 0]])
    counts = [6, 6, 6, 2]
    starts = np.concatenate([[0], np.cumsum(counts)])
    req = Box((2, 1), (5, 4))
    items = plan_reads(g, offsets, starts, [req])
    covered = np.zeros(req.shape, int)
    for it in items:
        covered[it.dst] += 1
    assert (covered == 1).all()
    assert len({it.chunk for it in items}) == 10  # rows 2..6 x 2 column chunks
    with pytest.raises(ShapeMismatchError):
        plan_reads(g, offsets, starts, [Box((8, 0), (3, 6))])


# ---------------------------------------------------------------- the vectorised owner path vs the general one
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ckptfmt import _boxcols  # noqa: E402
from ckptfmt import plan as _plan  # noqa: E402


def _general(inventory, rank_boxes, target):
    """The slow twin: every tensor through the general per-tensor path (raises like plan_save)."""
    world = max(1, len(rank_boxes))
    out = []
    for index, key in enumerate(sorted(inventory)):
        shape, dtype, itemsize = inventory[key]
        held = [(r,) + tuple(h) for r, hb in enumerate(rank_boxes) for h in hb.get(key, [])]
        out.append(_plan._plan_tensor(index, key, tuple(shape), dtype, itemsize, held, world, target))
    return out


@st.composite
def _layouts(draw):
    """Tensors split on a block grid (torch.chunk-style clipped tails), each block held by one or
    more ranks under random replica ids; sometimes a layout the fast path must refuse."""
    world = draw(st.integers(1, 4))
    inventory, rank_boxes, regular = {}, [dict() for _ in range(world)], set()
    for t in range(draw(st.integers(1, 4))):
        nd = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(1, 9)) for _ in range(nd))
        key = f"t{t}"
        inventory[key] = (shape, draw(st.sampled_from(["float32", "int8", "float64"])), 4)
        if nd and draw(st.integers(0, 4)) == 0:  # an empty tensor: held whole (an empty box) by some ranks
            shape = tuple(0 if d == draw(st.integers(0, nd - 1)) else n for d, n in enumerate(shape))
            inventory[key] = (shape,) + inventory[key][1:]
            for r in draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=3)):
                rank_boxes[r].setdefault(key, []).append((Box((0,) * nd, shape), draw(st.integers(0, 2))))
            if draw(st.booleans()):
                regular.add(key)
            else:  # a box of another rank, or outside it: the general path raises
                bad = Box((0,) * (nd + 1), (0,) * (nd + 1)) if draw(st.booleans()) else Box((0,) * nd, tuple(n + 1 for n in shape))
                rank_boxes[0].setdefault(key, []).append((bad, 0))
            continue
        block = tuple(draw(st.integers(1, n)) for n in shape)
        grid = [range(0, n, b) for n, b in zip(shape, block)]
        twist = draw(st.sampled_from(["regular"] * 4 + ["gap", "span", "outside", "empty"]))
        if twist == "regular" and nd:
            regular.add(key)
        for cell in np.ndindex(*[len(g) for g in grid]) if nd else [()]:
            off = tuple(g[i] for g, i in zip(grid, cell))
            box = Box(off, tuple(min(b, n - o) for b, n, o in zip(block, shape, off)))
            holders = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=3))
            if twist == "gap" and cell == (0,) * nd and nd:
                continue
            for r in holders:
                rank_boxes[r].setdefault(key, []).append((box, draw(st.integers(0, 2)), draw(st.booleans())))
        if twist == "span" and nd:  # a box over two or more cells: the general path's job
            rank_boxes[0].setdefault(key, []).append((Box((0,) * nd, shape), 0))
        elif twist == "outside" and nd:
            rank_boxes[world - 1].setdefault(key, []).append((Box((shape[0],) + (0,) * (nd - 1), (1,) * nd), 0))
        elif twist == "empty" and nd:
            rank_boxes[0].setdefault(key, []).append((Box((0,) * nd, (0,) * nd), 0))
    return inventory, rank_boxes, draw(st.sampled_from([16, 64, 4 << 20])), regular


@given(_layouts())
@settings(max_examples=300, deadline=None)
def test_vectorised_owners_equal_the_general_path(layout):
    """plan_save's vectorised path (regular_owners) and the per-tensor path (_plan_tensor) give
    the same writers and geometry on the same inputs, and the same error on bad ones."""
    inventory, rank_boxes, target, _ = layout
    try:
        want = _general(inventory, rank_boxes, target)
    except StepMismatchError as e:
        with pytest.raises(StepMismatchError) as got:
            plan_save(inventory, rank_boxes, target)
        assert str(got.value) == str(e)
        return
    got = plan_save(inventory, rank_boxes, target)
    assert [p.key for p in got] == [p.key for p in want]
    for g, w in zip(got, want):
        assert (g.index, g.dtype, g.geometry) == (w.index, w.dtype, w.geometry), g.key
        assert np.array_equal(g.cells, w.cells) and np.array_equal(g.writers, w.writers), g.key


@given(_layouts())
@settings(max_examples=100, deadline=None)
def test_regular_layouts_take_the_vectorised_path(layout):
    """The property above is not vacuous: every tensor held as whole grid cells, with no gap, is
    planned by the vectorised path."""
    inventory, rank_boxes, _, regular = layout
    keys = sorted(inventory)
    shapes = [tuple(inventory[k][0]) for k in keys]
    held = _boxcols.gather({k: i for i, k in enumerate(keys)}, rank_boxes, max(map(len, shapes), default=0))
    slow = _plan.regular_owners(shapes, held, max(1, len(rank_boxes))).slow
    assert regular <= {k for i, k in enumerate(keys) if not slow[i]}


def test_control_the_comparison_sees_a_wrong_owner():
    """Broken control: a vectorised path that picks other writers, passed to plan_save, is caught
    by the comparison; the default one is not."""
    inv = {"w": ((8, 2), "float32", 4)}
    boxes = [{"w": [(Box((4 * r, 0), (4, 2)), 0)]} for r in range(2)]
    same = lambda a, b: all(np.array_equal(x.writers, y.writers) for x, y in zip(a, b))  # noqa: E731

    def reversed_owners(*a):
        r = _plan.regular_owners(*a)
        return _plan.Owners(r.slow, r.gcds, r.base, r.writers[::-1])

    assert same(plan_save(inv, boxes), _general(inv, boxes, 4 << 20))
    assert same(plan_save(inv, boxes, owners=_plan.regular_owners), _general(inv, boxes, 4 << 20))
    assert not same(plan_save(inv, boxes, owners=reversed_owners), _general(inv, boxes, 4 << 20))


def _packed(rank_boxes, keys_known=None):
    """Every rank's boxes as the save protocol sends them: pack_boxes columns through msgpack
    (a rank holding exactly ``keys_known``, in order, leaves its keys out)."""
    import msgpack

    return [msgpack.unpackb(msgpack.packb(_boxcols.pack_boxes(
        {k: [(h[0], h[1], h[2] if len(h) > 2 else True) for h in v] for k, v in hb.items()}, keys_known),
        use_bin_type=True), raw=False) for hb in rank_boxes]


@given(_layouts())
@settings(max_examples=200, deadline=None)
def test_packed_columns_plan_like_box_objects(layout):
    """The save protocol plans from every rank's packed columns (plan_save_packed): the same plans
    as plan_save from Box objects, and the same error on bad inputs. Ranks that hold every tensor
    leave their keys out of the message; the others send them."""
    inventory, rank_boxes, target, _ = layout
    packed = _packed(rank_boxes, sorted(inventory))
    try:
        want = plan_save(inventory, rank_boxes, target)
    except StepMismatchError as e:
        with pytest.raises(StepMismatchError) as got:
            _plan.plan_save_packed(inventory, packed, target)
        assert str(got.value) == str(e)
        return
    got = _plan.plan_save_packed(inventory, packed, target)
    assert [(p.key, p.index, p.dtype, p.geometry) for p in got] == [(p.key, p.index, p.dtype, p.geometry) for p in want]
    for g, w in zip(got, want):
        assert np.array_equal(g.cells, w.cells) and np.array_equal(g.writers, w.writers), g.key


@pytest.mark.parametrize("damage", ["short_offsets", "counts_vs_rows", "missing_column", "unknown_key",
                                    "writable_byte", "wrapping_box", "too_many_dims"])
def test_malformed_freeze_message_is_a_step_mismatch(damage):
    """Broken controls: a message whose columns disagree, or that holds a value the planner's int64
    arithmetic or the format cannot take (a box whose offset + shape wraps, 40 dimensions, a
    writable byte of 2), is refused, naming the rank; the intact message plans. (A wrapping box
    made the planner try to allocate 3.2 EiB.)"""
    inv = {"w": ((8, 2), "float32", 4)}
    boxes = [{"w": [(Box((4 * r, 0), (4, 2)), 0)]} for r in range(2)]
    packed = _packed(boxes)
    assert [p.writers.tolist() for p in _plan.plan_save_packed(inv, packed)] == [[0, 1]]
    bad = dict(packed[1])
    if damage == "short_offsets":
        bad["offset"] = bad["offset"][:-8]
    elif damage == "counts_vs_rows":
        bad["counts"] = [2]
    elif damage == "missing_column":
        del bad["replica"]
    elif damage == "writable_byte":
        bad["writable"] = b"\x02"
    elif damage == "wrapping_box":
        bad["offset"] = np.array([1 << 62, 0], "<i8").tobytes()
        bad["shape"] = np.array([1 << 62, 2], "<i8").tobytes()
    elif damage == "too_many_dims":
        bad["ndim"] = np.array([40], "<i8").tobytes()
        bad["offset"], bad["shape"] = np.zeros(40, "<i8").tobytes(), np.ones(40, "<i8").tobytes()
    else:
        bad["keys"] = ["v"]
    with pytest.raises(StepMismatchError, match="rank 1"):
        _plan.plan_save_packed(inv, [packed[0], bad])
