"""Save planning paid once: a planner that caches DCP's global plan.

A DCP save gathers every rank's local plan on the coordinator, which deduplicates them and builds
the checkpoint's metadata (the global planning), then scatters the final plans back. Between two
saves of a training run the shapes, dtypes and shardings rarely change, so neither does any of
that. ``CachingPlanner`` turns on DCP's plan caching under a key of its own (one per saver, so
that two managers in one process, or the memory tier, never share a cache): a rank whose local
plan is unchanged sends an empty plan, and when every rank's is unchanged the coordinator reuses
the cached global plan and metadata instead of planning. ``global_plans(key)`` counts the global
plannings actually performed, so that this is checked, not assumed.

The coordinator's planning itself stays linear in the number of ranks: DCP validates the global
plan (chunks in bounds, none overlapping, the tensor covered) with a sweep line along each
tensor's largest dimension, and for a tensor sharded column-wise by TP and row-wise by FSDP
(``wo``, ``w2``) every FSDP chunk of a column band is active at once: quadratic in the ranks
(measured by ``benchmarks/planning_scale.py``). ``CachingPlanner`` runs the same checks sweeping
along the dimension with the most distinct chunk offsets, which keeps the active set at the
chunks that share one offset there (``dcpkit.formats.structure.chunk_problems``, which checks
every checkpoint a load verifies).

A job's first save is planned from the layout every rank shares, when it can be
(``described``): no plans gathered but those of the states that differ between ranks, counted
by ``described_plans(key)``; ``global_plans`` stays 0.

Its ``transform_object`` serializes each distinct small value once per save (an optimizer's
hyperparameters, stored once per parameter).

Where the installed torch has no plan caching (before DCP's ``enable_plan_caching``), saves plan
every time, as before, and the count says so.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import itertools
import logging
from collections import ChainMap, Counter
from typing import Any

from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_global_save_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from dcpkit import dist
from dcpkit.dist import paused_gc
from dcpkit.engine import chunk_layout, described, plan_seed
from dcpkit.engine.described_write import StreamedMetadata, compact
from dcpkit.engine.plan_seed import Seed
from dcpkit.formats.chunks import chunk_problems

logger = logging.getLogger(__name__)

CACHING = "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters
"""Whether this torch's DCP can cache save plans."""

_keys = itertools.count()
_global_plans: Counter[str] = Counter()
_described_plans: Counter[str] = Counter()
_numbers: dict[str, dict[str, Any]] = {}
"""Per key of a described save: every DTensor's (number, shape, layout), for its ranks' write
results (``described_write.compact``), at that save and every cached one after it."""
_seeded: set[str] = set()
"""Keys whose cache came from a checkpoint (``plan_seed``): the coordinator holds no rank's
plan, so a save where any rank's plan changed plans in full on every rank."""


_SCALARS = (int, float, bool, str, bytes, type(None))


def _value_key(value: Any) -> Any:
    """A key equal only for values ``torch.save`` writes alike: scalars of exactly these types
    (by ``repr``, so 0.0 and -0.0, 1 and 1.0 and True differ) and tuples of them; None for
    anything else (serialized every time)."""
    if type(value) in _SCALARS:
        return type(value), repr(value)
    if type(value) is tuple and len(value) <= 16:
        keys = tuple(_value_key(v) for v in value)
        return None if None in keys else (tuple, keys)
    return None


def new_key() -> str:
    """A cache key for one saver (unique in this process)."""
    return f"dcpkit-save-{next(_keys)}"


def global_plans(key: str) -> int:
    """How many global plannings this process performed, as coordinator, under ``key``."""
    return _global_plans[key]


def described_plans(key: str) -> int:
    """How many first saves this process coordinated from the ranks' shared description
    (``described``): no plans gathered but the per-rank states'."""
    return _described_plans[key]


def forget(key: str) -> None:
    """Drop the plans cached under ``key`` (the coordinator holds every rank's)."""
    _seeded.discard(key)
    _numbers.pop(key, None)
    for cache in (
        "_cached_save_plan",
        "_cached_final_save_plan",
        "_cached_all_plans",
        "_cached_global_plan",
        "_cached_metadata",
    ):
        getattr(SavePlanner, cache, {}).pop(key, None)


