"""Configuration: one frozen dataclass per component, and the only place CACHEMW_* is read.

Components take their config as keyword arguments; the environment is a fallback mapped
here, in one function per component, so the rest of the code never looks at os.environ.
"""
from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Mapping

VALIDATE_MODES = ("immutable", "ttl", "always")
PLACEMENT_POLICIES = ("history", "lru", "pin", "clairvoyant")
DEFAULT_BLOCK_SIZE = 8 * 1024 * 1024

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Parse ``4096``, ``"512MiB"``, ``"2G"``, ``"1.5GB"`` into bytes (binary units).

    Raises ValueError naming ``name`` on anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}: must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"{name}: cannot parse size {value!r} (use e.g. 512MiB, 4G, 1048576)")
    number, unit, _ = m.groups()
    return int(float(number) * (1024 ** _SIZE_UNITS[unit.lower()]))


def default_runtime_dir() -> str:
    """Per-user directory for the daemon's socket and registry (mode 0700).

    /dev/shm is node-local on every HPC system we target, unlike $HOME or /tmp on some.
    """
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"cachemw-{os.getuid()}")


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
        object.__setattr__(self, "capacity", parse_size(self.capacity, name=f"{self.name}_capacity"))
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


@dataclass(frozen=True)
class DaemonConfig:
    """A node daemon: its tiers (fastest first) and where it publishes its socket."""

    tiers: tuple[TierConfig, ...]
    runtime_dir: str = field(default_factory=default_runtime_dir)
    node_id: str = "local"
    log_level: str = "INFO"
    placement: str | None = None  # policy name; None: clairvoyant once announced, else history

    def __post_init__(self) -> None:
        if self.placement is not None and self.placement not in PLACEMENT_POLICIES:
            raise ValueError(f"placement: must be one of {PLACEMENT_POLICIES}, "
                             f"got {self.placement!r}")
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
        env: Mapping[str, str] | None = None,
        **unknown,
    ) -> "DaemonConfig":
        """Build from keyword arguments, falling back to CACHEMW_* and then to defaults.

        Defaults: a DRAM tier in the runtime dir (/dev/shm) of 25% of physical memory;
        no NVMe tier unless a directory is given.
        """
        if unknown:
            raise ValueError(f"unknown daemon option(s): {', '.join(sorted(unknown))}")
        env = os.environ if env is None else env
        runtime_dir = runtime_dir or env.get("CACHEMW_RUNTIME_DIR") or default_runtime_dir()
        dram_dir = dram_dir or env.get("CACHEMW_DRAM_DIR") or os.path.join(runtime_dir, "dram")
        dram_capacity = dram_capacity or env.get("CACHEMW_DRAM_CAPACITY") or _default_dram_capacity()
        nvme_dir = nvme_dir or env.get("CACHEMW_NVME_DIR")
        nvme_capacity = nvme_capacity or env.get("CACHEMW_NVME_CAPACITY")
        tiers = [TierConfig("dram", dram_dir, dram_capacity)]
        if nvme_dir:
            if not nvme_capacity:
                raise ValueError("nvme_capacity: required when nvme_dir is given")
            tiers.append(TierConfig("nvme", nvme_dir, nvme_capacity))
        elif nvme_capacity:
            raise ValueError("nvme_dir: required when nvme_capacity is given")
        return cls(
            tiers=tuple(tiers),
            runtime_dir=runtime_dir,
            node_id=node_id or env.get("CACHEMW_NODE_ID") or "local",
            log_level=env.get("CACHEMW_LOG_LEVEL", "INFO"),
            placement=placement or env.get("CACHEMW_PLACEMENT") or None,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "DaemonConfig":
        d = dict(d)
        d["tiers"] = tuple(TierConfig(**t) for t in d["tiers"])
        return cls(**d)


def _default_dram_capacity() -> int:
    try:
        import psutil

        return psutil.virtual_memory().total // 4
    except Exception:  # pragma: no cover - psutil is a dependency
        return 4 << 30


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

    def __post_init__(self) -> None:
        if self.validate not in VALIDATE_MODES:
            raise ValueError(f"validate: must be one of {VALIDATE_MODES}, got {self.validate!r}")
        if not isinstance(self.ttl, (int, float)) or self.ttl < 0:
            raise ValueError(f"ttl: must be a number of seconds >= 0, got {self.ttl!r}")
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
            "validate": env.get("CACHEMW_VALIDATE"),
            "ttl": _float_or_none(env.get("CACHEMW_TTL"), "CACHEMW_TTL"),
            "block_size": env.get("CACHEMW_BLOCK_SIZE"),
            "runtime_dir": env.get("CACHEMW_RUNTIME_DIR"),
            "autostart": _bool_or_none(env.get("CACHEMW_AUTOSTART"), "CACHEMW_AUTOSTART"),
            "write_behind": env.get("CACHEMW_WRITE_BEHIND"),
        }
        merged = {k: v for k, v in from_env.items() if v is not None}
        merged.update({k: v for k, v in kwargs.items() if v is not None})
        return cls(**merged)


def _float_or_none(value: str | None, name: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}: expected a number, got {value!r}") from None


def _bool_or_none(value: str | None, name: str) -> bool | None:
    if value is None or value == "":
        return None
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}: expected true/false, got {value!r}")
