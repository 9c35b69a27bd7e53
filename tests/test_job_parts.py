"""Pieces of the main job that need no run of it (cachemw/job/): its checkpoint methods
when a save fails, each run's own checkpoint directory on a shared store, the arguments
``cachemw job`` refuses, the output directory checked before the run, and the loader
reading no further than an epoch trains."""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from cachemw.job import arguments, owners, results  # noqa: E402
from cachemw.job import checkpoints as ck  # noqa: E402
from cachemw.job import run as job_run  # noqa: E402
from cachemw.job import source as sources  # noqa: E402
from cachemw.job.command import add_arguments  # noqa: E402
from cachemw.job.training import (Compute, MemorySamples, SampleDataset, base_sampler,  # noqa: E402
                                  make_loader, train_epoch)
from cachemw.job.workload import from_mapping  # noqa: E402


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key", ["dcp.async_save", "torch.save", "Checkpointer"])
def test_a_failed_save_is_recorded_and_the_training_goes_on(tmp_path, key):
    """A failed dcp.async_save was raised again by the next save (the job crashed with a
    traceback, no results written), or, the last save, recorded with no error (DCP's
    CheckpointException is a BaseException) (found by a black-box check)."""
    method = ck.build(key, str(tmp_path))
    for name in ("torch-save", "dcp", "checkpointer"):  # each method's directory a file:
        shutil.rmtree(tmp_path / name, ignore_errors=True)  # no save can be written
        (tmp_path / name).write_bytes(b"")
    state = ck.model_state(1 << 16)
    try:
        method.prepare(state)
        for step in (2, 4, 6):
            method.save(step, state)  # must not raise
        method.finish()
    finally:
        method.close()
    assert [r["step"] for r in method.records] == [2, 4, 6]
    for record in method.records:
        assert record["error"] and record["durable_s"] is None, record
        assert "\n" not in record["error"] and "Error" in record["error"], record
        assert record["stall_s"] is not None


def test_each_run_checkpoints_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """Two jobs on one --source wrote and removed the same checkpoint paths (found by a
    black-box check): each run has its own directory, marked with its job; a later job
    removes this host's dead jobs' directories only."""
    src = sources.local_source(str(tmp_path), from_mapping({}))
    first, second = sources.with_run_dir(src), sources.with_run_dir(src)
    root = tmp_path / "cachemw-job" / "checkpoints"
    assert first.checkpoint_root != second.checkpoint_root
    assert {os.path.dirname(first.checkpoint_root), os.path.dirname(second.checkpoint_root)} == {str(root)}
    assert (root / os.path.basename(first.checkpoint_root) / owners.OWNER).read_text() == owners.mark()
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = root / "run-gone"
    gone.mkdir()
    (gone / owners.OWNER).write_text(f"{dead.pid} 1 {socket.gethostname()}")
    (gone / "step_1.pt").write_bytes(b"x")
    elsewhere = root / "run-elsewhere"  # another node's job, on a shared store
    elsewhere.mkdir()
    (elsewhere / owners.OWNER).write_text(f"{dead.pid} 1 another-node")
    unmarked = root / "run-being-made"
    unmarked.mkdir()
    assert [os.path.basename(p) for p in sources.sweep_runs(src)] == ["run-gone"]
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [os.path.basename(first.checkpoint_root), os.path.basename(second.checkpoint_root),
         "run-elsewhere", "run-being-made"])


def test_arguments_the_job_refuses(tmp_path):
    """--source-options without --source was ignored silently; --checkpoints none,x and
    "" said nothing clear (found by a black-box check)."""
    with pytest.raises(ValueError, match=r"^--source-options: only with --source"):
        arguments.settings_from(_args("--source-options", '{"anon": true}', "--checkpoints", "none"))
    with pytest.raises(ValueError, match=r"none \(no checkpoints\) cannot be combined"):
        arguments.settings_from(_args("--checkpoints", "none,torch.save"))
    with pytest.raises(ValueError, match=r"^--checkpoints: expected a comma-separated list"):
        arguments.settings_from(_args("--checkpoints", ""))
    assert arguments.settings_from(_args("--checkpoints", "none")).methods == ()
    assert arguments.settings_from(_args("--checkpoints", " Checkpointer ,torch.save")).methods == (
        "Checkpointer", "torch.save")
    with pytest.raises(ValueError, match=r"^--source-options: a directory"):
        job_run._prepare(arguments.settings_from(_args(
            "--source", str(tmp_path), "--source-options", '{"anon": true}')), str(tmp_path), None)
    # a missing directory, as a path or as a file:// URL: refused alike (the URL made it and
    # wrote a dataset there, review nodes6)
    missing = tmp_path / "no" / "such"
    for given in (str(missing), f"file://{missing}"):
        with pytest.raises(ValueError, match=rf"^--source {given}: not a directory"):
            job_run._prepare(arguments.settings_from(_args("--source", given)), str(tmp_path), None)
    assert not (tmp_path / "no").exists()


