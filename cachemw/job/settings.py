"""The job's settings: what a run compares, on which store, and the emulated store's profile.
Standard library only, so ``cachemw --help`` and the CLI's other commands load it for free
(the job's own dependencies, torch, aiohttp, PyYAML and matplotlib, are the ``job`` extra).
"""
from __future__ import annotations

import dataclasses
import os

SYSTEMS = ("direct", "simplecache", "cachemw", "cachemw+announce")
CACHES = ("simplecache", "cachemw")  # the systems that also run the flat-out epochs
METHODS = ("torch.save", "dcp.async_save", "Checkpointer")
WORKLOAD_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads")
DEFAULT_WORKLOAD = "image_classification"


def shipped() -> list[str]:
    """Names of the workloads shipped with the job (``cachemw/job/workloads/*.yaml``)."""
    return sorted(f[:-5] for f in os.listdir(WORKLOAD_DIR) if f.endswith(".yaml"))


@dataclasses.dataclass(frozen=True)
class StoreProfile:
    """How slow the emulated store is: seconds, and bytes per second; 0 = no limit.

    The default resembles a busy shared store seen from one node (docs/benchmarks.md,
    "Main job", says why): a latency per request that a small-file reader pays in full,
    and a bandwidth share below what the emulated accelerator could consume.
    """

    latency: float = 0.010
    bandwidth: float = 200 * 1024 * 1024
    meta_latency: float = 0.004

    def __post_init__(self) -> None:
        for name in ("latency", "bandwidth", "meta_latency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"store profile: {name} must be a number >= 0, got {value!r}")

    def describe(self) -> str:
        bw = f"{self.bandwidth / 2**20:g} MiB/s shared" if self.bandwidth else "unlimited bandwidth"
        return (f"{self.latency * 1e3:g} ms per data request, {self.meta_latency * 1e3:g} ms "
                f"per metadata request, {bw}")

    def arguments(self) -> list[str]:
        """The store process's command-line arguments for this profile."""
        return ["--latency-ms", repr(self.latency * 1e3), "--meta-latency-ms",
                repr(self.meta_latency * 1e3), "--bandwidth", repr(float(self.bandwidth))]


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """One run of the job (``cachemw job`` builds it from its arguments). ``workload`` is
    a ``workload.Workload``."""

    workload: object
    profile: StoreProfile = StoreProfile()
    source: str | None = None  # None: the emulated store; else a directory or fsspec URL
    source_options: dict = dataclasses.field(default_factory=dict)
    systems: tuple = SYSTEMS
    methods: tuple = METHODS
    checkpoint_saves: int = 3  # saves per checkpoint method (whole epochs are trained)
    # warm epochs with no compute after a cache's training epochs (simplecache, cachemw):
    # the loader flat out, where the readers and not the emulated accelerator set the pace
    io_epochs: int = 10
    out_dir: str = "cachemw-job"
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(f"systems: expected one or more of {', '.join(SYSTEMS)}, got "
                             f"{', '.join(self.systems) or 'none'}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"checkpoint methods: expected some of {', '.join(METHODS)}, "
                             f"got {', '.join(unknown)}")
        if isinstance(self.io_epochs, bool) or not isinstance(self.io_epochs, int) \
                or self.io_epochs < 0:
            raise ValueError(f"io_epochs: must be a whole number >= 0, got {self.io_epochs!r}")
        if self.checkpoint_saves < 1:
            raise ValueError(f"checkpoint_saves: must be >= 1, got {self.checkpoint_saves}")
