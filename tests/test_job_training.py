"""The job's DataLoader pieces (cachemw/job/training.py): what its collate hands over."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from cachemw.job.training import MemorySamples, SampleDataset, collate  # noqa: E402


def _in_memory(samples):
    """The job's own dataset over samples in memory (as its DataLoader floor reads them)."""
    entries = [(str(i), None, None) for i in range(len(samples))]
    return SampleDataset(MemorySamples(dict(zip(entries, samples))), entries)


def _collate_and_say_where(batch):
    flat, lengths = collate(batch)
    return flat, lengths, flat.is_shared()


def test_collate_joins_samples_of_any_size_with_their_lengths():
    batch = [b"ab", b"", os.urandom(1000)]
    flat, lengths = collate(batch)
    assert bytes(flat.numpy()) == b"".join(batch)
    assert lengths.tolist() == [2, 0, 1000]
    assert not flat.is_shared()  # in the trainer itself: plain memory


@pytest.mark.timeout(60)
def test_a_worker_builds_its_batch_in_shared_memory():
    """As torch's default_collate does: a batch built in private memory would be copied
    once more into shared memory on its way to the trainer."""
    samples = [os.urandom(4096 + i) for i in range(8)]
    loader = torch.utils.data.DataLoader(_in_memory(samples), batch_size=4, num_workers=1,
                                         collate_fn=_collate_and_say_where,
                                         multiprocessing_context="fork", timeout=30)
    got = list(loader)
    assert [shared for _, _, shared in got] == [True, True]
    assert b"".join(bytes(flat.numpy()) for flat, _, _ in got) == b"".join(samples)
    assert [n for _, lengths, _ in got for n in lengths.tolist()] == [len(s) for s in samples]
