"""The main job end to end (``cachemw job``), tiny: every system and checkpoint method on
the emulated store, and the same job against a directory (``--source DIR``). Real
processes throughout (the store server, DataLoader workers, cachemw daemons); the job
must leave none behind."""
from __future__ import annotations

import glob
import json
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.torch

TINY = ["--set", "dataset.num_files_train=24", "--set", "reader.batch_size=4",
        "--set", "reader.read_threads=1", "--set", "train.epochs=2",
        "--set", "train.computation_time=0.005", "--set", "checkpoint.model_size=1048576",
        "--set", "checkpoint.steps_between_checkpoints=3",
        "--set", "dataset.record_length=4096", "--checkpoint-saves", "2", "--quiet"]


def _job_dirs() -> set:
    return set(glob.glob("/dev/shm/cachemw-job-*") + glob.glob("/tmp/cachemw-job-*"))


def _job(args, cwd) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "cachemw.cli", "job", *args], cwd=cwd,
                         capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def _job_processes() -> set:
    """Processes of a job: its store server (--root in its scratch dir) and its daemons
    (--runtime-dir cachemw-job-rt-*)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return {line.strip() for line in out.splitlines()
            if "cachemw-job-" in line and ("cachemw.job.store" in line or "cachemw.node.service" in line)}


@pytest.mark.timeout(180)
def test_the_job_writes_its_figures_and_says_what_it_showed(tmp_path):
    before, running = _job_dirs(), _job_processes()
    run = _job([*TINY, "--store-latency-ms", "2", "--store-meta-latency-ms", "1",
                "--io-epochs", "2", "--out", str(tmp_path / "out")], tmp_path)
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("targets met: ") and " of 7 measured" in last, last
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(res["systems"]) == ["direct", "simplecache", "cachemw", "cachemw+announce"]
    for key, system in res["systems"].items():
        assert [e["epoch"] for e in system["epochs"]] == [1, 2], key
        for e in system["epochs"]:
            assert e["samples"] == 24 and e["steps"] == 6
            assert 0 < e["au"] <= 1 and e["io_wait_s"] >= 0 and e["samples_per_s"] > 0
    # the caches' flat-out epochs: warm, no compute, numbered on from the training epochs
    for key, system in res["systems"].items():
        flat = system.get("io_epochs")
        if key not in ("simplecache", "cachemw"):
            assert flat is None, key
            continue
        assert [e["epoch"] for e in flat] == [3, 4], key
        assert all(e["store_bytes"] == 0 and e["samples"] == 24 and e["au"] < 0.5
                   for e in flat), flat
    assert "warm epochs with no compute" in run.stdout
    # run in turn, epoch by epoch (the order rotated each round), not a block per system:
    # the machine's drift over the run stays out of the caches' ratio
    turns = sorted((e["started_at"], e["epoch"], key) for key, epochs in
                   [("floor", res["floor"]["io_epochs"]),
                    *((k, res["systems"][k]["io_epochs"]) for k in ("simplecache", "cachemw"))]
                   for e in epochs)
    assert [(n, k) for _, n, k in turns] == [
        (3, "simplecache"), (3, "cachemw"), (3, "floor"),
        (4, "cachemw"), (4, "floor"), (4, "simplecache")], turns
    # the DataLoader's own floor: the same loader flat out over samples in memory
    floor = res["floor"]["io_epochs"]
    assert [e["epoch"] for e in floor] == [3, 4]
    assert all(e["samples"] == 24 and "store_bytes" not in e for e in floor), floor
    beyond = res["over_floor"]
    assert beyond["floor_us"] == pytest.approx(
        1e6 / statistics.median(e["samples_per_s"] for e in floor))
    assert beyond["cachemw_added_us"] == pytest.approx(1e6 / statistics.median(
        e["samples_per_s"] for e in res["systems"]["cachemw"]["io_epochs"]) - beyond["floor_us"])
    assert "over the DataLoader's own floor" in run.stdout
    target = next(t for t in res["targets"] if t["key"] == "vs_simplecache")
    flat_rate = [statistics.median(e["samples_per_s"] for e in res["systems"][k]["io_epochs"])
                 for k in ("cachemw", "simplecache")]
    assert target["value"] == pytest.approx(flat_rate[0] / flat_rate[1])
    # the cache reads nothing from the store once warm; direct reads all of it again
    assert res["systems"]["cachemw"]["epochs"][1]["store_bytes"] == 0
    assert res["systems"]["direct"]["epochs"][1]["store_bytes"] == 24 * 4096
    for key, system in res["systems"].items():  # where the I/O wait went: cachemw's only
        for e in system["epochs"]:
            b = e["read_time_breakdown"]
            assert (b is None) == (key in ("direct", "simplecache")), (key, b)
    warm = res["systems"]["cachemw"]["epochs"][1]["read_time_breakdown"]
    assert warm["hit_reads"] == 24 and warm["source_reads"] == 0 and warm["complete"]
    methods = res["checkpoints"]["methods"]
    assert list(methods) == ["none", "torch.save", "dcp.async_save", "Checkpointer"]
    for key in ("torch.save", "dcp.async_save", "Checkpointer"):
        saves = methods[key]["saves"]
        assert [s["step"] for s in saves] == [3, 6], key
        assert all(s["error"] is None and s["durable_s"] >= s["stall_s"] > 0 for s in saves), saves
    assert len(res["targets"]) == 7 and res["verdict"] == last
    png = (tmp_path / "out" / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "targets met" in (tmp_path / "out" / "results.txt").read_text()
    assert _job_dirs() <= before  # its store, caches and daemons' dirs are gone
    assert _job_processes() <= running  # and its store server and daemons


@pytest.mark.timeout(120)
def test_each_cachemw_epoch_says_where_its_io_wait_went(tmp_path):
    """The read-time breakdown per epoch comes from the node daemon's counters, complete
    although the DataLoader workers persist (idle between epochs with counts unreported):
    the cold epoch's reads all from the source, the warm epoch's all hits."""
    args = [*TINY, "--set", "reader.read_threads=2", "--set", "train.epochs=3",
            "--systems", "direct,cachemw", "--checkpoints", "none",
            "--store-latency-ms", "2", "--store-meta-latency-ms", "1",
            "--out", str(tmp_path / "out")]
    run = _job(args, tmp_path)
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert all(e["read_time_breakdown"] is None for e in res["systems"]["direct"]["epochs"])
    cold, *warm = [e["read_time_breakdown"] for e in res["systems"]["cachemw"]["epochs"]]
    assert cold["complete"] and cold["source_s"] > 0 and cold["source_reads"] == 24, cold
    # no reader waits on the daemon: a miss takes its claim and fetches; the fill writer
    # leases the blocks behind the reads
    assert cold["hit_reads"] == 0 and cold["lease_wait_reads"] == 0, cold
    assert cold["readers_s"] == pytest.approx(sum(cold[f"{k}_s"] for k in (
        "hit", "remote", "source", "lease_wait")))
    for b in warm:
        assert b["complete"] and b["hit_reads"] == 24 and b["hit_s"] > 0, b
        assert b["source_s"] == 0 and b["source_reads"] == 0 and b["lease_wait_reads"] == 0, b
        assert b["readers_s"] == b["hit_s"]
    table = run.stdout[run.stdout.index("where cachemw's I/O wait went"):].splitlines()
    assert "not wall time" in table[0] and "hit %" in table[1]
    rows = [line.split() for line in table[2:5]]
    assert [r[-1] for r in rows] == ["0/0/24/0", "24/0/0/0", "24/0/0/0"], table
    assert [r[-5] for r in rows[1:]] == ["100.0", "100.0"], table  # hit %


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_job_against_a_directory(tmp_path):
    source = tmp_path / "pfs"
    source.mkdir()
    args = [*TINY, "--source", str(source), "--systems", "direct,cachemw",
            "--checkpoints", "torch.save,Checkpointer", "--out", str(tmp_path / "out")]
    first = _job(args, tmp_path)
    train = source / "cachemw-job" / "image_classification" / "train"
    assert len(list(train.iterdir())) == 24 and "wrote 24 dataset files" in first.stderr
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["job"]["store"] == str(source) and set(res["systems"]) == {"direct", "cachemw"}
    assert all(s["error"] is None for s in res["checkpoints"]["methods"]["Checkpointer"]["saves"])
    # each run checkpoints in a directory of its own, removed after the run
    assert res["checkpoints"]["root"].startswith(str(source / "cachemw-job" / "checkpoints" / "run-"))
    assert list((source / "cachemw-job" / "checkpoints").iterdir()) == []
    second = _job(args, tmp_path)  # the dataset is found complete and read again
    assert "wrote" not in second.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_job_against_an_object_store_url(tmp_path, s3_server):
    """``--source s3://...`` (moto): the dataset written there through s3fs, read directly
    and through cachemw::s3, checkpoints written there by each method and removed after."""
    url = f"s3://{s3_server['bucket']}/jobrun"
    run = _job([*TINY, "--source", url, "--source-options", json.dumps(s3_server["target_options"]),
                "--systems", "direct,cachemw", "--out", str(tmp_path / "out")], tmp_path)
    assert "wrote 24 dataset files" in run.stderr
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [len(s["epochs"]) for s in res["systems"].values()] == [2, 2]
    for key in ("torch.save", "dcp.async_save", "Checkpointer"):
        saves = res["checkpoints"]["methods"][key]["saves"]
        assert len(saves) == 2 and all(s["error"] is None for s in saves), (key, saves)
    keys = [o["Key"] for o in s3_server["boto3"]().list_objects_v2(
        Bucket=s3_server["bucket"], Prefix="jobrun/").get("Contents", [])]
    assert len([k for k in keys if "/train/" in k]) == 24
    assert not [k for k in keys if "/checkpoints/" in k]
    # an option s3fs does not take: one line, exit 2 (it was a TypeError's traceback)
    bad = subprocess.run([sys.executable, "-m", "cachemw.cli", "job", *TINY, "--source", url,
                          "--source-options", json.dumps({**s3_server["target_options"], "bogus_opt": 1}),
                          "--systems", "direct", "--out", str(tmp_path / "bad")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert bad.stderr.strip().splitlines()[-1].startswith(
        f"cachemw job: --source-options: {url}'s filesystem refused them:"), bad.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigterm-group"])
def test_an_interrupted_job_says_so_and_leaves_nothing(tmp_path, how):
    """Ctrl-C reached the store first, so the job failed with a DataLoader worker's
    FileNotFoundError as if the dataset were missing; a SIGTERM left the store's data in
    /dev/shm; a second Ctrl-C cut the cleanup short; a SIGTERM to the whole process group
    (timeout, Slurm, systemd) was said as "DataLoader worker ... killed", exit 2, and left
    the store's data or a daemon's runtime dir in /dev/shm (found by black-box checks).
    Ctrl-C is now an "interrupted", exit 130, SIGTERM a "terminated", exit 143, each with
    everything removed, multiprocessing's temp dirs (pymp-*) included: a SIGTERM to the
    group left one per DataLoader worker in $TMPDIR (review readme4)."""
    import os
    import signal
    import threading
    import time

    before, running = _job_dirs(), _job_processes()
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    job = subprocess.Popen([sys.executable, "-m", "cachemw.cli", "job", *TINY, "--set",
                            "train.epochs=500", "--store-latency-ms", "20", "--checkpoints", "none",
                            "--io-epochs", "0", "--out", str(tmp_path / "out")],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, env={**os.environ, "TMPDIR": str(tmp)})
    said, reading = [], threading.Event()

    def read_stderr():  # the epochs' lines: signal once the first system is reading
        for line in job.stderr:
            said.append(line)
            if "epoch 2:" in line:
                reading.set()
        reading.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert reading.wait(120) and job.poll() is None, "".join(said)[-3000:]
        if how == "ctrl-c":  # the terminal signals the whole foreground group; twice: a
            os.killpg(job.pid, signal.SIGINT)  # second one cut the cleanup short
            time.sleep(0.3)
            os.killpg(job.pid, signal.SIGINT)
        elif how == "sigterm-group":  # its DataLoader workers and daemon too, at once
            os.killpg(job.pid, signal.SIGTERM)
        else:
            job.terminate()
        job.wait(120)
        reader.join(30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.stdout.close()
    err = "".join(said)
    code, last = ((130, "cachemw job: interrupted") if how == "ctrl-c" else
                  (143, "cachemw job: terminated (SIGTERM); everything it started is stopped "
                        "and removed"))
    assert job.returncode == code, err[-3000:]
    assert err.strip().splitlines()[-1] == last, err[-3000:]
    assert "Error" not in err and "Traceback" not in err, err[-3000:]
    time.sleep(1)
    assert _job_dirs() == before and _job_processes() == running
    assert not list(tmp.glob("pymp-*")), sorted(tmp.iterdir())


@pytest.mark.timeout(120)
def test_an_out_dir_that_cannot_take_the_results_fails_before_the_run(tmp_path):
    """It was found at the end, after the whole run, with no table printed (found by a
    black-box check)."""
    out = tmp_path / "out"
    (out / "results.json").mkdir(parents=True)  # results.json cannot be written there
    run = subprocess.run([sys.executable, "-m", "cachemw.cli", "job", *TINY, "--systems",
                          "direct", "--checkpoints", "none", "--io-epochs", "0", "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].startswith(
        f"cachemw job: --out {out}: the results cannot be written there"), run.stderr[-2000:]
    assert "epoch 1:" not in run.stderr  # nothing ran


def test_scratch_dirs_of_jobs_killed_outright_are_removed_by_the_next(tmp_path, monkeypatch):
    """A SIGKILLed job leaves its dataset copy (112 MiB by default) in /dev/shm; the next
    job removes the scratch dirs whose job is gone, and only those."""
    import os
    import socket
    import subprocess

    from cachemw.job import systems

    monkeypatch.setattr(systems, "_scratch_base", lambda: str(tmp_path))
    monkeypatch.setattr(systems.tempfile, "gettempdir", lambda: str(tmp_path))
    mine = systems.scratch_dir("cachemw-job-")  # this process: alive
    gone = systems.scratch_dir("cachemw-job-rt-")
    dead = subprocess.Popen(["true"])
    dead.wait()
    with open(os.path.join(gone, systems.OWNER), "w") as f:
        f.write(f"{dead.pid} 1 {socket.gethostname()}")  # a pid that ended
    unmarked = tmp_path / "cachemw-job-unmarked"
    unmarked.mkdir()
    elsewhere = tmp_path / "cachemw-job-elsewhere"  # another node's, in a shared /tmp
    elsewhere.mkdir()
    (elsewhere / systems.OWNER).write_text(f"{dead.pid} 1 another-node")
    assert systems.sweep_scratch() == [gone]
    assert os.path.isdir(mine) and unmarked.is_dir() and elsewhere.is_dir()
    assert not os.path.exists(gone)
