"""``python -m cachemw.placement.simulate``: policies x workloads, each as a ratio to Belady's MIN
(the optimum for blocks of equal size; with sizes that vary, a reference a policy can beat).

Why a module of its own: the simulator proper lives in :mod:`.simulator`, so the package can
export the function ``simulate`` while this command-line module keeps the name the issue
asks for. Importing this module explicitly rebinds ``cachemw.placement.simulate`` to the
module object (Python sets a package attribute for each submodule it loads); the module is
made callable so that ``cachemw.placement.simulate(trace, policy, capacity)`` keeps working.
"""
from __future__ import annotations

import argparse
import sys
import time
import types
from typing import Callable, Dict, List, Tuple

from . import workloads
from .simulator import simulate as _simulate

POLICY_ORDER = ("lru", "pin", "history", "clairvoyant", "belady")


def standard_workloads(scale: float = 1.0) -> Dict[str, Tuple[Callable[[], list], float]]:
    """name -> (trace factory, cache capacity as a fraction of the working set)."""
    n = max(100, int(10_000 * scale))
    return {
        "epochs (RandomSampler, 5 ep, 50%)": (lambda: workloads.epochs_trace([110_000] * n, 5), 0.5),
        "ddp 4 ranks (per-node cache 12.5%)": (
            lambda: workloads.epochs_trace([110_000] * n, 5, ranks=4, with_nodes=True), 0.125),
        "unet3d (168 x ~146 MiB, 50%)": (workloads.unet3d, 0.5),
        "bert (2,500 B records, 1 MiB blocks, 50%)": (
            lambda: workloads.bert(n=max(20_000, int(100_000 * scale))), 0.5),
        "resnet50 (~110 KB, 50%)": (lambda: workloads.resnet50(n=n), 0.5),
        "zipf s=1.0 (5,000 keys, 10%)": (lambda: workloads.zipf(accesses=max(20_000, int(200_000 * scale))), 0.1),
        "two jobs sharing (50%)": (lambda: workloads.two_jobs([110_000] * (n // 2)), 0.5),
    }


def table(scale: float = 1.0, out=sys.stdout) -> List[dict]:
    rows = []
    header = f"{'workload':44s} {'accesses':>9s} " + " ".join(f"{p:>19s}" for p in POLICY_ORDER)
    print("hit ratio (ratio to Belady's MIN on the same trace: the optimum for blocks of equal "
          "size; where sizes vary, a reference that a policy can beat, above 1.000x)", file=out)
    print(header, file=out)
    for name, (make, frac) in standard_workloads(scale).items():
        trace = make()
        nodes = len({item[2] for item in trace}) if len(trace[0]) == 3 else 1
        cap = int(workloads.dataset_bytes(trace) * frac / nodes)
        results = {p: _simulate(trace, p, cap) for p in POLICY_ORDER}
        best = results["belady"].hit_ratio
        cells = []
        for p in POLICY_ORDER:
            r = results[p].hit_ratio
            cells.append(f"{r:8.4f} ({r / best if best else 0:5.3f}x)")
        print(f"{name:44s} {len(trace):9d} " + " ".join(f"{c:>19s}" for c in cells), file=out)
        rows.append({"workload": name, **{p: results[p] for p in POLICY_ORDER}})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cachemw.placement.simulate", description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="dataset size multiplier (default 1.0)")
    args = parser.parse_args(argv)
    if args.scale <= 0:
        parser.error("--scale must be > 0")
    t0 = time.perf_counter()
    table(args.scale)
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _simulate(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
