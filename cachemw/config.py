"""Configuration: one frozen dataclass per component, and the only place CACHEMW_* is read
(and the other variables that give cachemw's settings their defaults: SLURM_*, RAY_ADDRESS).

Components take their config as keyword arguments; the environment is a fallback mapped
here, in one function per component, so the rest of the code never looks at os.environ.
How each value is parsed and checked (sizes, seconds, ports, directories) is
config_values.py's.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from typing import Mapping

from .config_values import (absolute_or_none, bool_or_none, check_port, check_runtime_dir,
                            check_seconds, check_trace_dir, float_or_none, int_or_none,
                            parse_size)

VALIDATE_MODES = ("immutable", "ttl", "always")
DEFAULT_BLOCK_SIZE = 8 * 1024 * 1024


def check_placement(placement: str | None, name: str) -> None:
    """A placement policy a daemon can run (None: the engine's default)."""
    if placement is None:
        return
    # The engine's own list, loaded only when a policy is named: a reader process must not
    # pay for importing the placement engine (~50 ms) to read a file.
    from .placement.registry import ONLINE_POLICIES

    if placement not in ONLINE_POLICIES:
        raise ValueError(f"{name}: must be one of {ONLINE_POLICIES}, got {placement!r}")


def trace_dir(env: Mapping[str, str] | None = None) -> str | None:
    """``CACHEMW_TRACE``: the directory every process of a job writes its trace file to
    (cachemw.trace reads it when imported); empty or unset: no tracing."""
    env = os.environ if env is None else env
    return check_trace_dir(env.get("CACHEMW_TRACE") or None, "CACHEMW_TRACE")


def ray_address(env: Mapping[str, str] | None = None) -> str | None:
    """``RAY_ADDRESS`` (empty: None), Ray's own variable, for status/top/stop without
    ``--address`` (cluster/actor.connect): read here, as cachemw must decide before Ray
    does (``ray.init()`` with neither an address nor it starts a new cluster)."""
    env = os.environ if env is None else env
    return env.get("RAY_ADDRESS") or None


def default_runtime_dir(env: Mapping[str, str] | None = None) -> str:
    """Per-user directory for the daemon's socket and registry (mode 0700); inside a Slurm
    job (``SLURM_JOB_ID`` set) per job too, so two jobs of one user on a node each have their
    own daemon and DRAM tier, and a job's end can free its tier without touching the other's.

    /dev/shm is node-local on every HPC system we target, unlike $HOME or /tmp on some.
    """
    env = os.environ if env is None else env
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    job = env.get("SLURM_JOB_ID", "")
    suffix = f"-job{job}" if job.isdigit() and job.isascii() else ""
    return os.path.join(base, f"cachemw-{os.getuid()}{suffix}")


def resolve_runtime_dir(runtime_dir: str | None = None, env=None) -> str:
    """The runtime dir a command or component means: the one given, else
    ``CACHEMW_RUNTIME_DIR`` (empty counts as unset), else the per-user (per-job) default."""
    env = os.environ if env is None else env
    return runtime_dir or env.get("CACHEMW_RUNTIME_DIR") or default_runtime_dir(env)


@dataclass(frozen=True)
class TierConfig:
    """One directory tier: where its block files live and how much it may hold."""

    name: str
    path: str
    capacity: int
    high_watermark: float = 0.95
    low_watermark: float = 0.85

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"tier name: {self.name!r} is not a valid name")
        if not self.path:
            raise ValueError(f"{self.name}_dir: a directory is required")
        capacity = parse_size(self.capacity, name=f"{self.name}_capacity")
        if capacity <= 0:
            raise ValueError(f"{self.name}_capacity: must be > 0, got {self.capacity!r} (omit "
                             f"it for the default)")
        object.__setattr__(self, "capacity", capacity)
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError(
                f"{self.name} watermarks: need 0 < low <= high <= 1, got "
                f"low={self.low_watermark} high={self.high_watermark}"
            )

    @property
    def high_bytes(self) -> int:
        return int(self.capacity * self.high_watermark)

    @property
    def low_bytes(self) -> int:
        return int(self.capacity * self.low_watermark)


