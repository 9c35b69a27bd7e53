"""Per-step timings of a training epoch and what DLIO computes from them (AU, throughput).

Kept apart from the training loop (no torch here) so the arithmetic is tested on synthetic
timelines.

AU (accelerator utilisation) as dlio_benchmark computes it (``utils/statscounter.py``):
the compute time of the steps kept, divided by the wall time they span, leaving out the
first ``exclude_start_steps`` steps (1, as dlio_benchmark 2.0.0 leaves out the first: it
pays for starting the loader's workers) and the last ``exclude_end_steps`` (0). One difference, on purpose: DLIO ends its
timing block before a checkpoint and starts a new one after, so its AU never sees a
checkpoint's stall; here the stall is part of the step that checkpoints, so AU shows what
checkpoints cost the training.
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step: seconds blocked waiting for the batch (``load``), computing
    (``compute``), stalled by a checkpoint (``checkpoint``), and when it ended (``end``,
    seconds since the epoch began: before the loader's iterator was made)."""

    load: float
    compute: float
    checkpoint: float
    end: float
    samples: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Epoch:
    epoch: int
    steps: tuple
    wall: float  # seconds from the epoch's start (iterator made) to its last step's end

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.steps)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.steps)

    @property
    def io_wait(self) -> float:
        """Seconds the loop spent blocked on ``next(iterator)``: every step's, the first too."""
        return sum(s.load for s in self.steps)

    @property
    def compute(self) -> float:
        return sum(s.compute for s in self.steps)

    @property
    def checkpoint_stall(self) -> float:
        return sum(s.checkpoint for s in self.steps)

    def au(self, exclude_start: int = 1, exclude_end: int = 0) -> float:
        return accelerator_utilisation(self.steps, exclude_start, exclude_end)

    def summary(self, exclude_start: int = 1, exclude_end: int = 0) -> dict:
        wall = self.wall or math.nan
        return {"epoch": self.epoch, "steps": len(self.steps), "samples": self.samples,
                "bytes": self.nbytes, "wall_s": self.wall,
                "samples_per_s": self.samples / wall,
                "mib_per_s": self.nbytes / 2**20 / wall,
                "io_wait_s": self.io_wait, "compute_s": self.compute,
                "checkpoint_stall_s": self.checkpoint_stall,
                "au": self.au(exclude_start, exclude_end),
                "first_step_s": (self.steps[0].end if self.steps else math.nan),
                # every step: [load, compute, checkpoint, end] in seconds
                "steps_s": [[round(s.load, 6), round(s.compute, 6), round(s.checkpoint, 6),
                             round(s.end, 6)] for s in self.steps]}


def accelerator_utilisation(steps, exclude_start: int = 1, exclude_end: int = 0) -> float:
    """Compute time over wall time of ``steps[exclude_start:len - exclude_end]``.

    The span runs from the end of the last step left out at the start (the epoch's start
    if none is) to the end of the last step kept, so time between steps (the loop's own
    work) counts as not computing, as in DLIO. NaN if no step is kept.
    """
    steps = list(steps)
    kept = steps[exclude_start:len(steps) - exclude_end]
    if not kept:
        return math.nan
    begin = steps[exclude_start - 1].end if exclude_start > 0 else 0.0
    end = kept[-1].end
    span = end - begin
    if span <= 0:
        return math.nan
    return sum(s.compute for s in kept) / span
