"""DLIO's checkpoint plug-in: DLIO's model, optimizer and layer state saved by a Checkpointer.

DLIO's own PyTorch mechanism ``torch.save``s each part to its own file inside the training
step, so DLIO's checkpoint time is the whole write. Here the same state (the same tensors,
as many bytes) goes to one ``cachemw.checkpoint.Checkpointer`` per rank: the step waits for
the snapshot, the write and commit run in the background, and ``finalize`` (end of run)
waits until every save is committed. Where a cachemw daemon runs, saves land in node DRAM
first and drain to the checkpoint folder.

Layout: ``<checkpoint.checkpoint_folder>/rank-<r>`` per saving rank (rank 0 only with DLIO's
default ``checkpoint.type: rank_zero``), loadable with ``Checkpointer(root).load(state)``,
whose state is ``{"model": ..., "optimizer": ..., "layers": {"0": ..., ...}}`` as far as the
workload has them. The step is the global training step: ``(epoch - 1) * steps_per_epoch +
step``.
"""
from __future__ import annotations

import logging
import math
import os

import torch
from dlio_benchmark.checkpointing.base_checkpointing import BaseCheckpointing
from dlio_benchmark.common.constants import MODULE_CHECKPOINT
from dlio_benchmark.common.enumerations import CheckpointLocationType
from dlio_benchmark.utils.utility import DLIOMPI, Profile

from cachemw.checkpoint import Checkpointer

log = logging.getLogger(__name__)
dlp = Profile(MODULE_CHECKPOINT)


def checkpoint_root(folder: str, rank: int) -> str:
    """Where rank ``rank``'s Checkpointer writes under DLIO's checkpoint folder."""
    return os.path.join(folder, f"rank-{rank}")


class CachemwCheckpointing(BaseCheckpointing):
    """DLIO ``BaseCheckpointing`` backed by ``cachemw.checkpoint.Checkpointer``."""

    __instance = None

    @staticmethod
    def get_instance():
        if CachemwCheckpointing.__instance is None:
            CachemwCheckpointing.__instance = CachemwCheckpointing()
        return CachemwCheckpointing.__instance

    @dlp.log_init
    def __init__(self):
        super().__init__("cachemw")
        self.rank = DLIOMPI.get_instance().rank()
        self.writes = self.rank == 0 or self.args.checkpoint_type != CheckpointLocationType.RANK_ZERO
        self.root = checkpoint_root(os.path.abspath(self.args.checkpoint_folder), self.rank)
        self.state = self._state() if self.writes else {}
        # Made at the first save, not here: DLIO builds its mechanism before the first read,
        # and by the first save the node's daemon (started by the readers) can give it its
        # DRAM tier
        self.checkpointer: Checkpointer | None = None
        self.handles = []

    def _state(self) -> dict:
        """DLIO's state for this rank, as BaseCheckpointing.checkpoint would save it."""
        state = {}
        if self.model_state:
            state["model"] = self.model_state
        if self.optimization_state:
            state["optimizer"] = self.optimization_state
        if (self.layer_state and self.args.num_layers > 0
                and self.rank % self.args.pipeline_parallelism == 0):
            layers = self.args.num_layers
            if self.args.tensor_parallelism > 1:
                layers += self.args.tensor_parallelism
            state["layers"] = {str(i): self.layer_state for i in range(layers)}
        return state

    def steps_per_epoch(self) -> int:
        """Steps of one training epoch, as DLIO's training loop counts them."""
        args = self.args
        steps = math.floor(args.num_samples_per_file * args.num_files_train / args.batch_size / args.comm_size)
        if args.total_training_steps > 0:
            steps = min(steps, args.total_training_steps)
        return steps

    @dlp.log
    def get_tensor(self, size):
        return torch.randint(high=1, size=(size,), dtype=torch.int8)  # as DLIO's PyTorch mechanism

    @dlp.log
    def save_state(self, suffix, state):
        raise NotImplementedError("CachemwCheckpointing saves the whole state at once (checkpoint())")

    @dlp.log
    def checkpoint(self, epoch, step_number):
        if not self.writes or not self.state:
            return
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self.root)
            fast = self.checkpointer.fast
            log.info("cachemw checkpoints of rank %d: %s%s", self.rank, self.root,
                     f" (first in node DRAM: {fast.location.url})" if fast is not None else "")
        step = (epoch - 1) * self.steps_per_epoch() + step_number
        self.handles.append(self.checkpointer.save(step, self.state))

    @dlp.log
    def finalize(self):
        if self.checkpointer is None:
            return
        try:
            self.checkpointer.wait()
        finally:
            self.checkpointer.close()
        log.info("cachemw checkpoints of rank %d: %d committed in %s, newest step %d",
                 self.rank, len(self.handles), self.root, self.handles[-1].step)