# The CACHEMW_* variable of each daemon setting, by DaemonConfig.build keyword (the runtime
# dir's, CACHEMW_RUNTIME_DIR, is every component's: resolve_runtime_dir)
DAEMON_VARIABLES = {
    "dram_dir": "CACHEMW_DRAM_DIR", "dram_capacity": "CACHEMW_DRAM_CAPACITY",
    "nvme_dir": "CACHEMW_NVME_DIR", "nvme_capacity": "CACHEMW_NVME_CAPACITY",
    "placement": "CACHEMW_PLACEMENT", "metrics_port": "CACHEMW_METRICS_PORT",
    "metrics_host": "CACHEMW_METRICS_HOST", "trace_dir": "CACHEMW_TRACE",
}


def daemon_environment(env: Mapping[str, str] | None = None) -> dict:
    """The daemon settings the CACHEMW_* variables of ``env`` (default: this process's)
    give, as DaemonConfig.build keywords (unset and empty ones left out). ``cachemw start``
    passes them to the daemons it places: a Ray actor's environment is its raylet's, not
    the one the command ran in, so they were checked there and then not used."""
    env = os.environ if env is None else env
    out = {option: env[var] for option, var in DAEMON_VARIABLES.items() if env.get(var)}
    if "metrics_port" in out:  # a number, as the option is: compared with the running one's
        out["metrics_port"] = check_port(out["metrics_port"], DAEMON_VARIABLES["metrics_port"])
    return out


