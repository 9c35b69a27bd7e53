"""Regressions of the in-place fast tier found in review: recycled files, local failures, shared tiers.

What must hold: a save that cannot go in place never writes into the pool's files (they are
also another step's files); a local failure of ``save`` on one rank fails it on every rank
alike, with the collectives still in step; one rank's fallback never deletes the other ranks'
files of a shared fast tier; a load whose fast copy is recycled under it ends with the root copy.
"""
from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

from cachemw.checkpoint import CachemwStorageReader, Checkpointer  # noqa: E402
from cachemw.checkpoint.tiers import Drainer  # noqa: E402
from cachemw.checkpoint.writer import MANIFEST_NAME  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]


class Sub(torch.Tensor):
    """A tensor subclass: the in-place path does not take it, the save goes through buffers."""


def plain(v: float, many: bool) -> dict:
    if many:
        return {f"p{i}": torch.full((100,), v) for i in range(200)}
    return {"a": torch.full((3000, 10), v), "b": torch.full((2000, 10), v)}


def odd(v: float, many: bool) -> dict:
    s = plain(v, many)
    s["x"] = torch.ones(4).as_subclass(Sub)
    return s


def values(state: dict) -> set:
    return {float(x) for k, t in state.items() if k != "x" for x in t.unique().tolist()}


