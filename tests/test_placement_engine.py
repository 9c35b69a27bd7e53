"""The daemon-facing Engine and the multi-node functions: plans are frozen and deterministic."""
from __future__ import annotations

import dataclasses

import pytest

from cachemw.placement import (
    Admit, Demote, Engine, Evict, Plan, Prefetch, Promote, Replicate, TierSpec, assign_blocks,
    rebalance_plans, stable_digest,
)


def tiers(dram=2, nvme=2):
    return [TierSpec("dram", dram, 10e9), TierSpec("nvme", nvme, 2e9)]


def test_miss_admits_to_the_fastest_tier_then_demotes_and_evicts():
    e = Engine(tiers(), "lru")
    assert e.access("a", 1).moves == (Admit("a", 1, "dram"),)
    e.access("b", 1)
    plan = e.access("c", 1)  # dram full: a (least recent) goes down to nvme
    assert plan.moves == (Demote("a", 1, "dram", "nvme"), Admit("c", 1, "dram"))
    e.access("d", 1)
    plan = e.access("x", 1)  # total capacity 4 is full: LRU policy evicts a from nvme
    assert plan.moves[0] == Evict("a", 1, "nvme")
    assert plan.of_type(Admit) == (Admit("x", 1, "dram"),)
    assert e.used() == {"dram": 2, "nvme": 2}


def test_hit_in_a_slower_tier_promotes():
    e = Engine(tiers(), "lru")
    for k in "abc":
        e.access(k, 1)
    assert e.placement()["a"] == "nvme"
    plan = e.access("a", 1)
    assert plan.moves == (Demote("b", 1, "dram", "nvme"), Promote("a", 1, "nvme", "dram"))
    assert e.placement() == {"a": "dram", "b": "nvme", "c": "dram"}


def test_a_promotion_not_carried_out_is_counted_where_the_block_stayed():
    """The executor could not promote a (the faster tier takes nothing now): kept_in counts
    it in nvme again, with room made there, so that no tier holds more than its capacity.
    Counted in dram, its room in nvme was handed out again (c's demotion) and the real
    nvme held 3 blocks of 2 (review epochs4: an NVMe tier 36 % over its capacity)."""
    e = Engine(tiers(), "lru")
    for k in "abcd":
        e.access(k, 1)  # dram: c, d; nvme: a, b
    plan = e.access("a", 1)
    assert plan.moves == (Demote("c", 1, "dram", "nvme"), Promote("a", 1, "nvme", "dram"))
    # a stayed in nvme, where c was demoted: a, b, c in a tier of 2, unless room is made
    fix = e.kept_in("a", "nvme")
    assert fix.moves == (Evict("b", 1, "nvme"),)
    assert e.placement() == {"a": "nvme", "c": "nvme", "d": "dram"}
    assert all(used <= cap for used, cap in zip(e.used().values(), (2, 2)))
    assert not e.kept_in("a", "nvme") and not e.kept_in("gone", "nvme")  # nothing to do
    with pytest.raises(ValueError):
        e.kept_in("a", "gpu")


def test_hit_in_the_fastest_tier_is_an_empty_plan():
    e = Engine(tiers(), "lru")
    e.access("a", 1)
    assert not e.access("a", 1) and len(Plan()) == 0


def test_block_too_big_for_every_tier_is_not_kept():
    e = Engine(tiers(2, 2), "lru")
    assert not e.access("big", 3)
    assert e.placement() == {}


def test_plans_are_frozen_and_deterministic():
    def run():
        e = Engine(tiers(3, 3), "history")
        return [e.access(k, 1) for k in [1, 2, 3, 1, 4, 5, 6, 7, 1, 2, 8, 9, 1]]

    first, second = run(), run()
    assert first == second
    with pytest.raises(dataclasses.FrozenInstanceError):
        first[0].moves = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        Admit("a", 1, "dram").size = 2


def test_prefetch_follows_the_announced_order():
    e = Engine(tiers(2, 1), announced=True)
    assert e.policy.name == "clairvoyant"
    e.announce([("a", 1), ("b", 1), ("c", 1), ("d", 1)])
    plan = e.prefetch(2)
    assert plan.moves == (Prefetch("a", 1, "dram", 0), Prefetch("b", 1, "dram", 1))
    plan = e.prefetch(10)  # c fits (3 bytes in all), d would evict a block needed sooner
    assert plan.of_type(Prefetch) == (Prefetch("c", 1, "dram", 2),)
    assert e.access("a", 1).of_type(Admit) == ()


