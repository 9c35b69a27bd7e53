"""The job: the same DLIO-style training through each read path, then the checkpoint
methods side by side, on the emulated store (or a real one), measured in one run.

Order: the dataset is generated (or found) on the store; each system in turn lists it,
trains ``train.epochs`` epochs and is stopped (its daemon and scratch removed), except the
two caches, whose warm loaders, once both have trained, run their flat-out epochs (no
compute) in turn with the DataLoader's floor, epoch by epoch (the systems after them then
train alone), and the checkpoint phase's reader (cachemw, warm),
which then trains, without checkpoints and then with each checkpoint method, as many
steps as exactly ``checkpoint_saves`` saves take on the workload's schedule (whole epochs,
the last one stopped at its last save): every method runs under the same reads, against a
like baseline. Everything the run started is stopped and removed at the end, also on an
error, a Ctrl-C or a SIGTERM (to the job or to its whole process group, as ``timeout``,
Slurm and systemd send it); the results stay in ``out_dir``, checked writable first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing.util
import os
import shutil
import signal
import sys
import time
import warnings

import fsspec
import psutil
from fsspec.implementations.local import LocalFileSystem
from tqdm import tqdm

from ..checkpoint import quiet
from . import checkpoints as ck
from . import iowait
from . import results as report
from . import source as sources
from . import storefs
from .arguments import settings_from
from .settings import CACHES, JobSettings
from .store import EmulatedStore
from .systems import build, scratch_dir, sweep_scratch
from .training import (Compute, MemorySamples, SampleDataset, base_sampler, make_loader,
                       train_epoch)
from .workload import Workload

COUNTERS = ("hits", "misses", "prefetched", "bytes_from_source", "fallbacks", "bypassed")


def _say(bar, text: str) -> None:
    bar.write(text, file=sys.stderr) if not bar.disable else print(text, file=sys.stderr, flush=True)


def _prepare(settings: JobSettings, work: str, bar):
    """(Source, the emulated store or None): the dataset generated where it is missing."""
    wl = settings.workload
    if settings.source is None:
        root = os.path.join(work, "store")
        sources.generate(LocalFileSystem(), os.path.join(root, wl.name, "train"), wl)
        store = EmulatedStore(root, settings.profile).start()
        return sources.emulated_source(store.url, wl, storefs.PROTOCOL), store
    if "://" not in settings.source and "::" not in settings.source:
        if not os.path.isdir(settings.source):
            raise ValueError(f"--source {settings.source}: not a directory (nor an fsspec URL)")
        if settings.source_options:
            raise ValueError(f"--source-options: a directory (--source {settings.source}) "
                             "takes none; they are the options of a URL's filesystem")
        src = sources.local_source(settings.source, wl)
    else:
        with _options_checked(settings):
            src = sources.url_source(settings.source, settings.source_options, wl)
    with _options_checked(settings):  # the store's first request: where its client is made
        if src.protocol in ("http", "https"):  # read-only: the dataset must be there already
            src.fs().ls(src.train_dir, detail=False)
            written = 0
        else:
            written = sources.generate(src.fs(), src.train_dir, wl)
    if settings.source_options:
        # the store's options as fsspec's defaults for its protocol, in this process and
        # its workers: checkpoint methods open their root by URL alone (the Checkpointer,
        # DCP), as a user's job would with a configured fsspec
        fsspec.config.conf[src.protocol] = {**fsspec.config.conf.get(src.protocol, {}),
                                            **settings.source_options}
    if written:
        _say(bar, f"wrote {written} dataset files to {src.train_dir}")
    return src, None


@contextlib.contextmanager
def _options_checked(settings: JobSettings):
    """An option the store's filesystem does not take (a TypeError from its client,
    s3fs's at the first request) said as --source-options's, in one line."""
    try:
        yield
    except TypeError as exc:
        if not settings.source_options:
            raise
        raise ValueError(f"--source-options: {settings.source}'s filesystem refused them: "
                         f"{exc}") from None


def _store_counts(store) -> dict | None:
    return None if store is None else store.stats()


def _delta(after: dict | None, before: dict | None, keys) -> dict | None:
    if after is None or before is None:
        return None
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def _epoch_record(epoch, wl: Workload, store_before, store_after, counters_before, counters_after,
                  complete: bool) -> dict:
    out = epoch.summary(wl.exclude_start_steps, wl.exclude_end_steps)
    if store_before is not None:
        out["store_bytes"] = store_after["bytes_sent"] - store_before["bytes_sent"]
        out["store_requests"] = _delta(store_after["requests"], store_before["requests"],
                                       store_after["requests"])
    out["daemon"] = _delta(counters_after, counters_before, COUNTERS)
    # where cachemw's readers spent their time (None for the other systems)
    out["read_time_breakdown"] = iowait.breakdown(counters_before, counters_after, complete)
    return out


def _train(system, loader, wl: Workload, store, bar, plan: list[int], label, checkpoint=None,
           compute=None, first: int = 1) -> list:
    """Epochs ``first``, ``first + 1``, ... of ``plan[i]`` steps each."""
    compute = Compute(wl) if compute is None else compute
    step, out = 0, []
    for e, steps in enumerate(plan, start=first):
        bar.set_description(f"{label} epoch {e}/{first + len(plan) - 1}")
        s0, c0 = _store_counts(store), system.daemon_counters() if system else None
        started = time.time()
        epoch, step = train_epoch(loader, wl, e, step, compute, checkpoint, on_step=bar.update,
                                  steps=steps)
        flusher = loader.dataset.flusher  # the workers' last counts, before the snapshot
        complete = flusher.flush() if flusher is not None else True
        s1, c1 = _store_counts(store), system.daemon_counters() if system else None
        rec = _epoch_record(epoch, wl, s0, s1, c0, c1, complete)
        rec["started_at"] = started  # (Unix time: epochs of the systems in one timeline)
        out.append(rec)
        _say(bar, f"{label:<34} epoch {e}: {rec['wall_s']:6.2f} s, "
                  f"{rec['samples_per_s']:7.0f} samples/s, AU {_percent(rec['au'])} %, "
                  f"I/O wait {rec['io_wait_s']:5.2f} s")
    return out


def _percent(fraction: float) -> str:
    """AU as a percentage; '-' where it is undefined (an epoch of one step: the first step
    is left out, as DLIO leaves it out)."""
    return "    -" if fraction != fraction else f"{100 * fraction:5.1f}"


def _run_system(system, src, wl: Workload, store, bar) -> tuple[dict, object]:
    t0 = time.perf_counter()
    system.start()
    started = time.perf_counter()
    names = system.list_dataset(src.train_dir)
    listed = time.perf_counter()
    entries = sources.entries(names, wl)
    dataset = SampleDataset(system.opener, entries)
    if system.cachemw and wl.read_threads > 0:
        dataset.flusher = iowait.WorkerFlush(wl.multiprocessing_context, wl.read_threads)
    loader = make_loader(dataset, wl, system.sampler(base_sampler(wl, len(entries)), entries))
    epochs = _train(system, loader, wl, store, bar, [wl.epoch_steps] * wl.epochs, system.label)
    out = {"label": system.label, "start_s": started - t0, "listing_s": listed - started,
           "epochs": epochs}
    return out, loader


def _floor_loader(loader, wl: Workload, bar):
    """The same DataLoader over the samples already in memory (read once through the warm
    cache), its workers started: what the loader costs with no reader at all, which bounds
    the caches' flat-out epochs. Informative only: None, said, where the samples would not
    fit in a quarter of the free memory (a copy per worker counted: spawn pickles one, and
    under fork reading them touches their pages), or if it fails."""
    dataset = loader.dataset
    size = wl.dataset_bytes
    if size * (1 + wl.read_threads) > psutil.virtual_memory().available // 4:
        _say(bar, f"note: {size / 2**20:.0f} MiB of samples per process would not fit in "
                  "memory here: no DataLoader floor measured")
        return None
    try:
        samples = {entry: dataset[i] for i, entry in enumerate(dataset.entries)}
        floor = make_loader(SampleDataset(MemorySamples(samples), dataset.entries), wl,
                            base_sampler(wl, len(dataset.entries)))
        for _ in floor:  # untimed: its workers start, as the caches' had before their epochs
            pass
        return floor
    except Exception as exc:  # the floor only informs: the job's own figures stand
        _say(bar, f"warning: the DataLoader floor could not be measured: {exc}")
        return None


def _run_flat_out(warm: dict, wl: Workload, store, bar, io_epochs: int) -> dict:
    """The caches' warm loaders (``warm``: system key -> (System, loader)) and the
    DataLoader's floor flat out (no compute: the readers alone set the pace), epoch by
    epoch in turn, the order rotated each round: this machine's load drifts over a run, and
    blocks of epochs run one system after another would put that drift into the ratio of
    the caches. Returns key -> epochs, "floor" included (absent if it was not measured)."""
    runs = dict(warm)  # the floor's workers end with its loader, when this returns
    if "cachemw" in warm:
        floor = _floor_loader(warm["cachemw"][1], wl, bar)
        if floor is not None:
            runs["floor"] = (None, floor)
    out: dict = {key: [] for key in runs}
    keys = list(runs)
    for e in range(io_epochs):
        for key in keys[e % len(keys):] + keys[:e % len(keys)]:
            system, loader = runs[key]
            label = system.label if system else "DataLoader floor"
            try:
                out[key] += _train(system, loader, wl, store if system else None, bar,
                                   [wl.epoch_steps],
                                   f"{label} (no compute)", compute=Compute(wl, flat_out=True),
                                   first=wl.epochs + 1 + e)
            except Exception as exc:
                if key != "floor":
                    raise
                _say(bar, f"warning: the DataLoader floor could not be measured: {exc}")
                keys.remove(key)
                out.pop(key)
    return out


def _stop_all(systems: dict) -> None:
    """Stop every (System, loader) of ``systems`` and empty it: the loaders first (their
    workers end with them), then each system, a failure of one not keeping the others
    running (said, the job's own outcome stands)."""
    stopping = [system for system, _ in systems.values()]
    systems.clear()
    for system in stopping:
        try:
            system.stop()
        except Exception as exc:
            print(f"warning: could not stop {system.label}: {exc}", file=sys.stderr)


def _run_checkpoints(settings, system, loader, src, store, bar) -> dict:
    wl = settings.workload
    state = ck.model_state(wl.model_size_bytes, wl.seed)
    methods = {}
    plan = wl.steps_for_saves(settings.checkpoint_saves)  # "none" too: a like baseline
    for key in ("none", *settings.methods):
        method = None if key == "none" else ck.build(key, src.checkpoint_root, system.runtime_dir)

        def save(step: int, method=method) -> None:
            ck.touch(state, step)
            if method is not None:
                method.save(step, state)

        try:
            if method is not None:
                method.prepare(state)
            epochs = _train(system, loader, wl, store, bar, plan,
                            f"{system.label} + {key}", checkpoint=save)
            waited = method.finish() if method is not None else 0.0
        finally:
            if method is not None:
                method.close()
        methods[key] = {"epochs": epochs, "saves": [] if method is None else method.records,
                        "finish_wait_s": waited}
    schedule = (f"every {wl.steps_between_checkpoints} steps" if wl.steps_between_checkpoints > 0
                else f"every {wl.epochs_between_checkpoints} epoch(s) from epoch {wl.checkpoint_after_epoch}")
    return {"reader": system.label, "state_mib": wl.model_size_bytes / 2**20,
            "state_bytes": wl.model_size_bytes, "schedule": schedule,
            "root": src.checkpoint_root, "methods": methods}


def _checkpoint_dir(src, bar, make: bool):
    """``src`` with a checkpoint directory of this run's own if ``make`` (its store is
    shared: another job may checkpoint under the same root), once those of this host's jobs
    killed before their cleanup are removed."""
    for left in sources.sweep_runs(src):
        _say(bar, f"note: removed {left}, left by a job killed before its cleanup")
    return sources.with_run_dir(src) if make else src


def _remove_checkpoints(root: str) -> None:
    """Remove this run's checkpoint directory (and nothing else under the root)."""
    try:
        fs, path = fsspec.core.url_to_fs(root)
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as exc:  # cleanup must not hide the run's own outcome
        print(f"warning: could not remove the job's checkpoints under {root}: {exc}", file=sys.stderr)


def text(results: dict, out_dir: str) -> str:
    """The run as a person reads it: the table, where the figures are, the verdict last."""
    return (f"{report.table(results)}\n\nfigures: {out_dir}/results.json, "
            f"{out_dir}/results.png\n{results['verdict']}")


def run(settings: JobSettings, argv: list[str] | None = None) -> dict:
    """Run the job; returns every figure (also written to ``out_dir``: results.json,
    results.png, results.txt; ResultsNotWritten, holding them, if they cannot be)."""
    warnings.filterwarnings("ignore", message=quiet.MESSAGE, category=UserWarning)
    wl = settings.workload
    os.makedirs(settings.out_dir, exist_ok=True)
    report.check_writable(settings.out_dir)
    want_ck = wl.checkpoint and bool(settings.methods)
    reader = "cachemw" if "cachemw" in settings.systems else settings.systems[0]
    total = len(settings.systems) * wl.epochs * wl.epoch_steps
    total += sum(s in CACHES for s in settings.systems) * settings.io_epochs * wl.epoch_steps
    if "cachemw" in settings.systems:  # the DataLoader's floor, with the caches' flat-out epochs
        total += settings.io_epochs * wl.epoch_steps
    if want_ck:
        total += (1 + len(settings.methods)) * sum(wl.steps_for_saves(settings.checkpoint_saves))
    results = {"job": {
        "command": argv, "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(), "workload": dataclasses.asdict(wl),
        "store": settings.source or f"the emulated store ({settings.profile.describe()})",
        "profile": dataclasses.asdict(settings.profile) if settings.source is None else None,
    }, "systems": {}, "floor": None, "checkpoints": None}
    for left in sweep_scratch():
        print(f"note: removed {left}, left by a job killed before its cleanup", file=sys.stderr)
    work = scratch_dir("cachemw-job-")
    # multiprocessing's own temp dir (pymp-*), made here, before any DataLoader forks its
    # workers: they inherit it and make none of their own, and this process removes it as
    # it exits. Each worker made one (a socket in it) and removed it as it exited; a
    # SIGTERM to the job's whole process group left them in $TMPDIR (review readme4).
    multiprocessing.util.get_temp_dir()
    store, src, kept, warm, run_dir = None, None, None, {}, None
    bar = tqdm(total=total, unit="step", disable=not settings.progress, file=sys.stderr,
               dynamic_ncols=True, leave=False)
    t_start = time.perf_counter()
    try:
        src, store = _prepare(settings, work, bar)
        if want_ck and not src.checkpoint_root:
            _say(bar, f"note: {src.description} is read-only here: no checkpoints")
            want_ck = False
        if settings.source is not None and src.checkpoint_root:
            src = _checkpoint_dir(src, bar, make=want_ck)
            run_dir = src.checkpoint_root if want_ck else None
        caches = [k for k in settings.systems if k in CACHES] if settings.io_epochs else []
        for key in settings.systems:
            system = build(key, src, wl)
            try:
                out, loader = _run_system(system, src, wl, store, bar)
                results["systems"][key] = out
                if key in caches:  # flat out once the last cache has trained, warm then
                    warm[key], system = (system, loader), None
                elif want_ck and key == reader:
                    kept, system = (system, loader), None
                del loader
            finally:
                if system is not None:
                    system.stop()
            if caches and len(warm) == len(caches):  # (the systems after train alone)
                flat = _run_flat_out(warm, wl, store, bar, settings.io_epochs)
                for name, epochs in flat.items():
                    if name == "floor":
                        results["floor"] = {"label": "DataLoader floor (in memory)",
                                            "io_epochs": epochs}
                    else:
                        results["systems"][name]["io_epochs"] = epochs
                if want_ck and reader in warm:
                    kept = warm.pop(reader)
                _stop_all(warm)
                caches = []
        if kept is not None:
            results["checkpoints"] = _run_checkpoints(settings, kept[0], kept[1], src, store, bar)
        results["job"]["wall_s"] = time.perf_counter() - t_start
        if store is not None:
            results["job"]["store_totals"] = store.stats()
    finally:
        bar.close()
        if kept is not None:
            warm["kept"] = kept
        kept = None
        _stop_all(warm)
        if run_dir is not None:
            _remove_checkpoints(run_dir)
        if store is not None:
            try:
                store.close()
            except Exception as exc:  # the scratch dir below goes all the same
                print(f"warning: could not stop the emulated store: {exc}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    results["over_floor"] = report.over_floor(results)
    results["targets"] = report.targets(results)
    results["verdict"] = report.verdict(results["targets"])
    report.write_all(results, settings.out_dir)
    return results


def main(args) -> int:
    """``cachemw job``: run, print the table, say what the run showed (last line)."""
    settings = settings_from(args)
    wl = settings.workload
    where = settings.source or f"the emulated store ({settings.profile.describe()})"
    print(f"workload {wl.name}: {wl.num_files_train} files x {wl.num_samples_per_file} "
          f"sample(s) of {wl.record_length_bytes} bytes, batch {wl.batch_size}, "
          f"{wl.read_threads} DataLoader workers, {wl.epochs} epochs"
          + (f" of {wl.epoch_steps} steps (train.total_training_steps)"
             if wl.epoch_steps < wl.steps_per_epoch else "")
          + f", {wl.computation_time:g} s compute per step; on {where}", flush=True)
    # a SIGTERM is taken as a Ctrl-C; either once only: a second one during the cleanup
    # would cut it short, leaving the store's data in /dev/shm
    _interrupts.clear()
    _interrupts_pid[0] = os.getpid()
    previous = {sig: signal.signal(sig, _interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        out = run(settings, argv=sys.argv)
    except report.ResultsNotWritten as exc:  # the run's figures, printed all the same
        print(f"{report.table(exc.results)}\n{exc.results['verdict']}", flush=True)
        raise
    except KeyboardInterrupt:
        if _interrupts and _interrupts[0] == signal.SIGTERM:  # cleaned up: said as such
            print("cachemw job: terminated (SIGTERM); everything it started is stopped and "
                  "removed", file=sys.stderr, flush=True)
            return 128 + signal.SIGTERM
        raise  # Ctrl-C: "interrupted", 130 (cli.py)
    finally:  # interrupted: the rest of the way out is not cut short either
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if _interrupts else handler)
    print(text(out, settings.out_dir))
    return 0


_interrupts: list[int] = []  # signals taken since the job started


def _interrupted(signum, frame) -> None:
    if os.getpid() != _interrupts_pid[0]:  # a forked DataLoader worker (Ctrl-C signals the
        if signum == signal.SIGINT:  # whole group): the job ends its workers as it stops;
            return  # a KeyboardInterrupt here, raised in a worker's exit, printed tracebacks
        signal.signal(signum, signal.SIG_DFL)  # SIGTERM (the loader's terminate()): ended
        os.kill(os.getpid(), signum)  # as Python's default ends a process, at once
        return
    _interrupts.append(signum)
    if len(_interrupts) == 1:
        # the DataLoader's SIGCHLD handler raises when a worker dies by a signal: the
        # workers of a signalled process group die with this one, and that error, raised
        # in the middle of the cleanup, cut it short (the store's data left in /dev/shm)
        # and was said instead of the stop
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        raise KeyboardInterrupt(f"signal {signum}")
    print("cachemw job: cleaning up, one moment", file=sys.stderr, flush=True)


_interrupts_pid = [0]  # the job's own process (its forked workers: see _interrupted)
