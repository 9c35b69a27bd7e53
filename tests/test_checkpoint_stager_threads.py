"""One ``BufferStager`` shared by stagings that run at once, in several threads.

README: "one ``BufferStager`` may serve overlapping ``async_save``s: a save started while
another still writes its snapshot gets buffers of its own". A black-box review found every
one of four concurrent ``dcp.async_save``s sharing a stager saved a mix of the four states:
a buffer was found free and claimed in two steps, with the copy between them, so two
stagings copied into one buffer. Also here: tuples are staged as what they were (a
namedtuple stays one), as DCP saves them without a stager.
"""
from __future__ import annotations

import collections
import threading
import warnings

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from cachemw.checkpoint import (BufferStager, CachemwStorageReader, CachemwStorageWriter,  # noqa: E402
                                SpreadSavePlanner)

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]

Pair = collections.namedtuple("Pair", "tensor count")
THREADS = 4
N = 1 << 20  # 4 MiB a tensor: a copy long enough for the others to run meanwhile


def _stage_at_once(stager: BufferStager, states: list[dict]) -> list[dict]:
    """Each state staged by a thread of its own, all started together; the snapshots all held."""
    barrier = threading.Barrier(len(states))
    out: list = [None] * len(states)
    errors: list = []

    def run(i: int) -> None:
        try:
            barrier.wait(30)
            out[i] = stager.stage(states[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(states))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


@pytest.mark.timeout(120)
def test_concurrent_stagings_never_share_a_buffer():
    stager = BufferStager()
    states = [{"w": torch.full((N,), float(k)), "u": torch.full((N // 4,), float(k))} for k in range(THREADS)]
    try:
        for _ in range(8):
            for k, s in enumerate(states):  # the new round's values
                s["w"].fill_(float(k))
                s["u"].fill_(float(k))
            staged = _stage_at_once(stager, states)
            for key in ("w", "u"):
                ptrs = {s[key].data_ptr() for s in staged}
                assert len(ptrs) == THREADS, f"{key}: {THREADS} live snapshots over {len(ptrs)} buffers"
            for k, s in enumerate(staged):
                assert s["w"].unique().tolist() == [float(k)] and s["u"].unique().tolist() == [float(k)], k
            del staged  # every snapshot dropped: their buffers are free for the next round
        assert stager.nbytes == (N + N // 4) * 4  # one buffer kept per tensor, the newest
    finally:
        stager.close()


@pytest.mark.timeout(300)
def test_concurrent_async_saves_sharing_a_stager_save_their_own_state(tmp_path):
    """The review's case: four ``dcp.async_save`` calls from four threads at once, one stager."""
    stager = BufferStager()
    states = {k: {"w": torch.full((N,), float(k)), "u": torch.full((N // 4,), float(k)), "k": k}
              for k in range(1, THREADS + 1)}
    barrier = threading.Barrier(THREADS)
    futures, errors = {}, []

    def go(k: int, rnd: int) -> None:
        try:
            barrier.wait(30)
            futures[k] = dcp.async_save(states[k], storage_writer=CachemwStorageWriter(tmp_path / f"r{rnd}-s{k}"),
                                        planner=SpreadSavePlanner(), async_stager=stager, no_dist=True)
            states[k]["w"].fill_(-k)  # mutated as soon as the save returns, as a training step would
            states[k]["u"].fill_(-k)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for rnd in range(3):
                for k, s in states.items():
                    s["w"].fill_(float(k))
                    s["u"].fill_(float(k))
                threads = [threading.Thread(target=go, args=(k, rnd)) for k in states]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
                assert not errors, errors
                for f in futures.values():
                    f.result(timeout=120)
                for k in states:
                    out = {"w": torch.zeros(N), "u": torch.zeros(N // 4), "k": 0}
                    dcp.load(out, storage_reader=CachemwStorageReader(tmp_path / f"r{rnd}-s{k}"), no_dist=True)
                    assert out["w"].unique().tolist() == [float(k)], (rnd, k)
                    assert out["u"].unique().tolist() == [float(k)], (rnd, k)
                    assert out["k"] == k
    finally:
        stager.close()


def test_tuples_are_staged_as_what_they_were(tmp_path):
    stager = BufferStager()
    try:
        state = {"pair": Pair(torch.full((3,), 7.0), 2), "plain": (1, torch.ones(2)), "size": torch.Size([2, 3])}
        staged = stager.stage(state)
        assert type(staged["pair"]) is Pair and staged["pair"].count == 2
        assert torch.equal(staged["pair"].tensor, state["pair"].tensor)
        assert staged["pair"].tensor.data_ptr() != state["pair"].tensor.data_ptr()  # a snapshot
        assert type(staged["plain"]) is tuple and type(staged["size"]) is torch.Size
        del staged
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.async_save(state, storage_writer=CachemwStorageWriter(tmp_path / "c"), async_stager=stager,
                           no_dist=True).result(timeout=60)
        out = {"pair": Pair(torch.zeros(3), 0), "plain": (0, torch.zeros(2)), "size": None}
        dcp.load(out, storage_reader=CachemwStorageReader(tmp_path / "c"), no_dist=True)
        assert type(out["pair"]) is Pair and out["pair"].count == 2 and torch.equal(out["pair"].tensor, state["pair"].tensor)
        assert out["plain"][0] == 1 and torch.equal(out["plain"][1], torch.ones(2))
        assert out["size"] == torch.Size([2, 3])
    finally:
        stager.close()
