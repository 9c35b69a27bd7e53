"""Access traces of training workloads, for the simulator and the benchmarks.

Why these: they are the patterns the cache must be good at. Epoch orders come from torch's
own samplers (``RandomSampler``, ``DistributedSampler``) with a seed, so a trace is exactly
what a DataLoader would read; dataset shapes follow DLIO's workloads (unet3d: 168 samples of
~146 MiB; bert: 2,500-byte samples packed in large record files, cached as fixed-size
blocks; resnet50: ~110 KB images). Zipf-skewed access stands for feature stores and
recommendation data; two jobs sharing one dataset for hyper-parameter sweeps.

torch and numpy are imported inside the functions that need them, so importing the engine
stays free of both. Every generator is deterministic in its ``seed``.
"""
from __future__ import annotations

from typing import Hashable, List, Optional, Sequence, Tuple

from .specs import check_positive_float, check_positive_int

Trace = List[Tuple]

MiB = 1 << 20


def _rng(seed: int):
    import numpy as np

    return np.random.default_rng(seed)


def sample_sizes(n: int, mean: int, spread: float = 0.0, seed: int = 0) -> List[int]:
    """``n`` sizes around ``mean`` bytes (lognormal with sigma ``spread``; 0 = all equal)."""
    check_positive_int("n", n)
    check_positive_int("mean", mean)
    check_positive_float("spread", spread, allow_zero=True)
    if spread == 0:
        return [mean] * n
    r = _rng(seed).lognormal(mean=0.0, sigma=spread, size=n)
    r = r / r.mean()
    return [max(1, int(round(mean * x))) for x in r]


def epoch_orders(n: int, epochs: int, seed: int = 0, ranks: int = 1) -> List[List[List[int]]]:
    """Sample indices per epoch per rank, from torch's samplers.

    ``ranks == 1``: ``RandomSampler`` with a seeded generator (a fresh permutation per epoch).
    ``ranks > 1``: ``DistributedSampler(shuffle=True, seed=seed)`` with ``set_epoch(e)``, one
    per rank (each epoch a new random disjoint share per rank, padded to equal length).
    Returns ``orders[epoch][rank] -> list of indices``.
    """
    check_positive_int("n", n)
    check_positive_int("epochs", epochs)
    check_positive_int("ranks", ranks)
    import torch
    from torch.utils.data import DistributedSampler, RandomSampler

    data = range(n)
    if ranks == 1:
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(seed))
        return [[list(sampler)] for _ in range(epochs)]
    samplers = [
        DistributedSampler(data, num_replicas=ranks, rank=r, shuffle=True, seed=seed)
        for r in range(ranks)
    ]
    out = []
    for e in range(epochs):
        for s in samplers:
            s.set_epoch(e)
        out.append([list(s) for s in samplers])
    return out


def epochs_trace(
    sizes: Sequence[int],
    epochs: int = 5,
    seed: int = 0,
    ranks: int = 1,
    batch_size: int = 32,
    keys: Optional[Sequence[Hashable]] = None,
    with_nodes: bool = False,
) -> Trace:
    """Shuffled epochs over a dataset of ``len(sizes)`` samples.

    With several ranks, their streams are interleaved a batch at a time (ranks run in step);
    ``with_nodes`` tags each access with its rank, so the simulator gives each rank (node) its
    own cache. ``keys`` maps sample index to cache key (default: the index).
    """
    n = len(sizes)
    check_positive_int("batch_size", batch_size)
    out: Trace = []
    for per_rank in epoch_orders(n, epochs, seed, ranks):
        length = max(len(o) for o in per_rank)
        for lo in range(0, length, batch_size):
            for rank, order in enumerate(per_rank):
                for i in order[lo : lo + batch_size]:
                    key = keys[i] if keys is not None else i
                    out.append((key, sizes[i], rank) if with_nodes else (key, sizes[i]))
    return out


def unet3d(epochs: int = 5, seed: int = 0) -> Trace:
    """DLIO unet3d: 168 samples of ~146 MiB (lognormal spread 0.1)."""
    return epochs_trace(sample_sizes(168, 146 * MiB, 0.1, seed), epochs, seed, batch_size=4)


def resnet50(n: int = 20_000, epochs: int = 5, seed: int = 0) -> Trace:
    """DLIO resnet50: ``n`` JPEG-like images of ~110 KB (lognormal spread 0.3)."""
    return epochs_trace(sample_sizes(n, 110_000, 0.3, seed), epochs, seed, batch_size=64)


def bert(
    n: int = 200_000, epochs: int = 2, seed: int = 0, sample_size: int = 2_500,
    records_per_file: int = 20_000, block_size: int = 1 * MiB,
) -> Trace:
    """DLIO bert: 2,500-byte samples in record files of ``records_per_file`` samples.

    The cache unit is a block of ``block_size`` bytes of a file, so each sample read is an
    access to the block holding it: key ``(file, block)``, size ``block_size`` (the last
    block of a file is shorter).
    """
    check_positive_int("records_per_file", records_per_file)
    check_positive_int("block_size", block_size)
    check_positive_int("sample_size", sample_size)
    file_bytes = records_per_file * sample_size
    keys, sizes = [], []
    for i in range(n):
        f, off = divmod(i, records_per_file)
        b = off * sample_size // block_size
        keys.append((f, b))
        sizes.append(min(block_size, file_bytes - b * block_size))
    return epochs_trace(sizes, epochs, seed, batch_size=48, keys=keys)


def zipf(n_keys: int = 5_000, accesses: int = 200_000, s: float = 1.0, size: int = 1, seed: int = 0) -> Trace:
    """Independent draws from a Zipf(``s``) popularity over ``n_keys`` equal-size keys."""
    check_positive_int("n_keys", n_keys)
    check_positive_int("accesses", accesses)
    check_positive_float("s", s)
    check_positive_int("size", size)
    import numpy as np

    rng = _rng(seed)
    p = 1.0 / np.arange(1, n_keys + 1, dtype=np.float64) ** s
    p /= p.sum()
    keys = rng.choice(n_keys, size=accesses, p=p)
    return [(int(k), size) for k in keys]


def two_jobs(sizes: Sequence[int], epochs: int = 5, seed: int = 0, lag: int = 0, batch_size: int = 32) -> Trace:
    """Two jobs reading the same dataset with different shuffle seeds, a batch each in turn.

    Job B starts ``lag`` batches after job A (a sweep launched a little later).
    """
    check_positive_int("lag", lag, allow_zero=True)
    a = epochs_trace(sizes, epochs, seed, batch_size=batch_size)
    b = epochs_trace(sizes, epochs, seed + 1, batch_size=batch_size)
    out: Trace = list(a[: lag * batch_size])
    a = a[lag * batch_size :]
    for lo in range(0, max(len(a), len(b)), batch_size):
        out.extend(a[lo : lo + batch_size])
        out.extend(b[lo : lo + batch_size])
    return out


def dataset_bytes(trace: Trace) -> int:
    """Bytes of the distinct keys a trace touches (the size of its working set)."""
    seen = {}
    for item in trace:
        seen[item[0]] = item[1]
    return sum(seen.values())
