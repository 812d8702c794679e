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


def test_owner_is_lowest_replica_then_rank():
    inv = {"w": ((8, 2), "float32", 4)}
    full = Box((0, 0), (8, 2))
    plans = plan_save(inv, [{"w": [(full, 1)]}, {"w": [(full, 0)]}, {"w": [(full, 0)]}])
    assert {it.writer for it in plans[0].items} == {1}


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
