"""The DCP plug-ins on their own: dcp.save / dcp.async_save / dcp.load, no process group."""
from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from cachemw.checkpoint import (BufferStager, CachemwStorageReader, CachemwStorageWriter,  # noqa: E402
                                CheckpointNotFoundError, SpreadSavePlanner)
from cachemw.checkpoint.writer import MANIFEST_NAME  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]


def make_state():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(600, 300, generator=g),
        "nested": {"b": torch.arange(17), "meta": {"epoch": 3, "names": ["a", "b"]}},
        "half": torch.randn(8, 8, generator=g).bfloat16(),
        "scalar": torch.tensor(2.5),
    }


def empty_like(state):
    return {
        "w": torch.zeros(600, 300),
        "nested": {"b": torch.zeros(17, dtype=torch.long), "meta": {"epoch": 0, "names": None}},
        "half": torch.zeros(8, 8, dtype=torch.bfloat16),
        "scalar": torch.tensor(0.0),
    }


def assert_same(a, b):
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["nested"]["b"], b["nested"]["b"])
    assert torch.equal(a["half"], b["half"]) and torch.equal(a["scalar"], b["scalar"])
    assert a["nested"]["meta"] == b["nested"]["meta"]


def save(path, state, **kw):
    dcp.save(state, storage_writer=CachemwStorageWriter(path, **kw), planner=SpreadSavePlanner(chunk_bytes=100_000),
             no_dist=True)


def test_uncompressed_checkpoint_loads_with_plain_dcp_and_default_reader(tmp_path):
    state = make_state()
    save(tmp_path / "c", state)
    out = empty_like(state)
    dcp.load(out, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert_same(out, state)
    manifest = json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())
    assert sum(1 for k in manifest["items"] if k.startswith("w@")) > 1  # cut into chunks
    assert all(len(item["checksum"]) == 16 for item in manifest["items"].values())
    assert all(v["data_offset"] >= 0 for k, v in manifest["items"].items() if k.startswith("w@"))


def test_tiny_tensors_of_every_size_roundtrip_through_the_in_place_path(tmp_path):
    # Regression: a small tensor's byte count can equal a header write of torch.save; the raw
    # data offset must come from the tensor's own memory, not from a same-sized write.
    state = {f"t{n}": torch.arange(n, dtype=torch.uint8) + 1 for n in range(0, 80)}
    state.update({f"f{n}": torch.randn(n) for n in range(0, 20)})
    save(tmp_path / "c", state)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=CachemwStorageReader(tmp_path / "c"), no_dist=True)
    assert all(torch.equal(out[k], state[k]) for k in state)


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_our_reader_roundtrip(tmp_path, compression):
    state = make_state()
    save(tmp_path / "c", state, compression=compression)
    out = empty_like(state)
    dcp.load(out, storage_reader=CachemwStorageReader(tmp_path / "c"), no_dist=True)
    assert_same(out, state)


def test_lz4_shrinks_compressible_state(tmp_path):
    state = {"z": torch.zeros(1000, 1000)}
    save(tmp_path / "raw", state)
    save(tmp_path / "lz4", state, compression="lz4")
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.distcp"))  # noqa: E731
    assert size(tmp_path / "lz4") < size(tmp_path / "raw") / 20


def test_reader_loads_into_a_differently_chunked_destination(tmp_path):
    state = make_state()
    save(tmp_path / "c", state)
    out = {"w": torch.zeros(600, 300)[:, :300]}  # a view: still loads, through the general path
    dcp.load(out, storage_reader=CachemwStorageReader(tmp_path / "c"), no_dist=True)
    assert torch.equal(out["w"], state["w"])


def test_corrupted_chunk_is_named(tmp_path):
    save(tmp_path / "c", make_state())
    manifest = json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())
    key, item = next((k, v) for k, v in manifest["items"].items() if k.startswith("w@") and v["offset"] == 0)
    path = tmp_path / "c" / item["relative_path"]
    data = bytearray(path.read_bytes())
    data[item["data_offset"] + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BaseException) as info:  # DCP wraps reader failures in CheckpointException
        dcp.load(empty_like(make_state()), storage_reader=CachemwStorageReader(tmp_path / "c"), no_dist=True)
    assert "ChecksumError" in str(info.value) and repr(key) in str(info.value)
    assert item["relative_path"] in str(info.value)