def test_an_order_announced_after_reads_is_prefetched_from_its_first_read():
    # reads the policy counted before any order came (blocks loaded at a restart, or a
    # switch to clairvoyant after a miss) must not shift the order: the first announced
    # read is prefetched first, needed at once
    e = Engine(tiers(4, 1), "clairvoyant", announced=True, placement={"x": ("dram", 1)})
    e.announce([("a", 1), ("b", 1), ("c", 1)])
    assert e.prefetch(10).of_type(Prefetch) == (
        Prefetch("a", 1, "dram", 0), Prefetch("b", 1, "dram", 1), Prefetch("c", 1, "dram", 2))
    e.access("a", 1)
    e.announce([("d", 1)])  # appended after the rest, read fourth from here on
    assert e.prefetch(10).of_type(Prefetch) == (Prefetch("d", 1, "dram", 2),)


def test_a_read_outside_the_order_takes_no_place_in_it():
    # a read made before the order (its fill's lease came late) or of a file not in it, while
    # the order is ahead: the first announced block is still prefetched, needed first
    e = Engine(tiers(4, 1), "clairvoyant", announced=True)
    e.announce([("a", 1), ("b", 1), ("c", 1)])
    e.access("x", 1)
    assert e.policy.cursor == 0
    assert e.prefetch(10).of_type(Prefetch) == (
        Prefetch("a", 1, "dram", 0), Prefetch("b", 1, "dram", 1), Prefetch("c", 1, "dram", 2))
    e.access("a", 1)
    assert e.policy.cursor == 1 and e.policy.next_use("b") == 1


def test_reads_of_the_order_far_ahead_of_the_cursor_still_move_it():
    # two workers, one reading more than slack positions ahead of the other (8 workers with
    # large batches, hits reported late): every read of a block the order names counts, so
    # the cursor keeps pace with the reads (k20-k29, read and cached, not prefetched again)
    e = Engine(tiers(64, 1), "clairvoyant", announced=True)
    e.policy.slack = 4
    keys = [f"k{i}" for i in range(40)]
    e.announce([(k, 1) for k in keys])
    for i in range(10):
        e.access(keys[i], 1)       # the first worker, at the cursor
        e.access(keys[20 + i], 1)  # the second, 20 places ahead: beyond slack
    assert e.policy.cursor == 20
    assert e.prefetch(1).of_type(Prefetch) == (Prefetch("k30", 1, "dram", 10),)


def test_an_abandoned_order_gives_way_to_the_reads_after_it():
    # slack reads in a row outside the order: it is taken as abandoned, the cursor moves
    # with every read again and the order's places run out
    e = Engine(tiers(4, 1), "clairvoyant", announced=True)
    e.policy.slack = 4
    e.announce([("a", 1), ("b", 1), ("c", 1), ("d", 1)])
    for i in range(4):
        e.access(f"x{i}", 1)
    assert e.policy.cursor == 0
    e.access("y", 1)
    e.access("z", 1)
    assert e.policy.cursor == 2 and e.policy.next_use("a") > 100
    assert e.prefetch(10).of_type(Prefetch) == (
        Prefetch("c", 1, "dram", 0), Prefetch("d", 1, "dram", 1))
    e.access("c", 1)  # back in the order: strays count from nothing again
    e.access("w", 1)
    assert e.policy.cursor == 3


def test_the_orders_of_a_nodes_ranks_are_laid_as_they_are_read():
    # two DDP ranks on one node, each announcing its shard of the epoch: read step by step
    # together, so expected interleaved, whichever announces first
    e = Engine(tiers(6, 1), "clairvoyant", announced=True)
    e.announce([("b0", 1), ("b1", 1), ("b2", 1)], group="epoch-0", rank=1, ranks=2)
    e.announce([("a0", 1), ("a1", 1), ("a2", 1)], group="epoch-0", rank=0, ranks=2)
    assert [m.key for m in e.prefetch(4).of_type(Prefetch)] == ["a0", "b0", "a1", "b1"]
    for key in ("a0", "b0", "a1"):
        e.access(key, 1)
    assert e.policy.cursor == 3 and e.policy.next_use("b1") == 3
    # the next epoch's orders come after this one's, as a group of their own; a window
    # further into a rank's order (first) keeps its places
    e.announce([("a3", 1)], group="epoch-1", rank=0, ranks=2)
    e.announce([("b4", 1)], group="epoch-1", rank=1, ranks=2, first=1)
    assert e.policy.next_use("a3") == 6 and e.policy.next_use("b4") == 9


def test_a_group_name_used_again_by_a_later_run_begins_anew():
    # torchrun's default names are the same run after run: a rank that begins its order
    # again in a group begins a new group there, not one laid at places already read
    e = Engine(tiers(8, 1), "clairvoyant", announced=True)
    for run in range(2):
        e.announce([(f"a{run}", 1)], group="127.0.0.1:29500/0:0:0", rank=0, ranks=2)
        e.announce([(f"b{run}", 1)], group="127.0.0.1:29500/0:0:0", rank=1, ranks=2)
        assert [m.key for m in e.prefetch(4).of_type(Prefetch)] == [f"a{run}", f"b{run}"]
        e.access(f"a{run}", 1)
        e.access(f"b{run}", 1)
    assert e.policy.cursor == 4