def in_child(fn, *args, timeout: float = 120) -> None:
    """Run ``fn(*args)`` in a spawned process: a SIGBUS (a truncated mapped file) fails the test, not pytest."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=fn, args=args)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        pytest.fail(f"{fn.__name__} did not finish in {timeout} s")
    assert proc.exitcode == 0, f"{fn.__name__} exited with {proc.exitcode} (negative: killed by that signal)"


def _alternate(base: str, many: bool) -> None:
    root, fast = base + "/root", base + "/fast"
    ck = Checkpointer(root, fast_root=fast)
    try:
        ck.save(1, plain(1.0, many)).wait(60)
        ck.save(2, odd(2.0, many)).wait(60)
        ck.save(3, odd(3.0, many)).wait(60)
        handle = ck.save(4, plain(4.0, many))
        # Step 3 is still the committed in-memory copy while step 4 snapshots: its bytes intact.
        fast3 = [n for n in os.listdir(fast) if n.startswith("step_000000000003")]
        if fast3 and os.path.exists(os.path.join(fast, fast3[0], MANIFEST_NAME)):
            out = odd(0.0, many)
            if ck.load(out, step=3) != 3 or values(out) != {3.0}:
                raise SystemExit("step 3's in-memory copy was overwritten")
        handle.wait(60)
        if os.path.exists(os.path.join(fast, ".spare")):
            raise SystemExit("a spare next to the in-place pool")
    finally:
        ck.close()
    at_root = Checkpointer(root, fast_root=None)
    for step, make in [(1, plain), (2, odd), (3, odd), (4, plain)]:
        out = make(0.0, many)
        if at_root.load(out, step=step) != step or values(out) != {float(step)}:
            raise SystemExit(f"step {step} at the root holds {values(out)}")
    at_root.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("many", [False, True])
def test_alternating_in_place_and_buffered_saves_never_share_files(tmp_path, many):
    in_child(_alternate, str(tmp_path), many)


def _truncated_pool(base: str) -> None:
    ck = Checkpointer(base + "/root", fast_root=base + "/fast")
    try:
        ck.save(1, plain(1.0, False)).wait(60)
        pool = ck.fast_saver.pool
        first = pool.dir
        os.truncate(os.path.join(pool.dir, pool.layout.files[0].rel), 100)  # SIGBUS if copied into
        ck.save(2, plain(2.0, False)).wait(60)
        if pool.dir == first:
            raise SystemExit("the pool reused a file cut short behind its mapping")
    finally:
        ck.close()
    out = plain(0.0, False)
    if Checkpointer(base + "/root", fast_root=None).load(out) != 2 or values(out) != {2.0}:
        raise SystemExit("step 2 wrong at the root")


@pytest.mark.timeout(120)
def test_a_mapped_pool_file_changed_behind_the_pool_is_not_reused(tmp_path):
    in_child(_truncated_pool, str(tmp_path))


def hold_drains(monkeypatch):
    """Saves stay committed in memory only (their drain to the root waits) until the gate is set."""
    gate = threading.Event()
    orig_wait = Drainer.wait
    monkeypatch.setattr(Drainer, "wait", lambda self: (gate.wait(30), orig_wait(self))[1])
    return gate, orig_wait


def test_a_load_whose_fast_copy_is_recycled_under_it_ends_with_the_root_copy(tmp_path, monkeypatch):
    """The reader chose step 1 while it was committed in memory only (no root copy then)."""
    root, fast = str(tmp_path / "root"), str(tmp_path / "fast")
    ck = Checkpointer(root, fast_root=fast)
    gate, orig_wait = hold_drains(monkeypatch)
    h1 = ck.save(1, {"t": torch.full((3000, 10), 1.0)})
    while not h1.in_memory:
        pass
    orig_read = CachemwStorageReader._read_in_place
    later = []

    def racing(self, f, req, info, planner):
        if not later and self.location.url.startswith(fast):
            gate.set()
            h1.wait(30)  # step 1 reaches the root
            monkeypatch.setattr(Drainer, "wait", orig_wait)
            later.append(ck.save(2, {"t": torch.full((3000, 10), 2.0)}))  # recycles step 1's files
        return orig_read(self, f, req, info, planner)

    monkeypatch.setattr(CachemwStorageReader, "_read_in_place", racing)
    reader = Checkpointer(root, fast_root=fast)
    out = {"t": torch.zeros(3000, 10)}
    try:
        assert reader.load(out) == 1
        assert out["t"].unique().tolist() == [1.0]
    finally:
        if later:
            later[0].wait(30)
        reader.close()
        ck.close()


def test_a_fast_step_missing_files_is_skipped_for_an_older_complete_one(tmp_path, monkeypatch):
    """Step 2 committed in memory only, a data file then lost: load() takes step 1, not an error."""
    root, fast = str(tmp_path / "root"), str(tmp_path / "fast")
    ck = Checkpointer(root, fast_root=fast)
    gate, orig_wait = hold_drains(monkeypatch)
    try:
        ck.save(1, {"t": torch.full((3000, 10), 1.0)})
        gate.set()
        ck.wait(30)
        gate.clear()
        h2 = ck.save(2, {"t": torch.full((3000, 10), 2.0)})
        h2.wait_in_memory(30)
        step2 = os.path.basename(h2.path)
        data = [n for n in os.listdir(os.path.join(fast, step2)) if n.endswith(".distcp")]
        os.unlink(os.path.join(fast, step2, data[0]))
        reader = Checkpointer(root, fast_root=fast)
        out = {"t": torch.zeros(3000, 10)}
        assert reader.load(out) == 1 and out["t"].unique().tolist() == [1.0]
        reader.close()
    finally:
        gate.set()
        ck.close()


def test_pools_and_partial_steps_of_a_reused_pid_are_swept(tmp_path):
    """After a container restart with /dev/shm kept, a pool's pid may belong to another process now."""
    import json
    import socket

    from cachemw.checkpoint.file_pool import sweep_pools
    from cachemw.processes import process_start as pid_start
    from cachemw.checkpoint.layout import OWNER_NAME, CheckpointDir
    from cachemw.checkpoint.storage_io import Location

    host, pid = socket.gethostname(), os.getpid()
    live = f".pool-{host}-{pid}-{pid_start(pid)}-r0-aaaaaaaa"
    reused = f".pool-{host}-{pid}-{pid_start(pid) + 1}-r0-bbbbbbbb"
    old_live = f".pool-{host}-{pid}-r0-cccccccc"
    for name in (live, reused, old_live):
        (tmp_path / name).mkdir()
    assert sweep_pools(str(tmp_path)) == [reused]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, old_live])

    tier = CheckpointDir(Location(str(tmp_path / "tier")))
    for name, start in (("step_000000000001-aaaaaaaa", pid_start(pid)), ("step_000000000002-bbbbbbbb", 1)):
        tier.begin(name)
        owner = {"host": host, "pid": pid, "started": 0.0, "pid_start": start}
        (tmp_path / "tier" / name / OWNER_NAME).write_text(json.dumps(owner))
    assert tier.sweep(3600.0) == ["step_000000000002-bbbbbbbb"]


def _save_then_die_mid_drain(base: str, marker: str) -> None:
    """Save step 1 (drained), then step 2, whose drain writes part of a file at the root and
    then never ends; say so once step 2 is committed in memory, and wait to be killed."""
    import time

    from cachemw.checkpoint import tiers

    ck = Checkpointer(base + "/root", fast_root=base + "/fast")
    ck.save(1, {"t": torch.full((3000, 10), 1.0)}).wait(60)

    def cut_short(self, rel):  # the trainer dies inside its drain: a part written, never committed
        with open(self.dst.join(rel), "wb") as f:
            f.write(b"\0" * 100)
        time.sleep(600)

    tiers.Drainer._copy = cut_short
    ck.save(2, {"t": torch.full((3000, 10), 2.0)}).wait_in_memory(60)
    open(marker, "w").close()
    time.sleep(600)


