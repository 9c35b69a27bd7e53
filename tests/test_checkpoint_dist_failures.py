"""Local failures of ``save`` on one rank of several (real processes, gloo): the others never hang.

What must hold: a failure in the calling thread on one rank (of ``save``, or of ``reserve``) (a value that cannot be copied,
a planning or layout error, out of memory while staging) fails that save on every rank, with
the collectives still in step, so the next save commits and loads on every rank; one rank's
fallback to buffers in a shared fast tier takes none of the other ranks' files with it.
Every test has a timeout and kills what it spawned.
"""
from __future__ import annotations

import datetime
import errno
import json
import os
import time

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from test_checkpoint_dist import run_ranks  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def join(rank: int, world: int, rdv: str, timeout_s: int = 30) -> None:
    """A rank's start: one thread for torch, the gloo group over the rendezvous file."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def report(out_dir: str, rank: int, res: dict) -> None:
    """What a rank saw, for the test in the parent (test_checkpoint_dist.run_ranks)."""
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def state(fill: float) -> dict:
    return {"w": torch.full((2048, 256), fill), "b": torch.full((4096,), fill), "meta": {"epoch": int(fill)}}


class Uncopyable:
    def __deepcopy__(self, memo):
        raise TypeError("cannot copy (injected)")


def once(fn):
    """``fn`` raising on its first call only, so the next save goes through."""
    calls = []

    def wrapper(*args, **kwargs):
        if not calls:
            calls.append(1)
            return fn(*args, **kwargs)
        return wrapper.original(*args, **kwargs)
    return wrapper


def _inject(mode: str, rank: int):
    """Break one thing on rank 1 (first call only); return the state of the first save."""
    import cachemw.checkpoint.fast_save as fast_save
    import cachemw.checkpoint.file_pool as file_pool
    import cachemw.checkpoint.stager as stager

    first = state(1.0)
    if rank != 1:
        return first
    if mode == "reserve-layout":
        mode = "layout"  # the first layout is reserve's
    if mode == "describe":
        first["meta"] = {"epoch": Uncopyable()}
    elif mode in ("layout", "oom"):
        target, attr = (fast_save, "plan_layout") if mode == "layout" else (stager.BufferStager, "stage")

        def broken(*args, **kwargs):
            raise (TypeError("layout failed (injected)") if mode == "layout" else MemoryError("injected"))
        wrapper = once(broken)
        wrapper.original = getattr(target, attr)
        setattr(target, attr, wrapper)
    elif mode == "enospc":
        def full(path, size):
            time.sleep(0.3)  # rank 0 has linked its files into the shared step directory by now
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        wrapper = once(full)
        wrapper.original = file_pool._map_new
        file_pool._map_new = wrapper
    return first


def _rank_main(rank, world, rdv, root, mode, out_dir):
    join(rank, world, rdv)
    from cachemw.checkpoint import Checkpointer

    fast_root = None if mode == "oom" else root + "-fast"
    ck = Checkpointer(root, collective_timeout_s=10, chunk_bytes=256 << 10, fast_root=fast_root)
    res = {"rank": rank}
    first = _inject(mode, rank)
    if mode.startswith("reserve"):
        import cachemw.checkpoint.fast_save as fast_save
        layouts, original = [], fast_save.plan_layout
        fast_save.plan_layout = lambda *a, **k: layouts.append(1) or original(*a, **k)
        try:
            ck.reserve(state(0.0))
            res["reserve"] = "ok"
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            res["reserve"] = f"{type(exc).__name__}: {exc}"
    for step, st in ((1, first), (2, state(2.0))):
        try:
            ck.save(step, st).wait(60)
            res[f"save{step}"] = "ok"
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            res[f"save{step}"] = f"{type(exc).__name__}: {exc}"
    try:
        out = state(0.0)
        res["load"] = ck.load(out)
        res["ok"] = bool(torch.all(out["w"] == 2.0) and torch.all(out["b"] == 2.0))
    except Exception as exc:  # noqa: BLE001
        res["load"] = f"{type(exc).__name__}: {exc}"
    if mode.startswith("reserve"):
        res["layouts"] = len(layouts)
    ck.close()
    report(out_dir, rank, res)
    dist.destroy_process_group()


def run(tmp_path, mode):
    results = run_ranks(tmp_path, 2, tmp_path / "ckpt", mode, target=_rank_main)
    assert sorted(results) == [0, 1], f"{mode}: a rank reported nothing"
    return list(results.values())


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["describe", "layout", "oom"])
def test_a_local_failure_on_one_rank_fails_that_save_everywhere_and_the_next_one_commits(tmp_path, mode):
    results = run(tmp_path, mode)
    # Every rank raises the failure's own type (TypeError, MemoryError), as one process would.
    kind = "MemoryError" if mode == "oom" else "TypeError"
    for res in results:
        assert res["save1"].startswith(kind), res
        assert "rank(s) [1]" in res["save1"] or (mode == "oom" and res["rank"] == 1), res
        assert res["save2"] == "ok", res
        assert res["load"] == 2 and res["ok"], res


@pytest.mark.timeout(150)
def test_one_ranks_fallback_keeps_the_other_ranks_files_of_a_shared_fast_tier(tmp_path):
    results = run(tmp_path, "enospc")
    for res in results:
        assert res["save1"] == "ok" and res["save2"] == "ok", res
        assert res["load"] == 2 and res["ok"], res


def _subgroup_main(rank, world, rdv, root, action, out_dir):
    """One Checkpointer per pair of ranks (e.g. per pipeline stage); a fast tier on the first pair only."""
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    from cachemw.checkpoint import Checkpointer

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = rank // 2
    ck = Checkpointer(f"{root}{pair}", process_group=pairs[pair], collective_timeout_s=10,
                      fast_root=f"{root}{pair}-fast" if pair == 0 else None)
    ck.save(1, state(float(pair + 1))).wait(60)
    out = state(0.0)
    res = {"rank": rank, "fast": ck.fast is not None, "load": ck.load(out),
           "ok": bool(torch.all(out["w"] == float(pair + 1)))}
    ck.close()
    report(out_dir, rank, res)
    dist.destroy_process_group()


@pytest.mark.timeout(150)
def test_checkpointers_on_disjoint_subgroups_with_and_without_a_fast_tier_do_not_hang(tmp_path):
    results = run_ranks(tmp_path, 4, tmp_path / "ckpt", "subgroups", target=_subgroup_main)
    assert sorted(results) == [0, 1, 2, 3], results
    for rank, res in results.items():
        assert res["load"] == 1 and res["ok"] and res["fast"] == (rank < 2), res


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["reserve", "reserve-layout"])
def test_reserve_on_every_rank_lays_out_once_and_a_failure_on_one_is_raised_on_all(tmp_path, mode):
    """reserve() is collective like save(): planned once for both ranks and reused by their
    saves; a layout failing on rank 1 fails reserve on both, and the saves after it commit."""
    for res in run(tmp_path, mode):
        if mode == "reserve":
            assert res["reserve"] == "ok" and res["layouts"] == 1, res
        else:
            assert res["reserve"].startswith("TypeError") and "rank(s) [1]" in res["reserve"], res
            assert res["layouts"] == 2, res  # the failed one, and every rank's anew at save 1
        assert res["save1"] == "ok" and res["save2"] == "ok", res
        assert res["load"] == 2 and res["ok"], res


def _steps_main(rank, world, rdv, root, fast, out_dir):
    """Ranks that pass different steps to one save: refused on every rank, nothing lost."""
    join(rank, world, rdv)
    from cachemw.checkpoint import Checkpointer

    ck = Checkpointer(root, keep_last=1, collective_timeout_s=10, chunk_bytes=256 << 10,
                      fast_root=root + "-fast" if fast == "fast" else None)
    res = {"rank": rank}
    ck.save(1, state(1.0)).wait(60)
    try:
        ck.save(2 + rank, state(2.0)).wait(60)  # a rank whose step counter is off by one
        res["mismatch"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        res["mismatch"] = f"{type(exc).__name__}: {exc}"
    res["steps"] = ck.steps()
    out = state(0.0)
    res["load"] = ck.load(out)
    res["ok1"] = bool(torch.all(out["w"] == 1.0))
    ck.save(3, state(3.0)).wait(60)
    res["load3"] = ck.load(out)
    res["ok3"] = bool(torch.all(out["w"] == 3.0))
    ck.close()
    report(out_dir, rank, res)
    dist.destroy_process_group()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fast", ["fast", "root-only"])
def test_ranks_saving_different_steps_are_refused_on_every_rank(tmp_path, fast):
    results = run_ranks(tmp_path, 2, tmp_path / "ckpt", fast, target=_steps_main)
    assert sorted(results) == [0, 1], results
    for res in results.values():
        assert res["mismatch"].startswith("ValueError") and "different steps" in res["mismatch"], res
        assert "step 2: rank(s) [0]" in res["mismatch"] and "step 3: rank(s) [1]" in res["mismatch"], res
        assert res["steps"] == [1], res  # the step before is kept, nothing partial committed
        assert res["load"] == 1 and res["ok1"], res
        assert res["load3"] == 3 and res["ok3"], res


def _absent_main(rank, world, rdv, root, _, out_dir):
    """Rank 1 fails before the save (caught, and lingers, as a stuck data loader would)."""
    join(rank, world, rdv)
    from cachemw.checkpoint import Checkpointer

    ck = Checkpointer(root, collective_timeout_s=4, chunk_bytes=256 << 10)
    ck.save(1, state(1.0)).wait(60)
    res = {"rank": rank}
    if rank == 1:
        time.sleep(8)
        res["save2"] = "absent"
    else:
        started = time.monotonic()
        try:
            ck.save(2, state(2.0)).wait(60)
            res["save2"] = "ok"
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            res["save2"] = f"{type(exc).__name__}: {exc}"
        res["after"] = time.monotonic() - started
    report(out_dir, rank, res)
    os._exit(0)  # the groups are out of step: no orderly teardown


@pytest.mark.timeout(150)
def test_a_rank_that_never_reaches_a_save_fails_the_others_within_the_timeout_saying_so(tmp_path):
    results = run_ranks(tmp_path, 2, tmp_path / "ckpt", "absent", target=_absent_main)
    assert sorted(results) == [0, 1], results
    res = results[0]
    assert res["save2"].startswith("RuntimeError"), res
    assert "a collective with the other ranks failed" in res["save2"], res
    assert "collective_timeout_s" in res["save2"], res
    assert res["after"] < 30, res


class BrokenStateful:
    """An entry whose state_dict() fails (on one rank only, in the test below)."""

    def state_dict(self):
        raise TypeError("state_dict failed (injected)")

    def load_state_dict(self, sd):
        pass


def _load_failure_main(rank, world, rdv, root, mode, out_dir):
    """Save steps 1 and 2 on every rank, break step 2 (``mode``), then load it by its step:
    a failure that rank 0 meets choosing the step (a damaged manifest or .metadata), or
    that one rank meets on its own state, must reach every rank, at once."""
    join(rank, world, rdv, timeout_s=60)
    from cachemw.checkpoint import Checkpointer
    from cachemw.checkpoint.writer import MANIFEST_NAME

    ck = Checkpointer(root, collective_timeout_s=20, chunk_bytes=256 << 10, fast_root=None)
    for step in (1, 2):
        ck.save(step, state(float(step))).wait(60)
    dist.barrier()
    if rank == 0 and mode in ("manifest", "metadata", "chunk"):
        name = max(n for n in os.listdir(root) if n.startswith("step_"))
        chunks = sorted(n for n in os.listdir(os.path.join(root, name)) if n.endswith(".distcp"))
        path = os.path.join(root, name, {"manifest": MANIFEST_NAME, "metadata": ".metadata",
                                         "chunk": chunks[0]}[mode])
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0x04
        open(path, "wb").write(bytes(data))
    dist.barrier()
    res = {"rank": rank}
    if mode == "save":  # a save failing on rank 1 (raised there at once), then a load
        broken = dict(state(3.0), extra=BrokenStateful()) if rank == 1 else state(3.0)
        try:
            ck.save(3, broken)
        except TypeError:
            pass
    out = state(0.0)
    if mode == "state" and rank == 1:
        out["extra"] = BrokenStateful()
    started = time.monotonic()
    try:
        res["load2"] = ck.load(out, step=2)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        res["load2"] = f"{type(exc).__name__}: {exc}"
    res["seconds"] = time.monotonic() - started
    out = state(0.0)
    res["load"] = ck.load(out)  # the collectives are in step: the next load goes through
    res["value"] = float(out["w"][0, 0])
    try:
        ck.close()
        res["close"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        res["close"] = f"{type(exc).__name__}: {exc}"
    report(out_dir, rank, res)
    dist.destroy_process_group()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["manifest", "metadata", "chunk", "state", "save"])
def test_a_load_that_fails_on_one_rank_fails_on_every_rank_at_once(tmp_path, mode):
    """Rank 0 alone raised the ChecksumError of a step asked for whose .metadata was damaged
    while the others waited collective_timeout_s (and one that went on loaded another
    step); a damaged manifest asked for by its step was "not found", not a ChecksumError;
    a rank whose state failed left the others waiting in dcp.load; a load right after a
    save that failed on one rank met that save's vote out of step (every rank held). A
    damaged chunk: the newest step is passed over on every rank alike."""
    results = run_ranks(tmp_path, 2, tmp_path / "ckpt", mode, target=_load_failure_main)
    assert sorted(results) == [0, 1], f"{mode}: a rank reported nothing"
    kind = "TypeError" if mode == "state" else "ChecksumError"
    for res in results.values():
        assert res["seconds"] < 10, res  # not the collective timeout
        if mode == "save":
            assert res["load2"] == 2 and res["load"] == 2 and res["value"] == 2.0, res
            # rank 1 raised the failure from save(); rank 0's handle failed with nobody
            # waiting, and close() raises it there (each rank is told once)
            if res["rank"] == 0:
                assert res["close"].startswith("TypeError") and "rank(s) [1]" in res["close"], res
            else:
                assert res["close"] == "ok", res
            continue
        assert res["close"] == "ok", res
        assert res["load2"].startswith(kind), res
        if mode == "state":
            assert "rank(s) [1]" in res["load2"], res
            assert res["load"] == 2 and res["value"] == 2.0, res
        else:
            assert res["load"] == 1 and res["value"] == 1.0, res  # the step before it


def _killed_mid_save_main(rank, world, rdv, root, action, out_dir):
    """Rank 1 is killed (SIGKILL) as soon as save() returns: its background write is cut
    off mid-save, and rank 0's wait() must say what that means, not gloo's bare error."""
    import signal

    join(rank, world, rdv)
    from cachemw.checkpoint import Checkpointer

    ck = Checkpointer(root, collective_timeout_s=10, chunk_bytes=64 << 10,
                      fast_root=root + "-fast" if action.endswith("True") else None)
    big = {"w": torch.full((4096, 2048), 1.0)}  # 32 MiB: the kill lands inside DCP's save
    ck.save(1, big).wait(60)
    handle = ck.save(2, big)
    if rank == 1:
        time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    res = {"rank": rank}
    started = time.monotonic()
    try:
        handle.wait(60)
        res["save2"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        res["save2"] = f"{type(exc).__name__}: {exc}"
    res["after"] = time.monotonic() - started
    report(out_dir, rank, res)
    os._exit(0)  # the group lost a rank: no orderly teardown


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fast", [False, True], ids=["root", "fast tier"])
def test_a_rank_killed_mid_save_fails_the_others_saying_what_it_means(tmp_path, fast):
    results = run_ranks(tmp_path, 2, tmp_path / "ckpt", f"killed-{fast}", target=_killed_mid_save_main)
    assert sorted(results) == [0], results  # rank 1 was killed
    res = results[0]
    assert res["save2"] != "ok", res
    assert "a collective with the other ranks failed (a rank died" in res["save2"], res
    assert res["after"] < 40, res


def _refuse_main(rank, world, rdv, root, mode, out_dir):
    """Rank 0's previous save is still writing (a handle not done), rank 1's is not;
    ``mixed``: rank 1's save asks to wait, not to refuse."""
    join(rank, world, rdv)
    from cachemw.checkpoint import Checkpointer
    from cachemw.checkpoint.handle import SaveHandle

    ck = Checkpointer(root, collective_timeout_s=10, chunk_bytes=256 << 10, if_busy="refuse")
    res = {"rank": rank}
    ck.save(1, state(1.0)).wait(60)
    writing = SaveHandle(1)
    if rank == 0:
        ck._handles.append(writing)
    try:
        handle = ck.save(2, state(2.0), if_busy="wait" if mode == "mixed" and rank == 1 else None)
        res["save2"] = "returned"
        try:
            handle.wait(60)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            res["wait2"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        res["save2"] = f"{type(exc).__name__}: {exc}"
    writing._set_durable()
    ck.save(3, state(3.0))
    ck.wait(60)  # raises nothing more: the refusal was said by save()
    res["steps"] = ck.steps()
    ck.close()
    report(out_dir, rank, res)
    dist.destroy_process_group()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["refuse", "mixed"])
