"""What a background writer receives for one save: the plan computed from the live state, and a
planner that takes the data from the staging buffers instead of the live tensors."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from dcpkit.engine.plan_seed import Seed
from dcpkit.engine.planning import CachingPlanner
from dcpkit.engine.publish import StepInfo


@dataclasses.dataclass
class StagedStep:
    """Everything a writer needs besides the buffers: picklable, small."""

    info: StepInfo
    items: list[WriteItem]
    mappings: dict[str, Any]
    objects: dict[str, Any]
    plan_key: str = ""
    """The plan cache of the saver (``engine.planning``)."""
    seed: Seed | None = None
    """The checkpoint a restart resumed from, for its first save (``engine.plan_seed``)."""
    layouts: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Every DTensor's layout, for a first save planned from it (``engine.described``)."""


class StagedPlanner(CachingPlanner):
    """A save planner over staged buffers: the write items were computed from the live state
    (DTensor shards keep their global offsets), the data comes from the buffers."""

    def __init__(
        self, staged: StagedStep, buffers: dict[str, torch.Tensor], group: Any = None
    ) -> None:
        super().__init__(staged.plan_key, staged.seed, group)
        self.staged = staged
        self.buffers = buffers

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):  # type: ignore[no-untyped-def]
        self.state_dict = {}
        self.mappings = self.staged.mappings
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        return self.cached_local_plan(SavePlan(list(self.staged.items), planner_data=self.mappings))

    def layouts(self) -> dict[str, Any]:
        return self.staged.layouts

    def resolve_data(self, write_item: WriteItem):  # type: ignore[no-untyped-def]
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:  # serialized as a sync save's are
            return self.transform_object(write_item, self.staged.objects[fqn])
        return self.buffers[fqn]