def test_uncommitted_directory_is_refused(tmp_path):
    save(tmp_path / "c", make_state())
    os.remove(tmp_path / "c" / MANIFEST_NAME)
    reader = CachemwStorageReader(tmp_path / "c")
    with pytest.raises(CheckpointNotFoundError):
        reader.read_metadata()
    # ... unless asked to read a plain DCP directory without our manifest.
    out = empty_like(make_state())
    dcp.load(out, storage_reader=CachemwStorageReader(tmp_path / "c", require_manifest=False), no_dist=True)
    assert_same(out, make_state())


def test_async_save_with_buffer_stager(tmp_path):
    state = make_state()
    stager = BufferStager()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fut = dcp.async_save(state, storage_writer=CachemwStorageWriter(tmp_path / "c"),
                             planner=SpreadSavePlanner(), async_stager=stager, no_dist=True)
        fut.result(timeout=60)
    out = empty_like(state)
    dcp.load(out, storage_reader=CachemwStorageReader(tmp_path / "c"), no_dist=True)
    assert_same(out, state)
    stager.close()


def test_stager_reuses_buffers_and_respects_budget():
    state = make_state()
    stager = BufferStager()
    first = stager.stage(state)["w"].data_ptr()  # the snapshot is dropped: its buffer is free
    state["w"].add_(1)
    second = stager.stage(state)
    assert first == second["w"].data_ptr()
    assert torch.equal(second["w"], state["w"]) and second["w"].data_ptr() != state["w"].data_ptr()
    # a snapshot still held (a save still writing it) is never overwritten by the next one
    held = state["w"].clone()
    state["w"].add_(1)
    third = stager.stage(state)
    assert third["w"].data_ptr() != second["w"].data_ptr()
    assert torch.equal(third["w"], state["w"]) and torch.equal(second["w"], held)
    assert second["nested"]["meta"] == state["nested"]["meta"]
    assert second["nested"]["meta"] is not state["nested"]["meta"]
    newest = third["w"].data_ptr()
    del second, third
    assert stager.stage(state)["w"].data_ptr() == newest  # the buffer kept is the newest
    with pytest.raises(ValueError, match="memory_budget"):
        BufferStager(memory_budget=1000).stage(state)
    with pytest.raises(ValueError, match="memory_budget"):
        BufferStager(memory_budget=-1)
    stager.close()
    assert stager.nbytes == 0


def test_writer_rejects_bad_options(tmp_path):
    with pytest.raises(ValueError, match="compression"):
        CachemwStorageWriter(tmp_path, compression="zip")
    with pytest.raises(ValueError, match="thread_count"):
        CachemwStorageWriter(tmp_path, thread_count=0)


def test_overlapping_async_saves_with_one_buffer_stager_each_keep_their_own_values(tmp_path):
    """A second dcp.async_save started before the first's future was done overwrote the
    buffers the first was still writing: its checkpoint held the second's values, or did not
    load (found by a black-box check). Each save now writes the snapshot it staged."""
    for n in (1000, 1000, 2_000_000):
        stager = BufferStager()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            futures = [dcp.async_save({"w": torch.full((n,), float(i))},
                                      storage_writer=CachemwStorageWriter(tmp_path / f"c{n}-{i}"),
                                      async_stager=stager, no_dist=True)
                       for i in (1, 2, 3)]
            for f in futures:
                f.result(timeout=60)
        for i in (1, 2, 3):
            out = {"w": torch.zeros(n)}
            dcp.load(out, storage_reader=CachemwStorageReader(tmp_path / f"c{n}-{i}"), no_dist=True)
            assert torch.equal(out["w"], torch.full((n,), float(i))), (n, i)
        stager.close()
        shutil.rmtree(tmp_path)
        tmp_path.mkdir()