def test_a_save_refused_because_one_rank_is_busy_is_refused_by_save_on_every_rank(tmp_path, mode):
    """if_busy="refuse" without a fast tier: the busy rank's save() raised, the others' returned
    a handle that failed later, and their final wait() raised it again (review ckpt7). A rank
    whose save asks to wait takes part in the vote too: ranks out of step waited for the
    collective timeout (diffrev-10)."""
    results = run_ranks(tmp_path, 2, tmp_path / "ckpt", mode, target=_refuse_main)
    assert sorted(results) == [0, 1], results
    for res in results.values():
        assert res["save2"].startswith("CheckpointBusyError") and "rank(s) [0]" in res["save2"], res
        assert res["steps"] == [1, 3], res


def _shapes_main(rank, world, rdv, root, fast, out_dir):
    """Rank 1's tensor under the shared key "x" is longer than rank 0's."""
    join(rank, world, rdv)
    from cachemw.checkpoint import Checkpointer

    ck = Checkpointer(root, collective_timeout_s=10, chunk_bytes=256 << 10,
                      fast_root=root + f"-fast{rank}" if fast == "fast" else None)
    res = {"rank": rank}
    ck.save(1, {"x": torch.ones(1000)}).wait(60)
    try:
        ck.save(2, {"x": torch.ones(1000 + 500 * rank)}).wait(60)
        res["save2"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        res["save2"] = f"{type(exc).__name__}: {exc}"
    res["steps"] = ck.steps()
    ck.close()
    report(out_dir, rank, res)
    dist.destroy_process_group()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fast", ["fast", "root-only"])
def test_a_shared_key_whose_tensor_differs_in_shape_by_rank_fails_the_save_on_every_rank(tmp_path, fast):
    """It was saved as durable with the longer rank's extra rows dropped, and could not be
    loaded back into the state it came from (review ckpt7)."""
    results = run_ranks(tmp_path, 2, tmp_path / "ckpt", fast, target=_shapes_main)
    assert sorted(results) == [0, 1], results
    for res in results.values():
        assert res["save2"].startswith("ValueError") and "'x' has another shape" in res["save2"], res
        assert res["steps"] == [1], res