def test_orders_sharing_places_are_all_prefetched():
    # a group's later windows (first > 0) come after another order was laid where they
    # go: both keep their places, and both are prefetched
    e = Engine(tiers(8, 1), "clairvoyant", announced=True)
    e.announce([("a0", 1), ("a1", 1)], group="g", rank=0, ranks=2)
    e.announce([("x0", 1), ("x1", 1)])  # after the group's places so far: 4, 5
    e.announce([("a2", 1), ("a3", 1)], group="g", rank=0, ranks=2, first=2)  # at 4 and 6
    keys = [m.key for m in e.prefetch(10).of_type(Prefetch)]
    assert sorted(keys) == ["a0", "a1", "a2", "a3", "x0", "x1"]
    assert keys.index("a2") < keys.index("a3") and keys.index("x0") < keys.index("a3")


def test_an_order_replacing_one_stopped_early_starts_at_the_reader():
    # a training loop that ends its epoch after 3 of 8 steps announces the next epoch:
    # appended, it would be expected only after the 5 unread places; replacing, at once
    e = Engine(tiers(4, 1), "clairvoyant", announced=True)
    e.announce([(f"a{i}", 1) for i in range(8)])
    assert len(e.prefetch(10).of_type(Prefetch)) == 5  # a0-a4
    for i in range(3):
        e.access(f"a{i}", 1)
    e.announce([(f"b{i}", 1) for i in range(8)], replace=True)
    assert e.policy.announced_until == 3 + 8 and e.policy.next_use("b0") == 3
    assert e.policy.next_use("a3") > 100  # the unread rest is off: its blocks are dead
    assert [m.key for m in e.prefetch(10).of_type(Prefetch)][:2] == ["b0", "b1"]
    # in a group, the first rank's announcement withdraws, the others' do not
    e.announce([("c0", 1)], group="g", rank=0, ranks=2, replace=True)
    e.announce([("d0", 1)], group="g", rank=1, ranks=2, replace=True)
    assert e.policy.next_use("c0") == 3 and e.policy.next_use("d0") == 4


def test_a_replacing_order_withdraws_only_its_owners_places():
    # two jobs on a node: one stops its epoch early and replaces its order; the other's
    # places stay where they are, and the new order is laid after them
    e = Engine(tiers(8, 1), "clairvoyant", announced=True)
    e.announce([("a0", 1), ("a1", 1), ("a2", 1)], owner="job-a")
    e.announce([("b0", 1), ("b1", 1)], owner="job-b")  # at 3, 4
    e.access("a0", 1)
    e.announce([("c0", 1)], owner="job-a", replace=True)
    assert e.policy.next_use("a1") > 100 and e.policy.next_use("a2") > 100
    assert (e.policy.next_use("b0"), e.policy.next_use("b1"), e.policy.next_use("c0")) == (3, 4, 5)
    assert [m.key for m in e.prefetch(10).of_type(Prefetch)] == ["b0", "b1", "c0"]


def test_a_ranks_announcement_is_checked():
    e = Engine(tiers(), "clairvoyant", announced=True)
    e.announce([("x", 1)], owner="me")
    for bad in ({"rank": 2, "ranks": 2}, {"rank": -1, "ranks": 2}, {"rank": "0", "ranks": 2},
                {"rank": 0, "ranks": 0}, {"rank": 0, "ranks": 2, "first": -1}):
        with pytest.raises(ValueError):
            e.announce([("a", 1)], group="g", owner="me", replace=True, **bad)
    assert e.policy.next_use("x") == 0  # a rejected announcement withdrew nothing


def test_a_ranks_place_before_one_announced_already_becomes_the_keys_next_read():
    e = Engine(tiers(4, 1), "clairvoyant", announced=True)
    e.access("x", 1)  # cached, no next read known
    e.announce([("y", 1), ("x", 1)], group="g", rank=0, ranks=2)  # x at 3
    assert e.policy.next_use("x") == 3 and e.policy.next["x"] == 3
    e.announce([("x", 1)], group="g", rank=1, ranks=2)  # and at 2, before it
    assert e.policy.next_use("x") == 2 and e.policy.next["x"] == 2
    e.access("y", 1)
    e.access("x", 1)
    assert e.policy.next_use("x") == 3


