"""Saves with a fast tier: the snapshot goes straight into the new step's files (one copy in memory).

What must hold: the previous in-memory copy leaves the committed set before it is overwritten
(a load during a save never reads a half-written step), a copy that is not yet at the root is
never overwritten, a change of shapes or dtypes re-plans on fresh files, every kind of value
round-trips, plain DCP loads the result at the root, and memory stays at one copy.
"""
from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from cachemw.checkpoint import Checkpointer  # noqa: E402
from cachemw.checkpoint.file_pool import blob_reserve, held_bytes  # noqa: E402
from cachemw.checkpoint.slot_layout import SlotRequest, plan_layout  # noqa: E402
from cachemw.checkpoint.writer import MANIFEST_NAME  # noqa: E402
from test_checkpoint_checkpointer import gate_writes, tiny_disk  # noqa: E402,F401 (a fixture)
from test_checkpoint_dist import kill_when_marked  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]


def committed(directory):
    return sorted(p.name for p in directory.iterdir() if (p / MANIFEST_NAME).exists())


def pools(fast):
    return [p for p in fast.iterdir() if p.name.startswith(".pool-")]


def mixed_state(scale: float = 1.0):
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(700, 300, generator=g) * scale,
        "nested": {"ids": torch.arange(33) * int(scale), "meta": {"epoch": scale, "names": ["a", "b"]}},
        "half": (torch.randn(9, 7, generator=g) * scale).bfloat16(),
        "scalar": torch.tensor(2.5 * scale),
        "empty": torch.zeros(0, 4),
        "flags": torch.tensor([True, False, True]),
        "param": torch.nn.Parameter(torch.full((5, 5), scale)),
    }


def zeros_like(state):
    out = {k: torch.zeros_like(v.detach()) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    out["nested"] = {"ids": torch.zeros(33, dtype=torch.long), "meta": {"epoch": 0, "names": None}}
    return out


def assert_same(out, state):
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out[k], v.detach()), k
    assert torch.equal(out["nested"]["ids"], state["nested"]["ids"])
    assert out["nested"]["meta"] == state["nested"]["meta"]