class CachingPlanner(DefaultSavePlanner):
    """DCP's default save planner, with its plans cached under ``key`` and its global plannings
    counted."""

    def __init__(
        self, key: str, seed: Seed | None = None, group: Any = None, **kwargs: Any
    ) -> None:
        if CACHING:
            kwargs["enable_plan_caching"] = True
        super().__init__(**kwargs)
        self._cached_plans_key = key  # DCP's own cache key, one per saver
        self._serialized: dict[Any, bytes] = {}  # a small value's key -> its torch.save bytes
        self.seed = seed  # the checkpoint a restart resumed from: its first save's plans
        self.group = group  # the save's process group
        self._seeded_final: SavePlan | None = None
        self._seeded_index: Any = None
        self._agreed: described.Agreed | None = None
        self.streams = False  # whether the storage writer writes a StreamedMetadata

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        """DCP's ``torch.save`` of a stored value, made once per distinct small value of a
        save: a flattened optimizer stores every hyperparameter once per parameter (2315 of the
        3158 entries of a 4 GiB Llama-shaped model + AdamW), at ~70 us a ``torch.save``, on the
        writer threads, holding the GIL."""
        key = _value_key(object) if write_item.type == WriteItemType.BYTE_IO else None
        if key is None:
            return super().transform_object(write_item, object)
        data = self._serialized.get(key)
        if data is None:
            data = super().transform_object(write_item, object).getvalue()
            self._serialized[key] = data
        return io.BytesIO(data)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global planning (deduplication, global plan, metadata), validated in time
        linear in the chunks."""
        if self._agreed is not None:  # a described save: only the per-rank states' plans came
            _described_plans[self._cached_plans_key] += 1
        else:
            _global_plans[self._cached_plans_key] += 1
        with paused_gc():  # millions of new objects, no cycles: each full collection walks them all
            deduped = dedup_save_plans(all_plans, getattr(self, "dedup_save_to_lowest_rank", False))
            global_plan, metadata = create_default_global_save_plan(deduped)
        if self.flatten_state_dict:
            merged = dict(ChainMap(*(p.planner_data for p in global_plan)))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        errors = validate_global_plan(metadata, len(global_plan))
        if errors:
            summary = "; ".join(errors)
            raise ValueError(f"the global save plan is invalid: {summary[:500]}")
        if self._agreed is not None:  # the described entries: listed as .metadata is written
            metadata.state_dict_metadata.update(described.shared_entries(self._agreed))
            paths = {**self._agreed.mappings, **(metadata.planner_data or {})}
            metadata.planner_data = paths if self.flatten_state_dict else None
            agreed = self._agreed
            metadata = StreamedMetadata(metadata, described.numbered(agreed), agreed.order)
        return global_plan, metadata

    def create_local_plan(self) -> SavePlan:
        plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        return self.cached_local_plan(plan)

    def layouts(self) -> dict[str, Any]:
        """Every DTensor's layout (``described``), from the state being saved."""
        return chunk_layout.layouts_of(self.state_dict)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        agreed, self._agreed = self._agreed, None
        if agreed is not None:  # this rank's share, with its per-rank states' planned items
            items = [*agreed.owned, *new_plan.items]
            new_plan = dataclasses.replace(new_plan, items=items, planner_data=self.mappings)
            numbers = described.numbered(agreed)
            _numbers[self._cached_plans_key] = {
                fqn: (number, size, layout) for number, (fqn, _, size, layout) in enumerate(numbers)
            }
        if self._seeded_final is not None:  # this rank's share of the checkpoint's plan
            new_plan = dataclasses.replace(self._seeded_final, storage_data=new_plan.storage_data)
            self._seeded_final = None
        if self._seeded_index is not None:  # the coordinator: the metadata, from the index
            built = plan_seed.global_metadata(self._seeded_index)
            metadata = SavePlanner._cached_metadata[self._cached_plans_key]
            metadata.state_dict_metadata = built.state_dict_metadata
            metadata.planner_data = built.planner_data
            self._seeded_index = None
        return super().finish_plan(new_plan)

    def create_global_plan(self, all_plans: list[SavePlan]) -> Any:
        if not hasattr(DefaultSavePlanner, "_create_global_plan"):  # an older DCP: count here
            _global_plans[self._cached_plans_key] += 1
        return super().create_global_plan(all_plans)

    def cached_local_plan(self, plan: SavePlan) -> SavePlan:
        """For a subclass that builds its local plan itself: what DCP's ``create_local_plan``
        does with the plan when caching is on (an unchanged plan is sent empty)."""
        self.plan = plan
        if not CACHING:
            return plan
        from torch.distributed.checkpoint.planner_helpers import _compare_save_plans

        key = self._cached_plans_key
        cached = SavePlanner._cached_save_plan.get(key)
        if self.seed is not None and self._plan_from_seed(plan, self.seed):  # on every rank
            return SavePlan([], usable=False)
        if cached is None and key not in _seeded and self._described_ok():
            sent = self._plan_described(plan)
            if sent is not None:
                return sent
        self._pending_local_plan = plan  # promoted to the cache once the save's plan succeeded
        if key in _seeded:  # every rank's plan unchanged, or every rank plans in full
            unchanged = cached is not None and _compare_save_plans(plan, cached)
            if dist.all_sum([0 if unchanged else 1], self.group)[0] == 0:
                return SavePlan([], usable=False)
            forget(key)
            return plan
        if cached is not None and _compare_save_plans(plan, cached):
            return SavePlan([], usable=False)
        return plan

    def _described_ok(self) -> bool:
        """Whether a first save may be planned from the description: on for several ranks
        whose storage writer streams the metadata (the same everywhere)."""
        return (
            described.enabled() and dist.world_size() > 1 and self.flatten_state_dict
            and self.streams
        )  # fmt: skip

    def compact_results(self, results: list[Any]) -> Any:
        """This rank's write results as the storage writer sends them to the coordinator: rows
        of integers for a described save's chunks (``described_write``)."""
        numbers = _numbers.get(self._cached_plans_key)
        return results if numbers is None else compact(results, numbers)

    def _plan_described(self, plan: SavePlan) -> SavePlan | None:
        """Every rank: this rank's share of the save from the description all ranks agree on
        (``described``), sending only its per-rank states' items; None (on every rank) when
        the ranks do not agree."""
        mappings = self.mappings if isinstance(self.mappings, dict) else {}
        agreed, why = described.agree(plan, self.layouts(), mappings, self.group)
        if agreed is None:
            if dist.rank() == 0:
                logger.info("checkpoint: the first save gathers the ranks' plans: %s", why)
            return None
        self._pending_local_plan = plan
        self._agreed = agreed
        _seeded.add(self._cached_plans_key)  # a later change plans in full, on every rank
        if dist.rank() == 0:
            per_rank = ", ".join(agreed.per_rank) or "none"
            logger.info(
                "checkpoint: the first save of these shapes is planned from the layout every "
                "rank shares (%d DTensors, %d values): no plans gathered but the per-rank "
                "states' (%s)",
                len(agreed.dtensors), len(agreed.shared), per_rank,
            )  # fmt: skip
        return agreed.sent

    def _plan_from_seed(self, plan: SavePlan, seed: Seed) -> bool:
        """Every rank: take this save's plans and metadata from the checkpoint the run resumed
        from, when every rank's plan matches it (``plan_seed``); one all-reduce decides."""
        index = plan_seed.open_index(seed)
        rank = dist.rank()
        taken = None
        try:  # nothing may raise on one rank alone before the all-reduce: the others would wait
            if index is not None and seed.world == dist.world_size():
                taken = plan_seed.claim(plan, index, rank)
        except Exception as e:
            logger.warning(
                "checkpoint: rank %d cannot take its plan from step %d: %r", rank, seed.step, e
            )
        stored = index.stored_entries() if index is not None else -1
        failed, claimed = dist.all_sum([taken is None, len(taken or ())], self.group)
        if failed or claimed != stored:
            if rank == 0:
                logger.warning(
                    "checkpoint: the first save plans: the layout differs from step %d's "
                    "(%d of %d ranks match it; %d of its %d entries taken), so every rank's "
                    "plan is gathered and planned on the coordinator",
                    seed.step, dist.world_size() - failed, dist.world_size(), claimed, stored,
                )  # fmt: skip
            return False
        assert index is not None and taken is not None
        key = self._cached_plans_key
        self._pending_local_plan = plan
        self._seeded_final = SavePlan(taken, planner_data=plan.planner_data)
        if self.is_coordinator:  # what a global planning would have made, and nothing to merge
            empty = [SavePlan([], usable=False)] * dist.world_size()
            SavePlanner._cached_all_plans[key] = empty
            SavePlanner._cached_global_plan[key] = empty
            # filled from the index once the plans are out (``finish_plan``): the other ranks
            # write meanwhile; DCP's finish pickles this same object
            SavePlanner._cached_metadata[key] = Metadata(state_dict_metadata={})
            self._seeded_index = index
        _seeded.add(key)
        if rank == 0:
            logger.info(
                "checkpoint: this save takes its plans from step %d (the same layout on every "
                "rank, %d entries): nothing planned", seed.step, stored,
            )  # fmt: skip
        return True


def validate_global_plan(metadata: Metadata, n_plans: int) -> list[str]:
    """Every tensor's chunks inside its bounds, disjoint, and (saved by several ranks) covering
    it: DCP's checks, sweeping along the dimension with the most distinct chunk offsets."""
    errors: list[str] = []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and len(md.size):
            errors += chunk_problems(key, md.size, md.chunks, covered=n_plans > 1)
    return errors
