"""``cachemw job``: the main job's command line. Loads only the standard library and the
job's settings: the CLI's other commands must not pay for (or need) torch, aiohttp, PyYAML
and matplotlib; the job itself (run.py) is loaded when it runs."""
from __future__ import annotations

from .settings import DEFAULT_WORKLOAD, METHODS, SYSTEMS, StoreProfile, shipped


def add_arguments(p) -> None:
    d = StoreProfile()
    p.add_argument("--workload", default=DEFAULT_WORKLOAD, metavar="NAME|FILE",
                   help=f"a DLIO workload YAML file, or a shipped one: {', '.join(shipped())} "
                        f"(default {DEFAULT_WORKLOAD})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one DLIO key, e.g. --set train.epochs=2 (repeatable)")
    p.add_argument("--store-latency-ms", type=float, default=d.latency * 1e3, metavar="MS",
                   help=f"emulated store: wait per data request (default {d.latency * 1e3:g})")
    p.add_argument("--store-meta-latency-ms", type=float, default=d.meta_latency * 1e3,
                   metavar="MS", help="emulated store: wait per metadata request (HEAD, "
                                      f"listing; default {d.meta_latency * 1e3:g})")
    p.add_argument("--store-bandwidth", default=f"{d.bandwidth / 2**20:g}MiB", metavar="SIZE",
                   help="emulated store: bytes per second shared by every reader and writer "
                        f"(default {d.bandwidth / 2**20:g}MiB; 0: unlimited)")
    p.add_argument("--source", metavar="DIR|URL",
                   help="run against a real store instead of the emulated one: a directory "
                        "or an fsspec URL (the dataset is written under <source>/cachemw-job/ "
                        "if missing and kept; each run checkpoints in a directory of its own "
                        "under <source>/cachemw-job/checkpoints/, removed after)")
    p.add_argument("--source-options", metavar="JSON",
                   help="storage options of --source's filesystem (a URL's), e.g. "
                        "'{\"anon\": true}'")
    p.add_argument("--systems", default=",".join(SYSTEMS), metavar="LIST",
                   help=f"read paths to compare, comma-separated (default: all: {','.join(SYSTEMS)})")
    p.add_argument("--checkpoints", default=",".join(METHODS), metavar="LIST",
                   help="checkpoint methods to compare, comma-separated, or none "
                        f"(default: all: {','.join(METHODS)})")
    p.add_argument("--checkpoint-saves", type=int, default=3, metavar="N",
                   help="checkpoints per method, exactly, on the workload's schedule "
                        "(checkpoint.*): as many steps are trained as that takes, whole "
                        "epochs, the last one stopped at the last save (default 3)")
    p.add_argument("--io-epochs", type=int, default=10, metavar="N",
                   help="after the training epochs of simplecache and cachemw, N more warm "
                        "epochs without compute: the loader flat out, where the readers set "
                        "the pace (the cache-vs-cache target is taken there, median epoch); "
                        "as many of the same DataLoader over samples in memory, its own floor "
                        "(default 10, 0: none)")
    p.add_argument("--out", default="cachemw-job", metavar="DIR",
                   help="where results.json, results.png and results.txt go (default ./cachemw-job)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args) -> int:
    from . import run  # torch and the rest of the job: loaded only when the job runs

    return run.main(args)