@pytest.mark.timeout(120)
def test_a_step_loaded_from_memory_that_its_dead_trainer_never_drained_is_drained_now(tmp_path, caplog):
    """A trainer killed mid-drain: the restarted one loads step 2 from the node's memory,
    and drains it to the root in the background (wait() waits for it), so that the root
    holds it whole even if the node's memory is lost next; not before the old one is gone."""
    import time

    root, fast, marker = str(tmp_path / "root"), str(tmp_path / "fast"), str(tmp_path / "in-memory")
    proc = multiprocessing.get_context("spawn").Process(target=_save_then_die_mid_drain,
                                                        args=(str(tmp_path), marker))
    proc.start()
    try:
        deadline = time.monotonic() + 90
        while not os.path.exists(marker) and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(marker), f"the trainer did not reach step 2 in memory (exit {proc.exitcode})"
        assert Checkpointer(root, fast_root=None).steps() == [1]  # step 2 not at the root: its drain hangs
        live = Checkpointer(root, fast_root=fast)  # its trainer alive: its own drain may go on
        assert live.load({"t": torch.zeros(3000, 10)}) == 2
        live.wait(30)
        assert Checkpointer(root, fast_root=None).steps() == [1]
        live.close()
    finally:
        proc.kill()
        proc.join(10)
    ck = Checkpointer(root, fast_root=fast)
    out = {"t": torch.zeros(3000, 10)}
    with caplog.at_level("WARNING", logger="cachemw.checkpoint.checkpointer"):
        assert ck.load(out) == 2 and out["t"].unique().tolist() == [2.0]
    assert "never reached" in caplog.text
    ck.wait(60)
    ck.close()
    at_root = {"t": torch.zeros(3000, 10)}
    assert Checkpointer(root, fast_root=None).load(at_root) == 2  # whole at the root, checksums checked
    assert at_root["t"].unique().tolist() == [2.0]


def test_a_step_in_memory_whose_drain_failed_is_kept_while_the_root_would_keep_it(tmp_path, monkeypatch):
    """Step 2's drain fails (a full root, say): its copy in memory is its only one. The next
    save's retention in memory (one copy kept there by default) removed it, against
    keep_last and 'loadable once in_memory, whatever becomes of its drain'. It stays until
    keep_last's newest steps pass it, as at the root."""
    root, fast = str(tmp_path / "root"), str(tmp_path / "fast")
    orig_copy = Drainer._copy

    def failing(self, rel):
        if "step_000000000002" in self.src.url:
            raise OSError(28, "No space left on device (test)")
        return orig_copy(self, rel)

    monkeypatch.setattr(Drainer, "_copy", failing)
    state = lambda v: {"t": torch.full((3000, 10), float(v))}  # noqa: E731
    with Checkpointer(root, fast_root=fast, keep_last=3) as ck:
        ck.save(1, state(1)).wait(60)
        h2 = ck.save(2, state(2))
        with pytest.raises(OSError):
            h2.wait(60)
        assert h2.in_memory
        ck.save(3, state(3)).wait(60)
        assert ck.steps() == [1, 2, 3]
        out = state(0)
        assert ck.load(out, step=2) == 2 and out["t"].unique().tolist() == [2.0]
        ck.save(4, state(4)).wait(60)
        ck.save(5, state(5)).wait(60)
        assert ck.steps() == [3, 4, 5]  # past keep_last's newest three: gone from memory too


def test_while_every_drain_fails_memory_holds_two_copies_not_one_per_save(tmp_path, monkeypatch):
    """A root that fails every drain (full, unreachable): each save's copy is its step's only
    one, and keeping them all would grow the node's memory by a state per save. The newest
    undrained copy besides the one just saved is kept; older ones go."""
    root, fast = str(tmp_path / "root"), str(tmp_path / "fast")

    def failing(self, rel):
        raise OSError(28, "No space left on device (test)")

    state = lambda v: {"t": torch.full((3000, 10), float(v))}  # noqa: E731
    with Checkpointer(root, fast_root=fast) as ck:  # keep_last=None: every step, at the root
        ck.save(1, state(1)).wait(60)
        monkeypatch.setattr(Drainer, "_copy", failing)
        for step in range(2, 7):
            with pytest.raises(OSError):
                ck.save(step, state(step)).wait(60)
        assert ck.steps() == [1, 5, 6]
        out = state(0)
        assert ck.load(out, step=5) == 5 and out["t"].unique().tolist() == [5.0]