@dataclass(frozen=True)
class DaemonConfig:
    """A node daemon: its tiers (fastest first) and where it publishes its socket."""

    tiers: tuple[TierConfig, ...]
    runtime_dir: str = field(default_factory=default_runtime_dir)
    node_id: str = "local"
    log_level: str = "INFO"
    placement: str | None = None  # policy name; None: clairvoyant once announced, else history
    metrics_port: int | None = None  # Prometheus endpoint (cachemw.metrics); 0: any free port
    metrics_host: str = "0.0.0.0"  # the address it listens on
    trace_dir: str | None = None  # DFTracer trace files (cachemw.trace)

    def __post_init__(self) -> None:
        check_runtime_dir(self.runtime_dir)
        check_placement(self.placement, "placement")
        object.__setattr__(self, "metrics_port", check_port(self.metrics_port, "metrics_port"))
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ValueError(f"metrics_host: an address to listen on is required, got "
                             f"{self.metrics_host!r}")
        object.__setattr__(self, "trace_dir", check_trace_dir(self.trace_dir, "trace_dir"))
        if not self.tiers:
            raise ValueError("tiers: a daemon needs at least one tier")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers: duplicate tier names {names}")
        paths = [os.path.realpath(t.path) for t in self.tiers]
        if len(set(paths)) != len(paths):
            raise ValueError(f"tiers: two tiers share one directory {paths}")

    @classmethod
    def build(
        cls,
        *,
        dram_dir: str | None = None,
        dram_capacity: int | str | None = None,
        nvme_dir: str | None = None,
        nvme_capacity: int | str | None = None,
        runtime_dir: str | None = None,
        node_id: str | None = None,
        placement: str | None = None,
        metrics_port: int | str | None = None,
        metrics_host: str | None = None,
        trace_dir: str | None = None,
        env: Mapping[str, str] | None = None,
        **unknown,
    ) -> "DaemonConfig":
        """Build from keyword arguments, falling back to CACHEMW_* and then to defaults.

        Defaults: a DRAM tier in the runtime dir (/dev/shm) of 25% of physical memory, at
        most half the filesystem it is on; no NVMe tier unless a directory is given.
        """
        if unknown:
            raise ValueError(f"unknown daemon option(s): {', '.join(sorted(unknown))}")
        env = os.environ if env is None else env

        def pick(value, option: str, var: str | None = None):
            """A keyword wins over CACHEMW_*; an empty variable counts as unset. Returns
            (value, what to name in an error about it)."""
            if value is not None:
                return value, option
            var = var or DAEMON_VARIABLES[option]
            value = env.get(var) or None
            return value, (f"{var} ({option})" if value is not None else option)

        runtime_dir, rt_name = pick(runtime_dir, "runtime_dir", "CACHEMW_RUNTIME_DIR")
        runtime_dir = check_runtime_dir(default_runtime_dir(env) if runtime_dir is None
                                        else runtime_dir, rt_name)
        dram_dir, dram_dir_name = pick(dram_dir, "dram_dir")
        dram_dir = absolute_or_none(dram_dir, dram_dir_name) or os.path.join(runtime_dir, "dram")
        dram_capacity, dram_name = pick(dram_capacity, "dram_capacity")
        nvme_dir, nvme_dir_name = pick(nvme_dir, "nvme_dir")
        nvme_dir = absolute_or_none(nvme_dir, nvme_dir_name)
        nvme_capacity, nvme_name = pick(nvme_capacity, "nvme_capacity")
        placement, placement_name = pick(placement, "placement")
        check_placement(placement, placement_name)
        metrics_port, port_name = pick(metrics_port, "metrics_port")
        metrics_port = check_port(metrics_port, port_name)
        metrics_host, _ = pick(metrics_host, "metrics_host")
        trace, trace_name = pick(trace_dir, "trace_dir")
        trace = check_trace_dir(trace, trace_name)
        tiers = [_tier("dram", dram_dir, _default_dram_capacity(dram_dir) if dram_capacity is None
                       else dram_capacity, dram_name)]
        if nvme_dir:
            if nvme_capacity is None:
                raise ValueError("nvme_capacity: required when nvme_dir is given")
            tiers.append(_tier("nvme", nvme_dir, nvme_capacity, nvme_name))
        elif nvme_capacity is not None:
            raise ValueError(f"nvme_dir: required when {nvme_name} is given")
        return cls(
            tiers=tuple(tiers),
            runtime_dir=runtime_dir,
            node_id=node_id or env.get("CACHEMW_NODE_ID") or "local",
            log_level=env.get("CACHEMW_LOG_LEVEL") or "INFO",
            placement=placement,
            metrics_port=metrics_port,
            metrics_host=metrics_host or "0.0.0.0",
            trace_dir=trace,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "DaemonConfig":
        d = dict(d)
        d["tiers"] = tuple(TierConfig(**t) for t in d["tiers"])
        return cls(**d)


def _check_resolved(path: str, name: str) -> None:
    """``{node_id}`` is filled in by the daemons ``cachemw start`` places, never by a
    reader: its DataLoader workers remake the filesystem where Ray is not connected (spawn)
    or not usable (fork). Left as it was, reads went to the source, or an autostarted
    daemon served a directory literally named ``{node_id:.16}``."""
    if "{node_id" in path:
        raise ValueError(
            f"{name}: {path!r} holds the {{node_id}} template, which only the daemons "
            f"`cachemw start` places fill in; a reader gives its node's own directory, "
            f"e.g. {name}={path!r}.format(node_id=ray.get_runtime_context().get_node_id())")


def _tier(name: str, path: str, capacity, what: str) -> TierConfig:
    """A TierConfig whose errors name the variable or option the capacity came from."""
    try:
        return TierConfig(name, path, capacity)
    except ValueError as exc:
        text = str(exc)
        prefix = f"{name}_capacity:"
        if what != f"{name}_capacity" and text.startswith(prefix):
            text = f"{what}:{text[len(prefix):]}"
        raise ValueError(text) from None


def _default_dram_capacity(dram_dir: str) -> int:
    """A quarter of physical memory, and at most half of the filesystem ``dram_dir`` is on
    (its nearest existing directory): a container's /dev/shm is often far smaller than the
    machine's memory (Docker's and Kubernetes' 64 MiB, a Slurm job's tmpfs), and a tier
    sized past its filesystem ran out of space with nothing to evict (its used bytes under
    its capacity): it stopped caching for good (review ops6). Half, as /dev/shm is half of
    memory by default: the rest for the node's other users (Ray's object store, the
    trainer's shared memory, the metadata tables). From sysconf and statvfs, not psutil:
    every filesystem a reader makes (each DataLoader worker's) checks the daemon settings
    it would start, and importing psutil for that cost a new process 10-90 ms."""
    try:
        quarter = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):  # pragma: no cover - no such sysconf name
        quarter = 4 << 30
    size = filesystem_size(dram_dir)
    return max(1 << 20, min(quarter, size // 2)) if size else quarter


def filesystem_size(path: str) -> int | None:
    """The total size of the filesystem ``path`` (or its nearest existing ancestor) is on;
    None if it cannot be told."""
    path = os.path.abspath(path)
    while True:
        try:
            st = os.statvfs(path)
            return st.f_blocks * st.f_frsize or None
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
        except OSError:
            return None


@dataclass(frozen=True)
class CacheOptions:
    """Options of the ``cachemw`` filesystem (the client side of the cache)."""

    validate: str = "ttl"
    ttl: float = 60.0
    block_size: int = DEFAULT_BLOCK_SIZE
    autostart: bool = True
    runtime_dir: str = field(default_factory=default_runtime_dir)
    report_interval: float = 0.5
    # bytes of fetched blocks a process may hold while a writer thread puts them into the
    # tiers (see fills.py); 0 writes every fill on the reader's path
    write_behind: int = 32 << 20
    # how long the daemon may stay silent (hung, stopped) before a reader falls back to the
    # source; a daemon busy on a request says so meanwhile (client.py)
    daemon_timeout: float = 5.0
    # a directory: this process (and the daemon it starts) writes DFTracer traces there
    trace: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "trace", check_trace_dir(self.trace, "trace"))
        if self.validate not in VALIDATE_MODES:
            raise ValueError(f"validate: must be one of {VALIDATE_MODES}, got {self.validate!r}")
        object.__setattr__(self, "ttl", check_seconds(self.ttl, "ttl", zero_ok=True))
        object.__setattr__(self, "daemon_timeout",
                           check_seconds(self.daemon_timeout, "daemon_timeout"))
        check_runtime_dir(self.runtime_dir)
        _check_resolved(self.runtime_dir, "runtime_dir")
        bs = parse_size(self.block_size, name="block_size")
        if bs < 4096:
            raise ValueError(f"block_size: must be at least 4096 bytes, got {bs}")
        object.__setattr__(self, "block_size", bs)
        object.__setattr__(self, "write_behind", parse_size(self.write_behind, name="write_behind"))
        if not isinstance(self.autostart, bool):
            raise ValueError(f"autostart: must be True or False, got {self.autostart!r}")

    @classmethod
    def build(cls, env: Mapping[str, str] | None = None, **kwargs) -> "CacheOptions":
        """Keyword arguments win; CACHEMW_* fills what they leave out; unknown keys fail."""
        env = os.environ if env is None else env
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kwargs) - names
        if unknown:
            raise ValueError(f"unknown cachemw option(s): {', '.join(sorted(unknown))}")
        from_env = {
            "validate": env.get("CACHEMW_VALIDATE") or None,
            "ttl": float_or_none(env.get("CACHEMW_TTL"), "CACHEMW_TTL"),
            "block_size": env.get("CACHEMW_BLOCK_SIZE") or None,
            "runtime_dir": env.get("CACHEMW_RUNTIME_DIR") or None,
            "autostart": bool_or_none(env.get("CACHEMW_AUTOSTART"), "CACHEMW_AUTOSTART"),
            "write_behind": env.get("CACHEMW_WRITE_BEHIND") or None,
            "daemon_timeout": float_or_none(env.get("CACHEMW_DAEMON_TIMEOUT"),
                                             "CACHEMW_DAEMON_TIMEOUT"),
            "trace": env.get("CACHEMW_TRACE") or None,
        }
        merged = {k: v for k, v in from_env.items() if v is not None}
        given = {k: v for k, v in kwargs.items() if v is not None}
        merged.update(given)
        try:
            return cls(**merged)
        except ValueError as exc:  # name the variable when the bad value came from one
            bad = str(exc).split(":", 1)[0]
            if bad in from_env and bad not in given and from_env[bad] is not None:
                raise ValueError(f"CACHEMW_{bad.upper()} ({exc})") from None
            raise


