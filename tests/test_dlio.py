"""cachemw.dlio under the real DLIO (dlio_benchmark 2.0.0 from PyPI) on tiny workloads.

DLIO gets an environment of its own, as a DLIO user has: build/dlio-venv, made here on first
use (again when pyproject.toml changes) with README's commands: torch, `pip install -e
.[dlio]`, `pip install --no-deps dlio-benchmark==2.0.0` (its own requirements pull DALI for
CUDA 11). It imports tensorflow at start, which stays out of the dev venv. DLIO runs as an
MPI singleton (no mpirun), in a session of its own, so the test can see it left nothing.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from cachemw.checkpoint import Checkpointer
from conftest import daemon_stats, service_procs

REPO = Path(__file__).resolve().parent.parent
DLIO_VENV = REPO / "build" / "dlio-venv"
DLIO_PIN = "dlio-benchmark==2.0.0"
TORCH_PIN = "torch==2.13.0"  # the CPU build the Makefile installs
READER = "cachemw.dlio.reader.CachemwReader"
MECHANISM = "cachemw.dlio.checkpointing.CachemwCheckpointing"
AU_LINE = re.compile(r"\[METRIC\] Training Accelerator Utilization \[AU\] \(%\): ([0-9.]+) \(([0-9.]+)\)")

pytestmark = [pytest.mark.slow, pytest.mark.torch]


def _wanted() -> str:
    return hashlib.blake2b((REPO / "pyproject.toml").read_bytes() + DLIO_PIN.encode() + TORCH_PIN.encode(),
                           digest_size=16).hexdigest()


@pytest.fixture(scope="session")
def dlio_python() -> Path:
    """The DLIO environment's python, the environment built (once, under a lock) if missing or stale."""
    stamp = DLIO_VENV / ".installed"
    DLIO_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(DLIO_VENV.parent / ".dlio-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists() or stamp.read_text() != _wanted():
            pip = [str(DLIO_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet"]
            for step in ([sys.executable, "-m", "venv", "--clear", str(DLIO_VENV)],
                         pip + ["--upgrade", "pip", "setuptools", "wheel"],
                         pip + [TORCH_PIN],
                         pip + ["-e", f"{REPO}[dlio]"],
                         pip + ["--no-deps", DLIO_PIN]):
                run = subprocess.run(step, cwd=REPO, capture_output=True, text=True, timeout=900)
                assert run.returncode == 0, f"{' '.join(step)}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
            stamp.write_text(_wanted())
    return DLIO_VENV / "bin" / "python"


def _session_left(sid: int) -> list[str]:
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.info["pid"]) == sid:
                left.append(" ".join(p.info["cmdline"] or ()))
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


class Dlio:
    """Runs ``dlio_benchmark`` with the shipped config dir, in ``work``, as a DLIO user would."""

    def __init__(self, python: Path, work: Path, runtime_dir: str) -> None:
        self.work = work
        self.bin = python.parent / "dlio_benchmark"
        config = subprocess.run([str(python), "-m", "cachemw.dlio"], capture_output=True, text=True,
                                timeout=60, check=True)
        self.config_dir = config.stdout.strip()
        self.env = dict(os.environ, CACHEMW_RUNTIME_DIR=runtime_dir, PYTHONNOUSERSITE="1",
                        PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}")
        self.env.pop("VIRTUAL_ENV", None)
        self.runs = 0

    def __call__(self, workload: str, *overrides: str, ok: bool = True) -> subprocess.CompletedProcess:
        self.runs += 1
        out = self.work / f"out-{self.runs}"
        proc = subprocess.Popen(
            [str(self.bin), "--config-dir", self.config_dir, f"workload={workload}",
             f"++workload.output.folder={out}", *overrides],
            cwd=self.work, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        left = _session_left(proc.pid)
        assert not left, f"dlio_benchmark left processes behind: {left}"
        if ok:
            assert proc.returncode == 0, output[-6000:]
        result = subprocess.CompletedProcess(proc.args, proc.returncode, output, "")
        result.out = out
        return result


def _summary(run) -> dict:
    summary = json.loads((run.out / "summary.json").read_text())
    au = summary["metric"]["train_au_percentage"]
    mean, std = AU_LINE.search(run.stdout).groups()  # DLIO's own report, as a user reads it
    assert abs(float(mean) - summary["metric"]["train_au_mean_percentage"]) < 1e-3
    assert all(0 < a <= 100 for a in au), au
    return summary


TINY = ["++workload.dataset.num_files_train=8", "++workload.dataset.record_length=65536",
        "++workload.dataset.record_length_stdev=0", "++workload.dataset.record_length_resize=0",
        "++workload.train.epochs=2", "++workload.train.computation_time=0.05",
        "++workload.checkpoint.model_size=1048576", "++workload.checkpoint.layer_parameters=[4096]"]


@pytest.mark.timeout(1500)
def test_dlio_reads_through_cachemw_and_checkpoints_with_the_checkpointer(
        dlio_python, tmp_path, runtime_dir, spawn_daemon):
    data, ckpt_plain, ckpt = tmp_path / "data", tmp_path / "ckpt-plain", tmp_path / "ckpt"
    dlio = Dlio(dlio_python, tmp_path, runtime_dir)
    sizes = [*TINY, f"++workload.dataset.data_folder={data}"]
    # plain DLIO, the baseline: writes the dataset, then trains with its own reader and
    # torch.save mechanism, no cachemw at all
    plain = dlio("cachemw_unet3d", *sizes, f"++workload.checkpoint.checkpoint_folder={ckpt_plain}",
                 "++workload.workflow.generate_data=True",
                 "~workload.reader.reader_classname", "~workload.checkpoint.checkpoint_mechanism_classname")
    files = sorted((data / "train").iterdir())
    assert len(files) == 8
    assert len(_summary(plain)["metric"]["train_au_percentage"]) == 2
    assert "CachemwReader" not in plain.stdout and "CachemwCheckpointing" not in plain.stdout
    assert sorted(p.suffix for p in ckpt_plain.iterdir()) == [".pt"] * 4  # model + 1 layer, 2 epochs
    assert not os.path.exists(os.path.join(runtime_dir, "daemon.lock")), "plain DLIO touched cachemw"

    # the plug-ins, as shipped (2 forked DataLoader workers), the node's daemon running
    spawn_daemon(runtime_dir, dram_capacity="256MiB")
    cached = dlio("cachemw_unet3d", *sizes, f"++workload.checkpoint.checkpoint_folder={ckpt}")
    assert len(_summary(cached)["metric"]["train_au_percentage"]) == 2
    assert "Discovered custom data reader CachemwReader" in cached.stdout
    assert "custom checkpointing mechanism class CachemwCheckpointing" in cached.stdout
    stats = daemon_stats(runtime_dir)
    dram = stats["tiers"]["dram"]
    assert dram["blocks"] == 8 and dram["used_bytes"] >= sum(f.stat().st_size for f in files), stats
    # each file missed once (epoch 1) and hit once (epoch 2), as the workers reported them
    counted = {k: stats["counters"][k] for k in ("hits", "misses", "fallbacks", "bytes_from_source")}
    assert counted == {"hits": 8, "misses": 8, "fallbacks": 0,
                       "bytes_from_source": sum(f.stat().st_size for f in files)}, counted

    # committed by the Checkpointer (one per epoch, global steps 2 and 4) and loadable
    assert sorted(p.name for p in ckpt.iterdir()) == ["rank-0"]  # no torch.save files
    ck = Checkpointer(str(ckpt / "rank-0"), fast_root=None)
    try:
        assert ck.steps() == [2, 4]
        state = {"model": {"a": torch.ones(1048576, dtype=torch.int8)},
                 "layers": {"0": {"0": torch.ones(4096, dtype=torch.int8)}}}
        assert ck.load(state) == 4
    finally:
        ck.close()
    assert not state["model"]["a"].any() and not state["layers"]["0"]["0"].any()  # DLIO's zeros

    # again, every sample read in the main process (read_threads 0), whose counters reach the
    # daemon when it exits: both epochs come from the cache, nothing from the store
    before = daemon_stats(runtime_dir)["counters"]
    again = dlio("cachemw_unet3d", *sizes, f"++workload.checkpoint.checkpoint_folder={ckpt}",
                 "++workload.reader.read_threads=0")
    assert len(_summary(again)["metric"]["train_au_percentage"]) == 2
    after = daemon_stats(runtime_dir)["counters"]
    delta = {k: after[k] - before.get(k, 0) for k in ("hits", "misses", "fallbacks", "bytes_from_source")}
    assert delta == {"hits": 16, "misses": 0, "fallbacks": 0, "bytes_from_source": 0}, delta
    assert service_procs(runtime_dir) == []  # only the spawned daemon (not a service) serves it


@pytest.mark.timeout(1200)
def test_dlio_reader_reads_its_other_formats_and_names_those_it_cannot_read(
        dlio_python, tmp_path, runtime_dir, spawn_daemon):
    spawn_daemon(runtime_dir, dram_capacity="256MiB")
    dlio = Dlio(dlio_python, tmp_path, runtime_dir)
    common = [*TINY, "++workload.workflow.generate_data=True", "++workload.workflow.checkpoint=False",
              "++workload.reader.read_threads=1"]
    # hdf5 with 4 samples a file, read by range through an open file; npy and png whole
    for n, (fmt, samples) in enumerate([("hdf5", 4), ("npy", 1), ("png", 1)], start=1):
        run = dlio("cachemw_unet3d", *common, f"++workload.dataset.format={fmt}",
                   f"++workload.dataset.num_samples_per_file={samples}",
                   f"++workload.dataset.data_folder={tmp_path / fmt}")
        assert len(_summary(run)["metric"]["train_au_percentage"]) == 2
        stats = daemon_stats(runtime_dir)
        assert stats["tiers"]["dram"]["blocks"] == 8 * n, (fmt, stats)
        assert stats["counters"]["misses"] == 8 * n and stats["counters"]["fallbacks"] == 0, (fmt, stats)

    csv = dlio("cachemw_unet3d", *common, "++workload.dataset.format=csv",
               f"++workload.dataset.data_folder={tmp_path / 'csv'}", ok=False)
    assert csv.returncode != 0
    assert "reads hdf5, jpeg, npy, npz, png files, not dataset.format 'csv'" in csv.stdout, csv.stdout[-3000:]
