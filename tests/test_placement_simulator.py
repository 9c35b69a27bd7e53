"""The simulator's accounting, multi-node split, time model and input checks."""
from __future__ import annotations

import dataclasses

import pytest

from cachemw.placement import SimResult, TierSpec, TimeModel, simulate
from cachemw.placement.policies import LRUPolicy

POLICIES = ["lru", "history", "pin", "clairvoyant", "belady", None]


def mixed_trace():
    return [((i * 37) % 11, 1 + (i * 13) % 5) for i in range(400)]


@pytest.mark.parametrize("policy", POLICIES)
def test_accounting(policy):
    trace = mixed_trace()
    r = simulate(trace, policy, 12)
    assert r.accesses == len(trace) == r.hits + r.misses
    assert r.bytes_total == sum(s for _, s in trace)
    assert r.bytes_from_source == r.bytes_total - r.bytes_hit
    misses_bytes = r.bytes_total - r.bytes_hit
    assert r.bytes_from_source == misses_bytes
    assert 0.0 <= r.hit_ratio <= 1.0 and 0.0 <= r.byte_hit_ratio <= 1.0
    assert r.stall_s is None


def test_source_bytes_equal_missed_bytes_counted_by_hand():
    trace = [("a", 3), ("b", 5), ("a", 3), ("c", 2), ("b", 5)]
    # a, b fill 8 B; a hits; c evicts b (least recent); b misses and evicts a
    r = simulate(trace, "lru", 8)
    assert (r.hits, r.misses, r.bytes_from_source, r.evictions) == (1, 4, 15, 2)
    assert r.hit_ratio == pytest.approx(0.2) and r.byte_hit_ratio == pytest.approx(3 / 18)


def test_zero_capacity_and_empty_trace():
    r = simulate([("a", 1), ("a", 1)], "lru", 0)
    assert r.hits == 0 and r.bytes_from_source == 2
    e = simulate([], None, 10)
    assert e.accesses == 0 and e.hit_ratio == 0.0 and e.byte_hit_ratio == 0.0


def test_results_are_frozen_and_deterministic():
    trace = mixed_trace()
    a, b = simulate(trace, "history", 12), simulate(trace, "history", 12)
    assert a == b
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.hits = 0


def test_default_policy_follows_announced():
    trace = mixed_trace()
    assert simulate(trace, None, 12).policy == "history"
    assert simulate(trace, None, 12, announced=True).policy == "clairvoyant"


def test_policy_object_is_not_mutated():
    template = LRUPolicy()
    simulate(mixed_trace(), template, 12)
    assert template.used == 0 and not template.sizes


def test_nodes_have_separate_caches():
    trace = [("a", 1, "n0"), ("a", 1, "n1"), ("a", 1, "n0"), ("a", 1, "n1")]
    r = simulate(trace, "lru", 1)
    assert r.nodes == 2 and r.hits == 2 and r.misses == 2