def freeze_gc_in_workers(env: Mapping[str, str] | None = None) -> bool:
    """``CACHEMW_GC_FREEZE`` (default on): whether a DataLoader worker (any multiprocessing
    child) that imports the cachemw client first moves the objects it inherited into the
    garbage collector's permanent generation (``gc.freeze()``; see cachemw/client/__init__)."""
    env = os.environ if env is None else env
    value = bool_or_none(env.get("CACHEMW_GC_FREEZE"), "CACHEMW_GC_FREEZE")
    return True if value is None else value


def keep_heap_in_workers(env: Mapping[str, str] | None = None) -> bool:
    """``CACHEMW_WORKER_HEAP`` (default on): whether a torch DataLoader worker reading
    through cachemw keeps its heap's freed top for the next batch instead of faulting fresh
    pages for every sample (glibc's mallopt; see cachemw/client/heap.py)."""
    env = os.environ if env is None else env
    value = bool_or_none(env.get("CACHEMW_WORKER_HEAP"), "CACHEMW_WORKER_HEAP")
    return True if value is None else value


@dataclass(frozen=True)
class WarmConfig:
    """``cachemw warm``: how many nodes warm together (each then reads only the blocks its
    node owns), which task of its node this one is (only the first of a node works), how
    long to wait for the node's daemon to see the whole cache cluster, and reads in flight."""

    nodes: int = 1
    local_task: int = 0
    ring_wait: float = 60.0
    threads: int = 8
    # one node may warm alone (all of it) in a cache cluster of several: --nodes 1 given,
    # or no Slurm step; not a one-node step's default (fewer nodes than the cluster)
    alone_ok: bool = True

    def __post_init__(self) -> None:
        for name, low in (("nodes", 1), ("local_task", 0), ("threads", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: must be a whole number >= {low}, got {value!r}")
        object.__setattr__(self, "ring_wait", check_seconds(self.ring_wait, "ring_wait",
                                                            zero_ok=True))

    @classmethod
    def build(cls, *, nodes: int | None = None, ring_wait: float | None = None,
              threads: int | None = None, env: Mapping[str, str] | None = None) -> "WarmConfig":
        """Keywords win; inside a Slurm step (``srun``) the step's node count
        (``SLURM_STEP_NUM_NODES``) is the default of ``nodes`` and ``SLURM_LOCALID`` says
        which task of its node this is; elsewhere one node warms alone."""
        env = os.environ if env is None else env
        step_nodes = int_or_none(env.get("SLURM_STEP_NUM_NODES"), "SLURM_STEP_NUM_NODES")
        local = int_or_none(env.get("SLURM_LOCALID"), "SLURM_LOCALID")
        options = {"nodes": nodes if nodes is not None else step_nodes,
                   "local_task": local, "ring_wait": ring_wait, "threads": threads,
                   "alone_ok": nodes is not None or step_nodes is None}
        return cls(**{k: v for k, v in options.items() if v is not None})

