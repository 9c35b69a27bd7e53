"""Several real processes (gloo on CPU, torch.multiprocessing spawn): spreading, resharding,
failures on one rank, a rank killed mid-save. Every test has a timeout and kills what it spawned.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import time

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def replicated_state(fill: float | None = None):
    g = torch.Generator().manual_seed(42)
    state = {"w": torch.randn(2048, 256, generator=g), "b": torch.randn(4096, generator=g),
             "meta": {"epoch": 9}}
    if fill is not None:
        state = {"w": torch.full((2048, 256), fill), "b": torch.full((4096,), fill), "meta": {"epoch": -1}}
    return state


def _rank_main(rank, world, rdv, root, action, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from cachemw.checkpoint import Checkpointer

    result = {"rank": rank}
    fast_root = root + "-fast" if action in ("fast", "second-fast") or (action == "fast-on-rank0" and rank == 0) else None
    ck = Checkpointer(root, collective_timeout_s=8, chunk_bytes=256 << 10, fast_root=fast_root)
    result["fast"] = ck.fast is not None
    if action.startswith("fast"):  # two saves through a shared node-local fast tier, then a load
        ck.save(1, replicated_state(fill=1.0)).wait(60)
        handle = ck.save(7, replicated_state())
        handle.wait(60)
        result["path"] = handle.path
        pool = ck.fast_saver.pool if ck.fast_saver else None
        result["pool_bytes"] = sum(os.path.getsize(os.path.join(pool.dir, f)) for f in os.listdir(pool.dir)) if pool else 0
        state = replicated_state(fill=0.0)
        result["step"] = ck.load(state)
        expected = replicated_state()
        result["ok"] = bool(torch.equal(state["w"], expected["w"]) and torch.equal(state["b"], expected["b"])
                            and state["meta"] == expected["meta"])
    elif action == "second-fast":  # a second Checkpointer of the same ranks (another fit())
        ck.save(1, replicated_state()).wait(60)
        ck.close()
        ck = Checkpointer(root, collective_timeout_s=8, chunk_bytes=256 << 10, fast_root=fast_root)
        for step in (2, 3):
            ck.save(step, replicated_state()).wait(60)
        result["fast_steps"] = sorted(p for p in os.listdir(fast_root)
                                      if os.path.exists(os.path.join(fast_root, p, "cachemw-manifest.json")))
    elif action == "save":
        handle = ck.save(7, replicated_state())
        handle.wait(60)
        result["path"] = handle.path
    elif action == "load":
        state = replicated_state(fill=0.0)
        result["step"] = ck.load(state)
        expected = replicated_state()
        result["ok"] = bool(torch.equal(state["w"], expected["w"]) and torch.equal(state["b"], expected["b"])
                            and state["meta"] == expected["meta"])
    elif action in ("fail", "kill"):
        import cachemw.checkpoint.writer as writer_mod

        original = writer_mod.write_chunk
        ck.save(1, replicated_state()).wait(60)
        if rank == 1:
            def broken(*args, **kwargs):
                if action == "kill":
                    open(os.path.join(out_dir, "writing"), "w").close()
                    time.sleep(120)
                raise OSError(28, "No space left on device (injected)")

            writer_mod.write_chunk = broken
        handle = ck.save(2, replicated_state())
        try:
            handle.wait(60)
            result["error"] = None
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["steps"] = ck.steps()
        writer_mod.write_chunk = original
        if action == "fail":
            ck.save(3, replicated_state()).wait(60)  # training and checkpointing go on
            result["steps_after"] = ck.steps()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if action == "kill":
        os._exit(0)  # the gloo group lost a member; do not wait on it at exit
    ck.close()
    dist.destroy_process_group()


def run_ranks(tmp_path, world, root, action, timeout=90, kill_rank_on_marker=None, target=None):
    """Run ``target`` (default ``_rank_main``) on ``world`` ranks; their results by rank."""
    out_dir = tmp_path / f"out-{action}-{world}"
    out_dir.mkdir()
    rdv = tmp_path / f"rdv-{action}-{world}"
    ctx = mp.start_processes(target or _rank_main, args=(world, str(rdv), str(root), action, str(out_dir)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if kill_rank_on_marker is not None and (out_dir / "writing").exists():
                os.kill(ctx.processes[kill_rank_on_marker].pid, signal.SIGKILL)
                kill_rank_on_marker = None
            if all(not p.is_alive() for p in ctx.processes):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"{action} with {world} ranks did not finish in {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    return {int(f.stem[4:]): json.loads(f.read_text()) for f in out_dir.glob("rank*.json")}


@pytest.mark.timeout(240)
def test_save_on_two_ranks_spreads_bytes_and_reshards_to_one_and_three(tmp_path):
    root = tmp_path / "ckpt"
    saved = run_ranks(tmp_path, 2, root, "save")
    assert len(saved) == 2 and saved[0]["path"] == saved[1]["path"]
    manifest = json.loads((root / os.path.basename(saved[0]["path"]) / "cachemw-manifest.json").read_text())
    per_rank = [0, 0]
    for item in manifest["items"].values():
        per_rank[int(item["relative_path"].split("_")[2])] += item["data_nbytes"]
    total = sum(per_rank)
    assert total == (2048 * 256 + 4096) * 4
    assert max(per_rank) <= 1.05 * total / 2, per_rank
    for world in (1, 3):
        loaded = run_ranks(tmp_path, world, root, "load")
        assert len(loaded) == world
        assert all(r["step"] == 7 and r["ok"] for r in loaded.values()), loaded


@pytest.mark.timeout(180)
def test_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    root = tmp_path / "ckpt"
    results = run_ranks(tmp_path, 2, root, "fail")
    assert len(results) == 2
    errors = [results[r]["error"] for r in (0, 1)]
    assert all(e and "No space left on device" in e for e in errors), errors
    assert errors[0] == errors[1]  # one exception, the same on every rank
    assert results[0]["steps"] == [1] and results[0]["steps_after"] == [1, 3]
    assert sorted(p.name[:17] for p in root.iterdir() if p.name.startswith("step_")) == [
        "step_000000000001", "step_000000000003"]


@pytest.mark.timeout(180)
def test_rank_killed_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    root = tmp_path / "ckpt"
    results = run_ranks(tmp_path, 2, root, "kill", kill_rank_on_marker=1)
    assert 1 not in results  # killed before it could report
    assert results[0]["error"] is not None and results[0]["steps"] == [1]
    from cachemw.checkpoint import Checkpointer

    with Checkpointer(str(root)) as ck:  # a restart: sweeps what the dead save left
        assert ck.steps() == [1]
        assert [p.name[:17] for p in root.iterdir() if p.name.startswith("step_")] == ["step_000000000001"]
        state = replicated_state(fill=0.0)
        assert ck.load(state) == 1
        assert torch.equal(state["w"], replicated_state()["w"])


def _killed_saver(root, marker):
    from cachemw.checkpoint import Checkpointer
    import cachemw.checkpoint.writer as writer_mod

    ck = Checkpointer(root)
    ck.save(1, replicated_state()).wait(60)
    original = writer_mod.write_chunk

    def slow(*args, **kwargs):
        stored = original(*args, **kwargs)
        open(marker, "w").close()
        time.sleep(120)
        return stored

    writer_mod.write_chunk = slow
    ck.save(2, replicated_state()).wait(300)


def kill_when_marked(target, args, marker, timeout=60):
    """Run ``target(*args)`` in a spawned process and SIGKILL it once ``marker`` exists."""
    proc = mp.get_context("spawn").Process(target=target, args=args)
    proc.start()
    try:
        deadline = time.monotonic() + timeout
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


@pytest.mark.timeout(120)
def test_single_process_sigkill_mid_save_partial_is_invisible_and_swept(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "marker"
    kill_when_marked(_killed_saver, (str(root), str(marker)), marker)
    dirs = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert len(dirs) == 2  # the partial one is there, but not committed
    from cachemw.checkpoint import Checkpointer

    with Checkpointer(str(root)) as ck:
        assert ck.steps() == [1]
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == dirs[:1]
        state = replicated_state(fill=0.0)
        assert ck.load(state) == 1 and state["meta"] == {"epoch": 9}


@pytest.mark.timeout(180)
def test_two_ranks_snapshot_their_own_share_into_a_shared_fast_tier(tmp_path):
    root = tmp_path / "ckpt"
    results = run_ranks(tmp_path, 2, root, "fast")
    assert len(results) == 2 and results[0]["path"] == results[1]["path"]
    assert all(r["step"] == 7 and r["ok"] for r in results.values()), results
    total = (2048 * 256 + 4096) * 4
    for r in results.values():  # each rank holds (and copied) about half the state, not all of it
        assert 0.45 * total <= r["pool_bytes"] <= 0.55 * total + (64 << 10), results
    fast = tmp_path / "ckpt-fast"
    assert len([p for p in fast.iterdir() if (p / "cachemw-manifest.json").exists()]) == 1
    plain = replicated_state(fill=0.0)
    import torch.distributed.checkpoint as dcp

    dcp.load(plain, checkpoint_id=results[0]["path"], no_dist=True)  # DCP's own reader, at the root
    expected = replicated_state()
    assert torch.equal(plain["w"], expected["w"]) and torch.equal(plain["b"], expected["b"])


@pytest.mark.timeout(180)
def test_copies_an_earlier_checkpointer_of_the_same_ranks_left_in_a_shared_fast_tier_are_retired(tmp_path):
    """A copy written by another live process is another saver's, left to it (review
    ckpt6); but one written by a rank of this saver, through an earlier Checkpointer of the
    same processes, is ours: kept, the fast tier would grow by one per Checkpointer made."""
    results = run_ranks(tmp_path, 2, tmp_path / "ckpt", "second-fast")
    assert len(results) == 2
    for r in results.values():
        assert [name.split("-")[0] for name in r["fast_steps"]] == ["step_000000000003"], results


@pytest.mark.timeout(180)
def test_a_fast_tier_on_some_ranks_only_is_disabled_on_all(tmp_path):
    results = run_ranks(tmp_path, 2, tmp_path / "ckpt", "fast-on-rank0")
    assert len(results) == 2 and not results[0]["fast"] and not results[1]["fast"]  # same collectives everywhere
    assert all(r["step"] == 7 and r["ok"] for r in results.values()), results