def test_horizon_limits_what_clairvoyant_knows():
    trace = [(k, 1) for k in [0, 1, 2, 0, 1, 2, 3, 0, 3, 1]]
    full = simulate(trace, "clairvoyant", 2)
    short = simulate(trace, "clairvoyant", 2, horizon=2)
    assert full.hits == simulate(trace, "belady", 2).hits
    assert short.hits <= full.hits


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(trace="abc"), "trace"),
        (dict(trace=[("a",)]), "trace"),
        (dict(trace=[("a", 0)]), "size"),
        (dict(trace=[("a", 1.5)]), "size"),
        (dict(trace=[("a", True)]), "size"),
        (dict(capacity_bytes=-1), "capacity_bytes"),
        (dict(capacity_bytes=1.0), "capacity_bytes"),
        (dict(policy="mru"), "policy"),
        (dict(horizon=0), "horizon"),
        (dict(time_model="fast"), "time_model"),
    ],
)
def test_bad_input_names_the_argument(kwargs, name):
    args = dict(trace=[("a", 1)], policy="lru", capacity_bytes=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        simulate(args.pop("trace"), args.pop("policy"), args.pop("capacity_bytes"), **args)


def test_numpy_sizes_are_accepted():
    np = pytest.importorskip("numpy")
    r = simulate([("a", np.int64(4)), ("a", np.int32(4))], "lru", 4)
    assert r.hits == 1 and r.bytes_total == 8


# ---- time model ------------------------------------------------------------------------

def model(capacity, compute, batch=4, **kw):
    return TimeModel(
        source=TierSpec("pfs", 0, bandwidth=100.0, latency=0.0),
        cache=TierSpec("dram", capacity, bandwidth=1e9),
        compute_per_batch=compute, batch_size=batch, **kw,
    )


def cyclic(n=20, rounds=4):
    return [(i, 10) for _ in range(rounds) for i in range(n)]


def test_time_model_all_misses_is_source_bound():
    trace = [(i, 10) for i in range(40)]  # 40 cold reads of 10 B at 100 B/s: 4 s of source time
    r = simulate(trace, "lru", 100, time_model=model(100, compute=0.0))
    assert r.stall_s == pytest.approx(4.0, rel=1e-6)
    assert r.stall_lower_bound_s == pytest.approx(4.0, rel=1e-6)
    assert r.compute_s == 0.0 and r.total_s == pytest.approx(4.0, rel=1e-6)


def test_time_model_hides_source_time_behind_compute():
    trace = cyclic()
    slow = simulate(trace, "clairvoyant", 100, time_model=model(100, compute=10.0))
    assert slow.stall_s == pytest.approx(slow.stall_lower_bound_s, rel=1e-6)  # only the first batch


@pytest.mark.parametrize("compute", [0.0, 0.2, 0.4, 1.0])
def test_stall_never_below_the_bound(compute):
    trace = cyclic()
    tm = model(100, compute)
    for policy in ("lru", "history", "belady", "clairvoyant"):
        r = simulate(trace, policy, 100, time_model=tm)
        assert r.stall_s >= r.stall_lower_bound_s - 1e-9
        assert r.total_s == pytest.approx(r.stall_s + r.compute_s)


def test_clairvoyant_prefetch_beats_lru_stall():
    trace = cyclic(n=20, rounds=5)
    tm = model(100, compute=0.35)
    lru = simulate(trace, "lru", 100, time_model=tm)
    cv = simulate(trace, "clairvoyant", 100, time_model=tm)
    assert cv.bytes_from_source < lru.bytes_from_source
    assert cv.stall_s < lru.stall_s
    assert cv.stall_s <= 1.1 * cv.stall_lower_bound_s


def test_time_model_rejects_multinode_and_horizon_and_tiny_caches():
    tm = model(100, 0.1)
    with pytest.raises(ValueError, match="single-node"):
        simulate([("a", 1, 0), ("b", 1, 1)], "lru", 10, time_model=tm)
    with pytest.raises(ValueError, match="horizon"):
        simulate([("a", 1)], "clairvoyant", 10, horizon=1, time_model=tm)
    with pytest.raises(ValueError, match="capacity_bytes"):
        simulate(cyclic(), "clairvoyant", 15, time_model=tm)


@pytest.mark.parametrize(
    "kwargs, name",
    [(dict(bandwidth=0), "bandwidth"), (dict(latency=-1), "latency"), (dict(concurrency=0), "concurrency"),
     (dict(capacity=-1), "capacity"), (dict(name=""), "name")],
)
def test_bad_tier_spec(kwargs, name):
    args = dict(name="dram", capacity=1, bandwidth=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        TierSpec(**args)


@pytest.mark.parametrize(
    "kwargs, name",
    [(dict(compute_per_batch=-1), "compute_per_batch"), (dict(batch_size=0), "batch_size"),
     (dict(prefetch_depth=0), "prefetch_depth"), (dict(prefetch_fraction=2.0), "prefetch_fraction"),
     (dict(source=None), "source")],
)
def test_bad_time_model(kwargs, name):
    args = dict(source=TierSpec("pfs", 0, 1.0), cache=TierSpec("dram", 1, 1.0), compute_per_batch=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        TimeModel(**args)


def test_simresult_ratios_on_zero_accesses():
    r = SimResult("x", 0, 1, 0, 0, 0, 0, 0, 0, 0)
    assert r.hit_ratio == 0.0 and r.miss_ratio == 0.0