def test_places_the_reads_passed_are_forgotten_with_their_keys():
    # a long-lived daemon: every epoch announces keys that are never read as announced (a
    # reader reading other files than its order, until the order counts as abandoned); what
    # the engine and policy hold stays bounded by the places still ahead, not by every key
    # ever announced
    e = Engine(tiers(4, 4), "clairvoyant", announced=True)
    e.policy.slack = 4
    for epoch in range(50):
        e.announce([(f"e{epoch}-k{i}", 1) for i in range(20)])
        for i in range(20):
            e.access(f"other{i}", 1)  # after `slack` of them, each takes a place
        e.prefetch(0)  # the daemon plans after reads: passed places are forgotten there
    assert e.policy.cursor == 50 * 20 - 4
    # (private state: the bound is the point of this test) the places ahead, and those
    # up to `slack` behind the cursor, which a late read may still take
    assert len(e._order) <= 4 + 4
    assert len(e.policy._future) <= 4 + 4
    e.announce([("fresh", 1)])
    assert e.prefetch(10).of_type(Prefetch)[-1] == Prefetch("fresh", 1, "dram", 4)


def test_a_late_read_still_moves_the_cursor_after_a_prefetch_pass():
    # workers read out of order and hits reach the daemon late: a read of a block whose
    # place the cursor has just passed is still a read of the order (the cursor keeps pace)
    e = Engine(tiers(8, 1), "clairvoyant", announced=True)
    e.announce([(k, 1) for k in "abcd"])
    e.access("b", 1)
    e.prefetch(0)
    for k in "acd":
        e.access(k, 1)
    assert e.policy.cursor == 4


def test_prefetch_is_empty_without_an_order_and_announce_needs_clairvoyant():
    e = Engine(tiers())
    assert e.policy.name == "history" and not e.prefetch(100)
    with pytest.raises(ValueError, match="announced"):
        e.announce([("a", 1)])


def test_drop_forgets_a_block():
    e = Engine(tiers(), "lru")
    e.access("a", 1)
    e.drop("a")
    assert e.placement() == {} and "a" not in e.policy


def test_initial_placement_is_loaded():
    e = Engine(tiers(), "lru", placement={"a": ("nvme", 1)})
    assert e.placement() == {"a": "nvme"}
    with pytest.raises(ValueError, match="tier"):
        Engine(tiers(), "lru", placement={"a": ("gpu", 1)})


@pytest.mark.parametrize(
    "args, kwargs, name",
    [(([],), {}, "tiers"), (([TierSpec("x", 1, 1.0)] * 2,), {}, "distinct"),
     ((tiers(), "belady"), {}, "scoring"), ((tiers(), "nope"), {}, "policy")],
)
def test_bad_engine_arguments(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        Engine(*args, **kwargs)


def test_bad_access_and_order_arguments():
    e = Engine(tiers(), announced=True)
    with pytest.raises(ValueError, match="size"):
        e.access("a", 0)
    with pytest.raises(ValueError, match=r"order\[0\]"):
        e.announce(["a"])
    with pytest.raises(ValueError, match="budget_bytes"):
        e.prefetch(-1)


# ---- multi-node ------------------------------------------------------------------------

def test_assign_blocks_by_per_node_future_frequency():
    future = {"n0": ["a", "b", "a", "c", "a"], "n1": ["c", "c", "b", "d"]}
    sizes = {"a": 1, "b": 1, "c": 1, "d": 1}
    got = assign_blocks(future, sizes, 2)
    assert got == {"n0": frozenset({"a", "b"}), "n1": frozenset({"c", "b"})}
    assert assign_blocks(future, sizes, {"n0": 1, "n1": 0}) == {"n0": frozenset({"a"}), "n1": frozenset()}


def test_assign_blocks_bad_input():
    with pytest.raises(ValueError, match="capacity"):
        assign_blocks({"n0": ["a"]}, {"a": 1}, {"n1": 1})
    with pytest.raises(ValueError, match="sizes"):
        assign_blocks({"n0": ["a"]}, {}, 1)


def test_rebalance_plans_replicate_from_keepers():
    current = {"n0": frozenset({"a", "b"}), "n1": frozenset({"c"})}
    target = {"n0": frozenset({"a"}), "n1": frozenset({"a", "b", "c"}), "n2": frozenset({"z"})}
    sizes = {k: 1 for k in "abcz"}
    plans = rebalance_plans(current, target, sizes)
    assert plans["n0"].moves == (Evict("b", 1, "dram"),)
    assert set(plans["n1"].moves) == {Replicate("a", 1, "n0", "n1"), Prefetch("b", 1, "dram", 0)}
    assert plans["n2"].moves == (Prefetch("z", 1, "dram", 0),)


def test_stable_digest_is_process_independent():
    assert stable_digest("a") == stable_digest("a") and len(stable_digest(("f", 3))) == 8
    assert stable_digest("a").hex() == __import__("hashlib").blake2b(b"'a'", digest_size=8).hexdigest()
