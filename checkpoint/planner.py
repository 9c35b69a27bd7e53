"""A DCP SavePlanner that spreads replicated tensors over all data-parallel ranks.

DCP's default planner deduplicates a replicated tensor by giving it, whole, to one rank.
This planner keeps DCP's local planning, and replaces the global step: replicated tensors are
cut into row chunks and assigned greedily by bytes (see ``chunk_plan``), so each of N ranks
writes about 1/N of the bytes. Chunks are ordinary DCP shards (``WriteItemType.SHARD`` with
offsets), so the checkpoint reshards on load with DCP's own load planner and reader.
"""
from __future__ import annotations

import dataclasses
import math
from collections import ChainMap
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from .chunk_plan import DEFAULT_CHUNK_BYTES, ChunkSpec, ItemSpec, plan_spread


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    """``chunk_bytes``: largest chunk; ``tolerance``: allowed excess over a fair 1/N share."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    tolerance: float = 0.05

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")


def item_key(index: MetadataIndex) -> str:
    """A stable text key for a DCP storage index: the fqn plus the chunk offsets."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def item_nbytes(item: WriteItem) -> int:
    """Bytes of the chunk an item writes (DCP's ``tensor_storage_size`` counts the whole tensor)."""
    if item.tensor_data is None:
        return 0
    itemsize = torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
    return math.prod(item.tensor_data.chunk.sizes) * itemsize


def item_spec(item: WriteItem) -> ItemSpec:
    """What the pure planner needs to know of one DCP write item."""
    key = item_key(item.index)
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return ItemSpec(key)
    chunk = item.tensor_data.chunk
    itemsize = torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
    return ItemSpec(key, tuple(chunk.sizes), itemsize, splittable=item.type == WriteItemType.TENSOR)


def chunk_write_item(item: WriteItem, chunk: ChunkSpec) -> WriteItem:
    """The DCP write item for ``chunk`` of ``item`` (unchanged when the chunk is the whole item)."""
    if item.type != WriteItemType.TENSOR or item.tensor_data is None or tuple(chunk.sizes) == tuple(item.tensor_data.chunk.sizes):
        return item
    offsets, sizes = torch.Size(chunk.offsets), torch.Size(chunk.sizes)
    return WriteItem(
        index=MetadataIndex(item.index.fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=item.tensor_data.properties,
            size=item.tensor_data.size,
        ),
    )


class SpreadSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner whose global plan splits and balances replicated tensors."""

    def __init__(self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, tolerance: float = 0.05,
                 flatten_state_dict: bool = True) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=True,
                         enable_plan_caching=False)
        self.config = PlannerConfig(chunk_bytes=chunk_bytes, tolerance=tolerance)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        by_key: dict[str, WriteItem] = {}
        specs = []
        for plan in all_plans:
            rank_specs = []
            for item in plan.items:
                spec = item_spec(item)
                by_key.setdefault(spec.key, item)
                rank_specs.append(spec)
            specs.append(rank_specs)
        spread = plan_spread(specs, chunk_bytes=self.config.chunk_bytes, tolerance=self.config.tolerance)
        plans = [
            dataclasses.replace(plan, items=[chunk_write_item(by_key[c.key], c) for c in chunks])
            for plan, chunks in zip(all_plans, spread.per_rank)
        ]
        global_plan, metadata = create_default_global_save_plan(plans)
        if self.flatten_state_dict:
            merged = dict(ChainMap(*[p.planner_data for p in global_plan if p.planner_data]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata

    def resolve_data(self, write_item: WriteItem) -> Any:
        obj = self.state_dict.get(write_item.index.fqn)
        is_plain = isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter)
        if write_item.type == WriteItemType.SHARD and is_plain and write_item.tensor_data is not None:
            chunk = write_item.tensor_data.chunk
            return obj.detach().narrow(0, int(chunk.offsets[0]), int(chunk.sizes[0]))
        return super().resolve_data(write_item)
