"""Workload traces: shapes, determinism, and that they come from torch's samplers."""
from __future__ import annotations

import subprocess
import sys

import pytest

from cachemw.placement import simulate, workloads


def test_importing_the_engine_pulls_in_neither_torch_nor_numpy_nor_ray():
    code = (
        "import sys, cachemw.placement, cachemw.placement.simulate;"
        "print(sorted(m for m in ('torch', 'numpy', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.torch
def test_epochs_are_permutations_from_random_sampler():
    import torch
    from torch.utils.data import RandomSampler

    trace = workloads.epochs_trace([7] * 50, epochs=3, seed=4)
    assert len(trace) == 150 and all(size == 7 for _, size in trace)
    sampler = RandomSampler(range(50), generator=torch.Generator().manual_seed(4))
    expected = [i for _ in range(3) for i in sampler]
    assert [k for k, _ in trace] == expected
    for e in range(3):
        assert sorted(k for k, _ in trace[50 * e : 50 * (e + 1)]) == list(range(50))
    assert trace == workloads.epochs_trace([7] * 50, epochs=3, seed=4)


@pytest.mark.torch
def test_distributed_sampler_ranks_share_each_epoch():
    trace = workloads.epochs_trace([1] * 40, epochs=2, ranks=4, batch_size=5, with_nodes=True)
    assert len(trace) == 80 and {n for _, _, n in trace} == {0, 1, 2, 3}
    first_epoch = [k for k, _, _ in trace[:40]]
    assert sorted(first_epoch) == list(range(40))  # disjoint shares that cover the dataset
    assert [n for _, _, n in trace[:10]] == [0] * 5 + [1] * 5  # a batch per rank in turn


@pytest.mark.torch
def test_dlio_shapes():
    unet = workloads.unet3d(epochs=1)
    assert len(unet) == 168
    mean = sum(s for _, s in unet) / 168
    assert 0.9 * 146 * workloads.MiB < mean < 1.1 * 146 * workloads.MiB
    bert = workloads.bert(n=50_000, epochs=1, records_per_file=20_000)
    assert len(bert) == 50_000
    assert {k[0] for k, _ in bert} == {0, 1, 2}
    assert max(s for _, s in bert) == workloads.MiB
    res = workloads.resnet50(n=500, epochs=1)
    assert 100_000 < sum(s for _, s in res) / 500 < 120_000


def test_zipf_is_skewed_and_deterministic():
    trace = workloads.zipf(n_keys=100, accesses=5_000, seed=1)
    assert trace == workloads.zipf(n_keys=100, accesses=5_000, seed=1)
    zeros = sum(1 for k, _ in trace if k == 0)
    tail = sum(1 for k, _ in trace if k == 99)
    assert zeros > 10 * tail


@pytest.mark.torch
def test_two_jobs_interleave_two_orders():
    trace = workloads.two_jobs([1] * 20, epochs=1, batch_size=5)
    assert len(trace) == 40
    assert sorted(k for k, _ in trace) == sorted(list(range(20)) * 2)


@pytest.mark.torch
def test_history_matches_belady_on_shuffled_epochs():
    trace = workloads.epochs_trace([1] * 400, epochs=5)
    cap = workloads.dataset_bytes(trace) // 2
    best = simulate(trace, "belady", cap).hit_ratio
    assert best == pytest.approx(0.4, abs=0.02)
    assert simulate(trace, None, cap).hit_ratio >= 0.95 * best
    assert simulate(trace, "lru", cap).hit_ratio < 0.5 * best


@pytest.mark.parametrize(
    "call, name",
    [(lambda: workloads.sample_sizes(0, 1), "n"), (lambda: workloads.sample_sizes(1, 1, -1), "spread"),
     (lambda: workloads.zipf(s=0), "s"), (lambda: workloads.zipf(n_keys=0), "n_keys"),
     (lambda: workloads.two_jobs([1], lag=-1), "lag"), (lambda: workloads.epoch_orders(5, 0), "epochs")],
)
def test_bad_workload_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()
