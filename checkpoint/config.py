"""The Checkpointer's options: one frozen dataclass, built from its constructor's keywords."""
from __future__ import annotations

import dataclasses
from typing import Any

from .chunk_plan import DEFAULT_CHUNK_BYTES

BUSY_POLICIES = ("wait", "refuse")


@dataclasses.dataclass(frozen=True)
class CheckpointerConfig:
    """Options of a Checkpointer (all keyword arguments of its constructor)."""

    keep_last: int | None = None
    compression: str | None = None
    fast_root: str | None = None
    # In-memory copies kept in the fast tier. With 1 (the default) a save overwrites the previous
    # copy in place once that one is committed at the root: one copy of the state in host memory,
    # none committed in the fast tier while the save runs. More than 1 stages through buffers.
    fast_keep_last: int = 1
    if_busy: str = "wait"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    thread_count: int = 2
    device: str = "cpu"
    memory_budget: int | None = None
    stale_after_s: float = 3600.0
    collective_timeout_s: float = 600.0
    watch_poll_s: float = 30.0
    # How much lower the save's background threads (write, commit, drain) run than the
    # trainer (a nice increment, 0-19; 0: the same): they run on the cycles training leaves
    # idle and yield the cores to the DataLoader's workers when those need them
    # (background.py).
    background_nice: int = 10

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {self.keep_last}")
        if self.fast_keep_last < 1:
            raise ValueError(f"fast_keep_last must be >= 1, got {self.fast_keep_last}")
        if self.if_busy not in BUSY_POLICIES:
            raise ValueError(f"if_busy must be one of {BUSY_POLICIES}, got {self.if_busy!r}")
        if self.compression not in (None, "lz4"):
            raise ValueError(f"compression must be None or 'lz4', got {self.compression!r}")
        if isinstance(self.background_nice, bool) or not isinstance(self.background_nice, int) \
                or not 0 <= self.background_nice <= 19:
            raise ValueError(f"background_nice must be a whole number from 0 to 19, got {self.background_nice!r}")
        for name in ("chunk_bytes", "thread_count", "stale_after_s", "collective_timeout_s", "watch_poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "CheckpointerConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown Checkpointer option(s): {', '.join(unknown)}")
        return cls(**kwargs)