def test_every_kind_of_value_roundtrips_and_plain_dcp_loads_the_root_copy(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    with Checkpointer(str(root), fast_root=str(fast), chunk_bytes=300_000) as ck:
        for scale in (1.0, 2.0, 3.0):
            state = mixed_state(scale)
            ck.save(int(scale), state).wait(60)
            out = zeros_like(state)
            assert ck.load(out) == int(scale)  # from the fast tier
            assert_same(out, state)
        assert len(pools(fast)) == 1
    plain = zeros_like(state)
    dcp.load(plain, checkpoint_id=str(root / committed(root)[-1]), no_dist=True)  # DCP's own reader
    assert_same(plain, state)
    manifest = json.loads((root / committed(root)[-1] / MANIFEST_NAME).read_text())
    assert sum(1 for k in manifest["items"] if k.startswith("w@")) > 1  # cut into chunks, framed in place


def test_previous_copy_leaves_the_committed_set_before_it_is_overwritten(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        ck.save(1, {"t": torch.full((3000, 10), 1.0)}).wait(60)
        gate = gate_writes(ck)
        handle = ck.save(2, {"t": torch.full((3000, 10), 2.0)})  # snapshot taken, write held
        try:
            assert committed(fast) == []  # step 1 is no longer readable in memory...
            pool_file = next(pools(fast)[0].iterdir())
            assert torch.full((1000,), 2.0).numpy().tobytes() in pool_file.read_bytes()  # step 2 is in place
            with Checkpointer(str(root), fast_root=str(fast)) as reader:  # e.g. a watcher process
                out = {"t": torch.zeros(3000, 10)}
                assert reader.load(out) == 1 and torch.all(out["t"] == 1.0)  # ...but is at the root
        finally:
            gate.set()
        handle.wait(60)
        out = {"t": torch.zeros(3000, 10)}
        assert ck.load(out) == 2 and torch.all(out["t"] == 2.0)
        assert len(committed(fast)) == 1


def test_a_copy_not_yet_at_the_root_is_never_overwritten(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        ck.save(1, {"t": torch.full((3000, 10), 1.0)}).wait(60)
        name = committed(fast)[0]
        (root / name / MANIFEST_NAME).unlink()  # as if its drain to the root had failed
        gate = gate_writes(ck)
        handle = ck.save(2, {"t": torch.full((3000, 10), 2.0)})
        try:
            assert committed(fast) == [name]  # still committed in memory, and intact
            with Checkpointer(str(root), fast_root=str(fast)) as reader:
                out = {"t": torch.zeros(3000, 10)}
                assert reader.load(out) == 1 and torch.all(out["t"] == 1.0)
        finally:
            gate.set()
        handle.wait(60)
        assert ck.steps() == [1, 2]  # step 1 is only in memory: kept there (keep_last=None keeps all)
        assert len(pools(fast)) == 1


def test_shape_or_dtype_change_replans_on_fresh_files(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    states = [{"t": torch.randn(1000, 10)}, {"t": torch.randn(1000, 10).double()},
              {"t": torch.randn(1500, 10).double(), "u": torch.ones(7)}, {"t": torch.randn(1500, 10).double(), "u": torch.ones(7)}]
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        names = []  # a pool is recreated under a new name (inode numbers may be reused)
        for step, state in enumerate(states):
            ck.save(step, state).wait(60)
            (pool,) = pools(fast)
            names.append(pool.name)
            out = {k: torch.zeros_like(v) for k, v in state.items()}
            assert ck.load(out) == step and all(torch.equal(out[k], v) for k, v in state.items())
        assert len(set(names[:3])) == 3 and names[2] == names[3]
        state_bytes = sum(v.numel() * v.element_size() for v in states[-1].values())
        assert held_bytes(str(fast)) <= 1.05 * state_bytes + (64 << 10)  # one copy, old ones freed


def test_compression_with_a_fast_tier_stages_into_buffers(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    state = {"t": torch.zeros(2000, 50), "v": 3}
    with Checkpointer(str(root), fast_root=str(fast), compression="lz4") as ck:
        for step in range(2):
            ck.save(step, state).wait(60)
        assert pools(fast) == [] and ck.stager.nbytes == 2000 * 50 * 4
        out = {"t": torch.ones(2000, 50), "v": 0}
        assert ck.load(out) == 1 and torch.count_nonzero(out["t"]) == 0 and out["v"] == 3


def count_layouts(monkeypatch):
    """How many times a rank lays out its snapshot files (plans them anew)."""
    import cachemw.checkpoint.fast_save as fast_save

    calls = []
    original = fast_save.plan_layout

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(fast_save, "plan_layout", counted)
    return calls


def test_reserve_plans_and_makes_the_pool_the_first_save_copies_into(tmp_path, monkeypatch):
    root, fast = tmp_path / "root", tmp_path / "fast"
    layouts = count_layouts(monkeypatch)
    state = mixed_state(1.0)
    with Checkpointer(str(root), fast_root=str(fast), chunk_bytes=300_000) as ck:
        ck.reserve(state)
        (pool,) = pools(fast)
        made = {f.name: f.stat().st_size for f in pool.iterdir()}
        assert layouts == [1] and made and all(made.values())
        assert committed(fast) == [] and ck.steps() == []  # nothing saved by it
        for scale in (1.0, 2.0):
            state = mixed_state(scale)
            ck.save(int(scale), state).wait(60)
            assert [p.name for p in pools(fast)] == [pool.name]  # the reserved files, not new ones
            out = zeros_like(state)
            assert ck.load(out) == int(scale)
            assert_same(out, state)
        assert layouts == [1]
        ck.reserve({"t": torch.ones(10, 10)})  # another shape: planned and made again
        assert layouts == [1, 1] and [p.name for p in pools(fast)] != [pool.name]
        ck.save(3, {"t": torch.ones(10, 10)}).wait(60)
        assert layouts == [1, 1]
    plain = zeros_like(mixed_state(2.0))
    dcp.load(plain, checkpoint_id=str(root / committed(root)[1]), no_dist=True)  # step 2
    assert_same(plain, mixed_state(2.0))


def test_reserve_without_a_fast_tier_or_in_place_path_makes_the_staging_buffers(tmp_path):
    state = {"t": torch.randn(2000, 50), "v": 3}
    for fast_root, options in ((None, {}), (str(tmp_path / "fast"), {"compression": "lz4"})):
        with Checkpointer(str(tmp_path / f"root-{bool(options)}"), fast_root=fast_root, **options) as ck:
            ck.reserve(state)
            assert ck.stager.nbytes == 2000 * 50 * 4 and ck.steps() == []
            ck.save(1, state).wait(60)
            out = {"t": torch.zeros(2000, 50), "v": 0}
            assert ck.load(out) == 1 and torch.equal(out["t"], state["t"]) and out["v"] == 3


def test_reserve_waits_for_a_pending_save_before_touching_its_files(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        gate = gate_writes(ck)
        handle = ck.save(1, {"t": torch.full((3000, 10), 1.0)})  # its pool is written from behind
        reserving = threading.Thread(target=ck.reserve, args=({"t": torch.ones(5, 5)},))
        reserving.start()
        time.sleep(0.3)
        assert reserving.is_alive() and not handle.done()
        gate.set()
        reserving.join(60)
        assert not reserving.is_alive() and handle.durable
        out = {"t": torch.zeros(3000, 10)}
        assert ck.load(out) == 1 and torch.all(out["t"] == 1.0)


def test_layout_reserves_room_for_any_blob_and_is_deterministic():
    reqs = [SlotRequest(f"k{i}", f"k{i}", (0, 0), (n, 3), "torch.float32", n * 12) for i, n in enumerate((5, 900, 40))]
    reserves = {("torch.float32", 2): blob_reserve("torch.float32", 2)}
    a, b = plan_layout("__0_", reqs, reserves, 2), plan_layout("__0_", list(reversed(reqs)), reserves, 2)
    assert a == b and len(a.files) == 2 and a.extra_rel == "__0_2.distcp"
    for f in a.files:
        for s in f.slots:
            assert s.start < s.data_pos < s.end <= f.size and s.data_pos % 64 == 0
    head, tail = reserves[("torch.float32", 2)]
    big = torch.empty(1 << 20, 3)  # more digits in every pickled integer than the proxy had
    from cachemw.checkpoint.file_pool import _Measure

    sink = _Measure(big.data_ptr(), big.numel() * 4)
    torch.save(big, sink)
    assert 0 <= sink.data_at <= head and sink.pos - sink.data_at - big.numel() * 4 <= tail


def _killed_fast_saver(root, fast, marker):
    from cachemw.checkpoint.file_pool import FilePool

    ck = Checkpointer(root, fast_root=fast)
    ck.save(1, {"t": torch.full((3000, 10), 1.0)}).wait(60)
    original = FilePool.seal

    def slow(self, *args, **kwargs):
        stored = original(self, *args, **kwargs)
        open(marker, "w").close()
        time.sleep(120)
        return stored

    FilePool.seal = slow
    ck.save(2, {"t": torch.full((3000, 10), 2.0)}).wait(300)


@pytest.mark.timeout(120)
def test_sigkill_mid_in_place_save_leaves_the_previous_step_loadable_and_is_swept(tmp_path):
    root, fast, marker = tmp_path / "root", tmp_path / "fast", tmp_path / "marker"
    kill_when_marked(_killed_fast_saver, (str(root), str(fast), str(marker)), marker)
    assert committed(fast) == [] and len(pools(fast)) == 1  # step 1 left memory before being overwritten
    with Checkpointer(str(root), fast_root=str(fast)) as ck:  # a restart
        assert ck.steps() == [1]
        assert pools(fast) == [] and not [p for p in fast.iterdir() if p.name.startswith("step_")]
        out = {"t": torch.zeros(3000, 10)}
        assert ck.load(out) == 1 and torch.all(out["t"] == 1.0)


def test_a_reader_holding_the_overwritten_files_gets_a_checksum_error_not_wrong_data(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from cachemw.checkpoint import CachemwStorageReader, ChecksumError

    root, fast, held = tmp_path / "root", tmp_path / "fast", tmp_path / "held"
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        ck.save(1, {"t": torch.full((3000, 10), 1.0)}).wait(60)
        step1 = fast / committed(fast)[0]
        held.mkdir()  # what a reader that opened step 1 in memory still sees: its manifest, the same inodes
        for p in step1.iterdir():
            (held / p.name).hardlink_to(p) if p.name.endswith(".distcp") else (held / p.name).write_bytes(p.read_bytes())
        ck.save(2, {"t": torch.full((3000, 10), 2.0)}).wait(60)
        out = {"t": torch.zeros(3000, 10)}
        with pytest.raises(CheckpointException) as info:  # DCP's wrapper of the reader's error
            dcp.load(out, storage_reader=CachemwStorageReader(str(held)), no_dist=True)
        assert "checksum mismatch in chunk 't@0,0'" in str(info.value)
        assert isinstance(info.value.failures[0][0], ChecksumError)


def test_load_falls_back_to_the_root_when_the_fast_copy_is_recycled_mid_load(tmp_path, monkeypatch):
    from cachemw.checkpoint import CachemwStorageReader

    root, fast = tmp_path / "root", tmp_path / "fast"
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        ck.save(1, {"t": torch.full((3000, 10), 1.0)}).wait(60)
        gate = gate_writes(ck)
        original, started = CachemwStorageReader.read_data, []

        def racing(self, plan, planner):
            if not started and str(self.location.url).startswith(str(fast)):
                started.append(ck.save(2, {"t": torch.full((3000, 10), 2.0)}))  # overwrites step 1 in memory
            return original(self, plan, planner)

        monkeypatch.setattr(CachemwStorageReader, "read_data", racing)
        try:
            with Checkpointer(str(root), fast_root=str(fast)) as reader:
                out = {"t": torch.zeros(3000, 10)}
                assert reader.load(out) == 1 and torch.all(out["t"] == 1.0)  # from the root, whole
        finally:
            gate.set()
        assert started and started[0].wait(60) is None


def test_a_state_that_does_not_fit_the_checkpoint_fails_once_not_again_from_the_root(tmp_path, monkeypatch, caplog):
    """A shape that differs from the saved one is the caller's error: the fast copy is whole,
    so it is raised as it is, without a warning and a second read of the same step."""
    from cachemw.checkpoint import CachemwStorageReader

    root, fast = tmp_path / "root", tmp_path / "fast"
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        ck.save(1, {"t": torch.ones(100)}).wait(60)
        reads, original = [], CachemwStorageReader.read_metadata
        monkeypatch.setattr(CachemwStorageReader, "read_metadata",
                            lambda self, *a: reads.append(str(self.location.url)) or original(self, *a))
        with caplog.at_level("WARNING", logger="cachemw.checkpoint"):
            with pytest.raises(ValueError, match="Size mismatch"):
                ck.load({"t": torch.zeros(10)})
    assert len(reads) == 1 and reads[0].startswith(str(fast)), reads
    assert not [r for r in caplog.records if "loading it again" in r.getMessage()]


def test_a_full_fast_tier_at_snapshot_time_falls_back_to_buffers(tmp_path, monkeypatch):
    import errno

    import cachemw.checkpoint.file_pool as file_pool

    def full(path, size):
        raise OSError(errno.ENOSPC, "No space left on device (injected)", path)

    monkeypatch.setattr(file_pool, "_map_new", full)
    root, fast = tmp_path / "root", tmp_path / "fast"
    state = {"t": torch.randn(3000, 10), "v": {"epoch": 2}}
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        ck.save(1, state).wait(60)  # the training goes on; this save is staged into buffers
        assert pools(fast) == [] and ck.stager.nbytes == 3000 * 10 * 4
        out = {"t": torch.zeros(3000, 10), "v": {"epoch": 0}}
        assert ck.load(out) == 1 and torch.equal(out["t"], state["t"]) and out["v"] == {"epoch": 2}
        monkeypatch.undo()
        ck.save(2, state).wait(60)  # room again: back to the in-place path
        assert len(pools(fast)) == 1 and ck.stager.nbytes == 0  # and the buffers are given back


@pytest.mark.parametrize("full", ["fast", "root"])
def test_full_fast_tier_or_root_fails_the_handle_not_the_training(tmp_path, tiny_disk, full):
    root = tiny_disk if full == "root" else tmp_path / "root"
    fast = tiny_disk if full == "fast" else tmp_path / "fast"
    small = {"t": torch.randn(64, 1024)}  # 256 KiB
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        ck.save(1, small).wait(60)
        handle = ck.save(2, {"t": torch.randn(1024, 1024)})  # 4 MiB > 2 MiB
        with pytest.raises(OSError) as info:
            handle.wait(60)
        assert info.value.errno == 28  # ENOSPC
        out = {"t": torch.zeros(64, 1024)}
        assert ck.load(out, step=1) == 1 and torch.equal(out["t"], small["t"])  # the older checkpoint is intact
        ck.save(3, small).wait(60)  # and the next save works
        # a step in memory whose drain failed stays loadable there (its only copy)
        assert ck.steps() == ([1, 2, 3] if full == "root" else [1, 3])
        assert ck.load(out) == 3 and torch.equal(out["t"], small["t"])


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="nice is per thread on Linux")
@pytest.mark.parametrize("nice", [10, 0])
def test_the_background_of_a_save_runs_niced_and_the_caller_is_left_as_it_was(tmp_path, monkeypatch, nice):
    """Writing and draining run at ``background_nice`` above the trainer's priority (they
    take the cores training leaves idle); the trainer's thread keeps its own; 0: the same."""
    import os

    from cachemw.checkpoint import tiers, writer

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen = {"drain": set(), "write": set()}
    copy_file, write_data = tiers.copy_file, writer.CachemwStorageWriter.write_data

    def copying(*args, **kwargs):
        seen["drain"].add(niceness())
        return copy_file(*args, **kwargs)

    def writing(self, *args, **kwargs):
        seen["write"].add(niceness())
        return write_data(self, *args, **kwargs)

    monkeypatch.setattr(tiers, "copy_file", copying)
    monkeypatch.setattr(writer.CachemwStorageWriter, "write_data", writing)
    own = niceness()
    with Checkpointer(str(tmp_path / "root"), fast_root=str(tmp_path / "fast"),
                      chunk_bytes=300_000, background_nice=nice) as ck:
        for step in (1, 2):
            ck.save(step, mixed_state(float(step))).wait(60)
        out = zeros_like(mixed_state())
        assert ck.load(out) == 2
    assert_same(out, mixed_state(2.0))
    assert niceness() == own
    assert seen["drain"] == seen["write"] == {min(19, own + nice)}, seen


def test_background_nice_is_checked(tmp_path):
    for bad in (20, -1, 2.5, True):
        with pytest.raises(ValueError, match="background_nice"):
            Checkpointer(str(tmp_path), fast_root=None, background_nice=bad)


def test_a_fast_copy_of_a_root_removed_is_never_loaded_and_is_dropped(tmp_path):
    """The fast tier is the node daemon's and outlives the root's files: a run started
    afresh in a root removed by hand must not resume from the removed run's copy in memory."""
    import shutil

    root, fast = tmp_path / "root", tmp_path / "fast"
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        ck.save(100, {"t": torch.full((300, 10), 100.0)}).wait(60)
    assert len(committed(fast)) == 1
    shutil.rmtree(root)
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        assert ck.steps() == []
        assert committed(fast) == []  # its memory given back
        with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
            ck.load({"t": torch.zeros(300, 10)})
        ck.save(1, {"t": torch.full((300, 10), 1.0)}).wait(60)
        out = {"t": torch.zeros(300, 10)}
        assert ck.steps() == [1] and ck.load(out) == 1 and torch.all(out["t"] == 1.0)


def test_a_step_whose_drain_failed_stays_loadable_from_memory(tmp_path, monkeypatch):
    """``handle.in_memory``: loadable on its node whatever becomes of its drain; a failed
    drain (a full root) removes the step's directory at the root, not its copy in memory,
    and a Checkpointer made again (the trainer restarted) still finds it."""
    import cachemw.checkpoint.tiers as tiers

    root, fast = tmp_path / "root", tmp_path / "fast"
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        ck.save(1, {"t": torch.full((300, 10), 1.0)}).wait(60)

        def full(src, dst, rel):
            raise OSError(28, "No space left on device (injected)")

        monkeypatch.setattr(tiers, "copy_file", full)
        handle = ck.save(2, {"t": torch.full((300, 10), 2.0)})
        handle.wait_in_memory(60)
        with pytest.raises(OSError, match="injected"):
            handle.wait(60)
        monkeypatch.undo()
        out = {"t": torch.zeros(300, 10)}
        assert ck.steps() == [1, 2] and ck.load(out) == 2 and torch.all(out["t"] == 2.0)
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        out = {"t": torch.zeros(300, 10)}
        assert ck.steps() == [1, 2] and ck.load(out) == 2 and torch.all(out["t"] == 2.0)


def test_a_damaged_root_manifest_is_passed_over_with_a_fast_copy_too(tmp_path, caplog):
    """As without a fast tier (README: passed over with a warning, the step before it loads),
    so that every node, with or without the copy in its memory, loads the same step."""
    root, fast = tmp_path / "root", tmp_path / "fast"
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        ck.save(1, {"t": torch.full((300, 10), 1.0)}).wait(60)
        ck.save(2, {"t": torch.full((300, 10), 2.0)}).wait(60)
    newest = max(p.name for p in root.iterdir() if p.name.startswith("step_"))
    manifest = root / newest / MANIFEST_NAME
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0x20
    manifest.write_bytes(bytes(data))
    with Checkpointer(str(root), fast_root=str(fast)) as ck:
        out = {"t": torch.zeros(300, 10)}
        with caplog.at_level("WARNING"):
            assert ck.load(out) == 1
        assert torch.all(out["t"] == 1.0)
        assert "not counted as a committed checkpoint" in caplog.text
        assert ck.steps() == [1]
