"""Planning of who writes what: pure functions, no process group, fake world sizes."""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan  # noqa: E402
from torch.distributed.checkpoint.planner import WriteItemType  # noqa: E402

from cachemw.checkpoint.chunk_plan import MIN_CHUNK_BYTES, ItemSpec, most_loaded, plan_spread, split_rows  # noqa: E402
from cachemw.checkpoint.planner import SpreadSavePlanner, item_nbytes  # noqa: E402

pytestmark = pytest.mark.torch
MiB = 1 << 20


def test_split_rows_covers_the_tensor_with_contiguous_row_ranges():
    chunks = split_rows(ItemSpec("w", (10, 4), 4, splittable=True), max_bytes=48)
    assert sum(c.sizes[0] for c in chunks) == 10
    assert all(c.nbytes <= 48 for c in chunks)
    starts = [c.offsets[0] for c in chunks]
    assert starts == sorted(starts) and starts[0] == 0
    assert all(c.sizes[1:] == (4,) and c.offsets[1:] == (0,) for c in chunks)


def test_small_and_unsplittable_items_stay_whole():
    assert len(split_rows(ItemSpec("w", (3, 3), 4, splittable=True), 1 << 30)) == 1
    assert len(split_rows(ItemSpec("w", (1, 1 << 20), 4, splittable=True), 1024)) == 1  # one row
    assert len(split_rows(ItemSpec("shard", (100,), 4, splittable=False), 8)) == 1


