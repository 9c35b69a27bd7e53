"""DLIO's own figures with and without cachemw, on an emulated slow parallel filesystem.

Runs the real ``dlio_benchmark`` (2.0.0) on the shipped ``cachemw_unet3d`` workload, its data
and checkpoints on a FUSE mount with a PFS's costs (benchmarks/slowfs.py: a latency per open
and per metadata call, one bandwidth budget shared by every process), alternately:

- ``plain``: DLIO as it is (its npz reader, ``torch.save`` checkpoints);
- ``cachemw``: the same workload with ``cachemw.dlio``'s reader and checkpoint mechanism, a
  cold cache each run (a fresh runtime dir, its daemon stopped after the run).

Reports what DLIO reports (its summary.json and per_epoch_stats.json): AU per epoch, samples/s
per epoch, and the time of each checkpoint (the training stall), min/median/max over the runs,
and the cachemw/plain ratios of each run. Needs the DLIO environment the tests build
(build/dlio-venv: ``pytest tests/test_dlio.py`` makes it), libfuse2 and fusepy in it, root (to
mount), and /dev/fuse.

    python benchmarks/dlio_slow_store.py --runs 3 [--open-ms 10 --meta-ms 2 --mbps 40]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = REPO / "build" / "dlio-venv" / "bin"
WORKLOAD = "cachemw_unet3d"
PLAIN = ["~workload.reader.reader_classname", "~workload.checkpoint.checkpoint_mechanism_classname"]


def dlio(config_dir: str, work: Path, env: dict, *overrides: str) -> None:
    cmd = [str(VENV_BIN / "dlio_benchmark"), "--config-dir", config_dir, f"workload={WORKLOAD}", *overrides]
    run = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    if run.returncode != 0:
        sys.exit(f"dlio_benchmark failed ({' '.join(cmd)}):\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}")


def figures(out: Path) -> dict:
    metric = json.loads((out / "summary.json").read_text())["metric"]
    epochs = json.loads((out / "per_epoch_stats.json").read_text())
    ckpts = [float(v["duration"]) for e in epochs.values() for k, v in e.items() if k.startswith("ckpt")]
    au, sps = metric["train_au_percentage"], metric["train_throughput_samples_per_second"]
    return {"au": au, "samples_per_s": sps, "checkpoint_s": ckpts,
            "au_epoch1": au[0], "au_later": statistics.mean(au[1:]),
            "sps_epoch1": sps[0], "sps_later": statistics.mean(sps[1:]),
            "checkpoint_mean_s": statistics.mean(ckpts) if ckpts else 0.0}


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    values = sorted(values)
    if len(values) < 3:
        return ", ".join(fmt.format(v) for v in values)
    return " / ".join(fmt.format(v) for v in (values[0], statistics.median(values), values[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--open-ms", type=float, default=10.0)
    ap.add_argument("--meta-ms", type=float, default=2.0)
    ap.add_argument("--mbps", type=float, default=40.0)
    ap.add_argument("--work", default=None, help="scratch dir (default: a new temp dir, removed after)")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    ap.add_argument("overrides", nargs="*", help="extra DLIO overrides, e.g. ++workload.train.epochs=2")
    args = ap.parse_args()
    if not (VENV_BIN / "dlio_benchmark").exists():
        sys.exit(f"no DLIO environment at {VENV_BIN.parent}: run `pytest tests/test_dlio.py` once to build it")
    work = Path(args.work or tempfile.mkdtemp(prefix="cachemw-dlio-bench-"))
    store, mount = work / "store", work / "pfs"
    store.mkdir(parents=True, exist_ok=True)
    mount.mkdir(exist_ok=True)
    config_dir = subprocess.run([str(VENV_BIN / "python"), "-m", "cachemw.dlio"], capture_output=True,
                                text=True, check=True).stdout.strip()
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", PYTHONNOUSERSITE="1")
    env.pop("VIRTUAL_ENV", None)

    print(f"generating {WORKLOAD} in {store} ...", flush=True)
    dlio(config_dir, work, env, *PLAIN, f"++workload.dataset.data_folder={store}/data",
         f"++workload.output.folder={work}/out-gen", "++workload.workflow.generate_data=True",
         "++workload.workflow.train=False", *args.overrides)
    server = subprocess.Popen([str(VENV_BIN / "python"), str(REPO / "benchmarks" / "slowfs.py"), str(store),
                               str(mount), f"--open-ms={args.open_ms}", f"--meta-ms={args.meta_ms}",
                               f"--mbps={args.mbps}"])
    results: dict[str, list[dict]] = {"plain": [], "cachemw": []}
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mount):
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit("the FUSE store did not mount (libfuse2, fusepy, /dev/fuse, root?)")
            time.sleep(0.1)
        for i in range(args.runs):
            for system in (("plain", "cachemw") if i % 2 == 0 else ("cachemw", "plain")):
                out, rt = work / f"out-{i}-{system}", work / f"rt-{i}"
                run_env = dict(env, CACHEMW_RUNTIME_DIR=str(rt))
                print(f"run {i + 1}/{args.runs}: {system} ...", flush=True)
                dlio(config_dir, work, run_env, *(PLAIN if system == "plain" else []),
                     f"++workload.dataset.data_folder={mount}/data",
                     f"++workload.checkpoint.checkpoint_folder={mount}/ckpt-{i}-{system}",
                     f"++workload.output.folder={out}", *args.overrides)
                if system == "cachemw":  # the next cachemw run starts cold
                    subprocess.run([str(VENV_BIN / "cachemw"), "stop"], env=run_env, capture_output=True,
                                   timeout=60)
                    shutil.rmtree(rt, ignore_errors=True)
                results[system].append(figures(out))
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    print(f"\nDLIO {WORKLOAD}, store: {args.open_ms} ms per open, {args.meta_ms} ms per metadata call, "
          f"{args.mbps} MB/s shared; {args.runs} runs (min / median / max)")
    print(f"{'':10} {'AU % ep.1':>18} {'AU % ep.2+':>18} {'samples/s ep.2+':>18} {'checkpoint s':>18}")
    for system, runs in results.items():
        print(f"{system:10} {spread([r['au_epoch1'] for r in runs]):>18} {spread([r['au_later'] for r in runs]):>18} "
              f"{spread([r['sps_later'] for r in runs]):>18} "
              f"{spread([r['checkpoint_mean_s'] for r in runs], '{:.2f}'):>18}")
    pairs = list(zip(results["plain"], results["cachemw"]))
    print(f"cachemw / plain, samples/s ep.2+: {spread([c['sps_later'] / p['sps_later'] for p, c in pairs], '{:.2f}x')}; "
          f"ep.1: {spread([c['sps_epoch1'] / p['sps_epoch1'] for p, c in pairs], '{:.2f}x')}; "
          f"checkpoint stall: {spread([c['checkpoint_mean_s'] / p['checkpoint_mean_s'] for p, c in pairs], '{:.3f}x')}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
