"""Placement engine: pure placement policies, a trace simulator, and the engine a daemon drives.

Everything here is pure and deterministic: no I/O, no Ray, no torch or numpy at import time
(only the workload generators import torch's samplers and numpy, lazily). Decisions come out
as frozen dataclasses (:mod:`.moves`); something else executes them.

Scoring a policy::

    from cachemw.placement import simulate, workloads
    trace = workloads.epochs_trace([110_000] * 10_000, epochs=5)   # (key, size) per read
    cap = workloads.dataset_bytes(trace) // 2
    simulate(trace, "history", cap).hit_ratio / simulate(trace, "belady", cap).hit_ratio

Policies (names for ``simulate`` and ``Engine``): ``"lru"`` (baseline), ``"history"``
(frequency + aging + admission gate; the default without an announced order), ``"pin"``
(CoorDL's MinIO), ``"clairvoyant"`` (furthest announced next use, NoPFS-style; the default
with an announced order), ``"belady"`` (offline MIN, scoring only: the optimum for blocks
of equal size, a reference for sizes that vary, which other policies can beat slightly).
``python -m cachemw.placement.simulate`` prints policies x workloads with each ratio to
Belady's MIN.

How a node daemon drives it (one :class:`Engine` per node, called from the daemon's own
thread; the engine is not thread-safe)::

    engine = Engine([TierSpec("dram", 8 << 30, 10e9), TierSpec("nvme", 200 << 30, 2e9)],
                    announced=sampler_announces)      # None policy -> clairvoyant / history
    engine.announce([(key, size), ...])   # when an AnnouncingSampler sends an epoch's order
    plan = engine.access(key, size)       # after every read the daemon serves (hit or miss)
    plan = engine.prefetch(budget_bytes)  # when the source has idle bandwidth
    engine.drop(key)                      # the daemon lost a block (bad checksum, failed write)

Each call returns a :class:`Plan`, a tuple of moves to run in order:

* ``Evict(key, size, tier)``: delete the block from that tier.
* ``Demote(key, size, src, dst)``: move it to a slower tier (makes room in ``src``).
* ``Admit(key, size, tier)``: store the bytes just read from the source on a miss.
* ``Promote(key, size, src, dst)``: move a block just read from a slower tier up.
* ``Prefetch(key, size, tier, needed_at)``: read from the source ahead of use and store;
  ``needed_at`` orders them (0 = next read).
* ``Replicate(key, size, src_node, dst_node)``: dst's daemon copies the block from a peer.

The daemon executes moves (atomic fills, checksums, single-flight), and reports a block it
could not keep with ``engine.drop``. The engine assumes every move it planned was done.
Multi-node: :func:`assign_blocks` picks each node's blocks from the per-node announced
orders (future frequency), :func:`rebalance_plans` turns that into per-node plans.
"""
from .engine import Engine
from .future import BeladyPolicy, ClairvoyantPolicy, next_uses
from .moves import Admit, Demote, Evict, Move, Plan, Prefetch, Promote, Replicate
from .nodes import assign_blocks, rebalance_plans, stable_digest
from .policies import HistoryPolicy, LRUPolicy, PinPolicy, Policy
from .registry import ONLINE_POLICIES, POLICIES, default_policy_name, make_policy
from .simulator import SimResult, simulate
from .specs import NOMINAL_BANDWIDTH, TierSpec, TimeModel, nominal_bandwidth

__all__ = [
    "Admit", "BeladyPolicy", "ClairvoyantPolicy", "Demote", "Engine", "Evict", "HistoryPolicy",
    "LRUPolicy", "Move", "NOMINAL_BANDWIDTH", "ONLINE_POLICIES", "POLICIES", "PinPolicy", "Plan", "Policy", "Prefetch", "Promote",
    "Replicate", "SimResult", "TierSpec", "TimeModel", "assign_blocks", "default_policy_name",
    "make_policy", "nominal_bandwidth", "next_uses", "rebalance_plans", "simulate", "stable_digest",
]
