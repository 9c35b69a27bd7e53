"""Belady's MIN (with bypass) is optimal on unit-size traces: checked against brute force."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cachemw.placement import next_uses, simulate
from cachemw.placement.future import NEVER


def brute_force_min_misses(keys, capacity):
    """Fewest misses over every admit/evict/bypass choice (unit sizes), by dynamic programming."""
    states = {frozenset(): 0}
    for key in keys:
        nxt = {}
        for cached, misses in states.items():
            if key in cached:
                options = [(cached, misses)]
            else:
                options = [(cached, misses + 1)]  # bypass
                if len(cached) < capacity:
                    options.append((cached | {key}, misses + 1))
                for victim in cached:
                    options.append(((cached - {victim}) | {key}, misses + 1))
            for state, m in options:
                if m < nxt.get(state, 1 << 30):
                    nxt[state] = m
        states = nxt
    return min(states.values())


@settings(max_examples=150, deadline=None)
@given(keys=st.lists(st.integers(0, 4), min_size=0, max_size=12), capacity=st.integers(1, 3))
def test_belady_matches_brute_force(keys, capacity):
    result = simulate([(k, 1) for k in keys], "belady", capacity)
    assert result.misses == brute_force_min_misses(keys, capacity)


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.integers(0, 5), min_size=1, max_size=40), capacity=st.integers(1, 4))
def test_no_policy_beats_belady(keys, capacity):
    trace = [(k, 1) for k in keys]
    best = simulate(trace, "belady", capacity).hits
    for policy in ("lru", "pin", "history", "clairvoyant"):
        assert simulate(trace, policy, capacity).hits <= best


def test_clairvoyant_with_whole_order_equals_belady():
    trace = [((i * 7919) % 23, 1) for i in range(300)]
    assert simulate(trace, "clairvoyant", 5).hits == simulate(trace, "belady", 5).hits


def test_next_uses():
    assert next_uses(["a", "b", "a", "c", "b"]) == [2, 4, NEVER, NEVER, NEVER]
    assert next_uses([]) == []