@pytest.mark.timeout(60)
def test_an_option_the_stores_filesystem_refuses_is_said_in_one_line(tmp_path):
    """s3fs raised a TypeError (a traceback) at its first request for an option it does
    not take (found by a black-box check); fsspec's HTTP filesystem does the same, before
    connecting anywhere."""
    settings = arguments.settings_from(_args(
        "--source", "http://127.0.0.1:9/data", "--source-options", '{"bogus_opt": 1}'))
    with pytest.raises(ValueError, match=r"^--source-options: http://127\.0\.0\.1:9/data's "
                                         r"filesystem refused them: .*bogus_opt"):
        job_run._prepare(settings, str(tmp_path), None)


def test_an_out_dir_that_cannot_take_the_results_is_said_before_the_run(tmp_path):
    """It was found only after the whole run, when results.json could not be written, and
    the tables were never printed (found by a black-box check)."""
    results.check_writable(str(tmp_path))  # a writable one: nothing left behind
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "results.json").mkdir()  # a results file that cannot be written
    with pytest.raises(ValueError, match=r"^--out .*: the results cannot be written there"):
        results.check_writable(str(tmp_path))
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() != 0:
        locked.chmod(0o500)
    elif subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
        return  # root, and no immutable flag here: nothing to lock the directory with
    try:
        with pytest.raises(ValueError, match="the results cannot be written there"):
            results.check_writable(str(locked))
    finally:
        if os.geteuid() != 0:
            locked.chmod(0o700)
        else:
            subprocess.run(["chattr", "-i", str(locked)], check=True)


def test_results_that_cannot_be_written_at_the_end_are_printed_all_the_same(monkeypatch, capsys):
    figures = {"systems": {}, "checkpoints": None, "targets": results.targets({"systems": {}}),
               "verdict": "no target could be measured in this run"}

    def fails(settings, argv=None):
        raise results.ResultsNotWritten("could not write the results to X: disk full", figures)

    monkeypatch.setattr(job_run, "run", fails)
    with pytest.raises(OSError, match="could not write the results to X"):
        job_run.main(_args("--checkpoints", "none", "--quiet"))
    out = capsys.readouterr().out
    assert "targets (this run):" in out
    assert out.strip().splitlines()[-1] == "no target could be measured in this run"


@pytest.mark.timeout(120)
def test_an_epoch_stopped_early_reads_no_further_than_it_trains(tmp_path):
    """train.total_training_steps ended the run after that many steps: later epochs were
    recorded with no step, yet charged with the reads the loader had run ahead to (found
    by a black-box check). DLIO 2.0.0 stops each epoch there; the loader's workers are
    handed that epoch's batches only."""
    reads = tmp_path / "reads"

    class Counted(MemorySamples):
        def cat_file(self, path, start=None, end=None):
            with open(reads, "a") as f:  # (O_APPEND: one line per read, from any worker)
                f.write(f"{path}\n")
            return super().cat_file(path, start, end)

    wl = from_mapping({"dataset": {"num_files_train": 32}, "reader": {
        "batch_size": 2, "read_threads": 2, "prefetch_size": 8},
        "train": {"total_training_steps": 3, "epochs": 2}})
    entries = [(str(i), None, None) for i in range(32)]
    dataset = SampleDataset(Counted({e: b"x" * 64 for e in entries}), entries)
    loader = make_loader(dataset, wl, base_sampler(wl, len(entries)))
    step, counted = 0, []
    for epoch in (1, 2):
        timeline, step = train_epoch(loader, wl, epoch, step, Compute(wl))
        assert len(timeline.steps) == 3
        counted.append(len(reads.read_text().splitlines()))
    del loader  # its workers end
    assert step == 6 and counted == [6, 12]  # 3 batches of 2 an epoch, not one more
