"""Unit tests of each online policy (no Ray, no torch)."""
from __future__ import annotations

import pytest

from cachemw.placement import (
    BeladyPolicy, ClairvoyantPolicy, HistoryPolicy, LRUPolicy, PinPolicy, Policy,
    default_policy_name, make_policy,
)


def feed(policy, keys, size=1):
    return [policy.access(k, size) for k in keys]


def fresh(cls, capacity, **kw):
    p = cls(**kw)
    p.reset(capacity)
    return p


def test_lru_evicts_least_recent():
    p = fresh(LRUPolicy, 2)
    assert feed(p, ["a", "b", "a", "c"]) == [False, False, True, False]
    assert set(p.sizes) == {"a", "c"} and p.evicted == ["b"]
    assert p.used == 2


def test_lru_bypasses_blocks_larger_than_the_cache():
    p = fresh(LRUPolicy, 10)
    assert p.access("big", 11) is False
    assert "big" not in p and p.used == 0


def test_pin_never_evicts():
    p = fresh(PinPolicy, 2)
    feed(p, ["a", "b", "c", "d", "c"])
    assert set(p.sizes) == {"a", "b"} and p.evicted == []


def test_history_keeps_frequent_blocks():
    p = fresh(HistoryPolicy, 2)
    feed(p, ["a", "a", "a", "b", "b", "b"])
    assert set(p.sizes) == {"a", "b"}
    feed(p, ["c", "c", "c"])  # c is not yet twice as frequent as a or b
    assert set(p.sizes) == {"a", "b"}
    feed(p, ["c"] * 5)  # its 8th read: 7 earlier reads > 2 x 3, it displaces the older one
    assert "c" in p and len(p.sizes) == 2


def test_history_degrades_to_pin_under_reshuffles():
    import random

    rnd = random.Random(1)
    p = fresh(HistoryPolicy, 50)
    order = list(range(100))
    feed(p, order)
    kept = set(p.sizes)
    for _ in range(4):
        rnd.shuffle(order)
        feed(p, order)
        assert set(p.sizes) == kept


def test_history_aging_halves_counts():
    p = fresh(HistoryPolicy, 4, aging_window=4)
    feed(p, ["a", "a", "a"])
    assert p.counts["a"] == 3
    feed(p, ["b"])  # 4th read: counts halve before it is counted
    assert p.counts["a"] == 1 and p.counts["b"] == 1


def test_clairvoyant_uses_the_announced_order():
    p = fresh(ClairvoyantPolicy, 1)
    p.announce(["a", "b", "a"])
    feed(p, ["a", "b", "a"])
    assert p.cursor == 3
    # b is needed never again, a sooner: the cache kept a and bypassed b
    assert p.evicted == [] and "a" in p


def test_clairvoyant_without_an_announcement_keeps_a_stable_subset():
    p = fresh(ClairvoyantPolicy, 2)
    feed(p, ["a", "b", "c", "d"])
    assert set(p.sizes) == {"a", "b"}
    p.announce(["d", "a"])  # only now is a's (and d's) next read known
    assert p.next_use("a") == 5  # positions count from the cursor (4 reads so far)


def test_clairvoyant_admit_ahead_never_evicts_a_sooner_block():
    p = fresh(ClairvoyantPolicy, 1)
    p.announce(["a", "b"])
    assert p.admit_ahead("a", 1, 0)
    assert not p.admit_ahead("b", 1, 1)  # would evict a, needed at 0 < 1
    assert "a" in p


def test_belady_needs_prepare_for_the_whole_trace():
    p = fresh(BeladyPolicy, 1)
    p.prepare(["a"], [1])
    p.access("a", 1)
    with pytest.raises(ValueError, match="prepare"):
        p.access("a", 1)


def test_discard_frees_space():
    for cls in (LRUPolicy, PinPolicy, HistoryPolicy, ClairvoyantPolicy):
        p = fresh(cls, 2)
        feed(p, ["a", "b"])
        p.discard("a")
        p.discard("missing")
        assert "a" not in p and p.used == 1


def test_default_policy():
    assert default_policy_name(False) == "history"
    assert default_policy_name(True) == "clairvoyant"
    assert make_policy(None).name == "history"
    assert make_policy(None, announced=True).name == "clairvoyant"


def test_make_policy_copies_policy_objects():
    template = HistoryPolicy(admit_ratio=3.0)
    made = make_policy(template)
    assert made is not template and made.admit_ratio == 3.0


@pytest.mark.parametrize("bad", ["fifo", 3, object()])
def test_unknown_policy_is_a_value_error_naming_policy(bad):
    with pytest.raises(ValueError, match="policy"):
        make_policy(bad)


def test_bad_policy_options_name_the_option():
    with pytest.raises(ValueError, match="aging_window"):
        HistoryPolicy(aging_window=0)
    with pytest.raises(ValueError, match="admit_ratio"):
        HistoryPolicy(admit_ratio=-1)
    with pytest.raises(ValueError, match="capacity_bytes"):
        LRUPolicy().reset(-5)


def test_base_policy_is_abstract():
    with pytest.raises(NotImplementedError):
        Policy().access("a", 1)


def test_dead_bytes_running_sum_matches_a_scan():
    """The bytes of cached blocks with no announced next read (what prefetch may displace)
    are kept as a running sum; it equals a full scan after any mix of operations."""
    import random

    from cachemw.placement.future import NEVER

    rng = random.Random(5)
    for cls in (ClairvoyantPolicy, BeladyPolicy):
        p = fresh(cls, 60)
        keys = [f"k{i}" for i in range(40)]
        size = {k: rng.randint(1, 9) for k in keys}
        trace = [rng.choice(keys) for _ in range(3000)]
        if cls is BeladyPolicy:
            p.prepare(trace, [size[k] for k in trace])
        for i, key in enumerate(trace):
            if cls is ClairvoyantPolicy and i % 97 == 0:
                p.announce(trace[i:i + rng.randint(0, 150)])
            if cls is ClairvoyantPolicy and i % 131 == 0:
                p.admit_ahead(rng.choice(keys), size[key], p.cursor + rng.randint(0, 50))
            if i % 89 == 0 and p.sizes:
                p.discard(rng.choice(sorted(p.sizes)))
            p.access(key, size[key])
            scan = sum(p.sizes[k] for k, nu in p.next.items() if nu >= NEVER and k in p.sizes)
            assert p.dead_bytes == scan, (cls.name, i)
        assert p.dead_bytes > 0  # the check saw dead blocks, not only zeros