def test_plans_are_frozen_and_deterministic():
    items = [ItemSpec(f"t{i}", (1000 + i, 256), 4, splittable=True) for i in range(5)]
    a = plan_spread([items] * 3, chunk_bytes=MiB)
    b = plan_spread([list(reversed(items))] * 3, chunk_bytes=MiB)
    assert a == b
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.per_rank = ()  # type: ignore[misc]
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_spread([items], chunk_bytes=0)


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 4000), st.integers(1, 3000)), min_size=1, max_size=12),
    world=st.integers(1, 8),
)
def test_every_rank_writes_at_most_a_fair_share_plus_tolerance(shapes, world):
    items = [ItemSpec(f"t{i}", s, 4, splittable=True) for i, s in enumerate(shapes)]
    plan = plan_spread([items] * world, chunk_bytes=64 * MiB, tolerance=0.05)
    total = sum(i.nbytes for i in items)
    assert sum(plan.bytes_per_rank()) == total
    # Row granularity: a chunk is at least one row, so allow a row of slack per tensor;
    # tensors under MIN_CHUNK_BYTES are not cut, so tiny states may miss 5% by that much.
    slack = sum(i.nbytes // i.shape[0] for i in items)
    assert most_loaded(plan) <= max(1.05 * total / world + slack, total / world + MIN_CHUNK_BYTES)
    covered = {}
    for chunks in plan.per_rank:
        for c in chunks:
            covered[c.key] = covered.get(c.key, 0) + c.sizes[0]
    assert covered == {i.key: i.shape[0] for i in items}


def test_shards_stay_with_their_rank_and_count_towards_its_load():
    big_shard = ItemSpec("dt@0", (1000, 1000), 4, splittable=False)
    rep = ItemSpec("rep", (1000, 1000), 4, splittable=True)
    plan = plan_spread([[big_shard, rep], [rep]], chunk_bytes=MiB)
    assert any(c.key == "dt@0" for c in plan.per_rank[0])
    assert not any(c.key == "dt@0" for c in plan.per_rank[1])
    assert plan.bytes_per_rank()[1] > plan.bytes_per_rank()[0] - big_shard.nbytes


def test_spread_planner_global_plan_with_fake_world_size():
    state = {"a": torch.zeros(4096, 256), "b": torch.zeros(1024, 256), "step": 7}
    world = 3
    planners, local_plans = [], []
    for rank in range(world):
        planner = SpreadSavePlanner(chunk_bytes=MiB)
        planner.set_up_planner(state, is_coordinator=rank == 0)
        planners.append(planner)
        local_plans.append(planner.create_local_plan())
    global_plan, metadata = planners[0].create_global_plan(local_plans)
    per_rank = [sum(item_nbytes(i) for i in p.items) for p in global_plan]
    total = (4096 + 1024) * 256 * 4
    assert sum(per_rank) == total
    assert max(per_rank) <= max(1.05 * total / world, total / world + MIN_CHUNK_BYTES) + 256 * 4
    chunks = metadata.state_dict_metadata["a"].chunks
    assert sum(c.sizes[0] for c in chunks) == 4096 and len(chunks) > 1
    assert sum(1 for p in global_plan for i in p.items if i.type == WriteItemType.BYTE_IO) == 1
    # Each rank resolves its chunks to views of its own tensor, without copying.
    item = next(i for i in global_plan[1].items if i.type == WriteItemType.SHARD)
    planners[1].finish_plan(global_plan[1])
    data = planners[1].resolve_data(item)
    assert data.shape == tuple(item.tensor_data.chunk.sizes)
    assert data.data_ptr() == state[item.index.fqn][item.index.offset[0]].data_ptr()


def test_local_plan_is_dcp_default():
    state = {"a": torch.zeros(3)}
    planner = SpreadSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    assert planner.create_local_plan().items == create_default_local_save_plan(state, True).items


def test_a_failure_reported_by_one_rank_is_rebuilt_with_its_type_on_every_rank():
    """What ranks gather is plain data; each rebuilds the first failure's type from it, so an
    ``except OSError`` around a save catches the same failures at any world size."""
    import errno
    import pickle

    from cachemw.checkpoint.coordination import report, same_type
    from cachemw.checkpoint.errors import ChecksumError

    full = pickle.loads(pickle.dumps(report(OSError(errno.ENOSPC, "disk full"))))
    rebuilt = same_type(full, "checkpoint failed on rank(s) [1]; rank 1: " + full[3])
    assert type(rebuilt) is OSError and rebuilt.errno == errno.ENOSPC and "rank(s) [1]" in str(rebuilt)
    assert type(same_type(report(FileNotFoundError(errno.ENOENT, "gone")), "m")) is FileNotFoundError
    assert type(same_type(report(ChecksumError("bad chunk")), "m")) is ChecksumError
    assert type(same_type(report(TypeError("no")), "m")) is TypeError

    class Odd(Exception):
        pass
    assert type(same_type(report(Odd("x")), "m")) is RuntimeError  # not rebuildable on another rank
    decode = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad")
    assert type(same_type(report(decode), "m")) is RuntimeError  # a constructor that wants more
    assert report(None) is None


def test_a_store_client_failure_on_one_rank_is_an_oserror_on_every_rank():
    """botocore's EndpointConnectionError is no OSError, and no other rank can rebuild its
    class: it was a RuntimeError there. It is reported as the OSError it is told as."""
    import errno

    botocore_exceptions = pytest.importorskip("botocore.exceptions")
    from cachemw.checkpoint.coordination import report, same_type

    gone = botocore_exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9/b")
    rebuilt = same_type(report(gone), "checkpoint failed on rank(s) [1]")
    assert type(rebuilt) is OSError and rebuilt.errno == errno.EIO
    assert "EndpointConnectionError" in report(gone)[3]


def test_only_the_wire_s_errors_are_told_as_a_failed_collective():
    """Inside a collective's block (DCP's save and load run in one), an error raised by
    torch.distributed's collectives is told as a collective with the other ranks that
    failed; an error raised elsewhere there (CUDA out of memory while DCP stages a tensor,
    a state_dict hook's bug) is raised as it was, not labelled as the other ranks' doing."""
    import torch.distributed.distributed_c10d as c10d

    from cachemw.checkpoint.coordination import Coordinator

    coord = Coordinator.__new__(Coordinator)  # as on a rank of a world of several
    coord.no_dist, coord.timeout_s = False, 30.0

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError) as got:
        with coord.collective():
            raise oom
    assert got.value is oom  # before: RuntimeError "a collective with the other ranks failed"
    with pytest.raises(RuntimeError) as got:
        with coord.collective():
            raise RuntimeError("stage: tensor on meta device")
    assert str(got.value) == "stage: tensor on meta device"

    # raised in distributed_c10d.py itself, as gloo's "Connection reset by peer" is
    code = compile("def reset():\n    raise RuntimeError('Connection reset by peer')\n",
                   c10d.__file__, "exec")
    scope: dict = {}
    exec(code, scope)
    with pytest.raises(RuntimeError, match="a collective with the other ranks failed.*reset by peer"):
        with coord.collective():
            scope["reset"]()
    with pytest.raises(torch.distributed.DistBackendError, match="a collective with the other ranks"):
        with coord.collective():
            raise torch.distributed.DistBackendError("NCCL communicator was aborted")


def test_a_replicated_tensor_of_another_shape_on_some_rank_is_refused():
    """Planned on the first holder's shape, the other ranks' extra rows were dropped and the
    save said durable (review ckpt7). Values of another shape under keys of their own, and
    unsplittable items, are planned as before."""
    rank0 = [ItemSpec("x@0", (1000,), 4, True), ItemSpec("own0", (3,), 4, True)]
    rank1 = [ItemSpec("x@0", (1500,), 4, True), ItemSpec("own1", (5,), 4, True)]
    rank2 = [ItemSpec("x@0", (1000,), 4, True)]
    with pytest.raises(ValueError, match=r"'x' has another shape on each rank \(\[1000\] on "
                                         r"rank\(s\) \[0, 2\]; \[1500\] on rank\(s\) \[1\]\)"):
        plan_spread([rank0, rank1, rank2])
    rank1[0] = ItemSpec("x@0", (1000,), 4, True)
    plan = plan_spread([rank0, rank1, rank2])
    assert sum(c.sizes[0] for chunks in plan.per_rank for c in chunks if c.key == "x@0") == 1000
