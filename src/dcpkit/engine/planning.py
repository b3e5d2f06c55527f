"""Save planning paid once: a planner that caches DCP's global plan.

A DCP save gathers every rank's local plan on the coordinator, which deduplicates them and builds
the checkpoint's metadata (the global planning), then scatters the final plans back. Between two
saves of a training run the shapes, dtypes and shardings rarely change, so neither does any of
that. ``CachingPlanner`` turns on DCP's plan caching under a key of its own (one per saver, so
that two managers in one process, or the memory tier, never share a cache): a rank whose local
plan is unchanged sends an empty plan, and when every rank's is unchanged the coordinator reuses
the cached global plan and metadata instead of planning. ``global_plans(key)`` counts the global
plannings actually performed, so that this is checked, not assumed.

Where the installed torch has no plan caching (before DCP's ``enable_plan_caching``), saves plan
every time, as before, and the count says so.
"""

from __future__ import annotations

import inspect
import itertools
from collections import Counter
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

CACHING = "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters
"""Whether this torch's DCP can cache save plans."""

_keys = itertools.count()
_global_plans: Counter[str] = Counter()


def new_key() -> str:
    """A cache key for one saver (unique in this process)."""
    return f"dcpkit-save-{next(_keys)}"


def global_plans(key: str) -> int:
    """How many global plannings this process performed, as coordinator, under ``key``."""
    return _global_plans[key]


def forget(key: str) -> None:
    """Drop the plans cached under ``key`` (the coordinator holds every rank's)."""
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

    def __init__(self, key: str, **kwargs: Any) -> None:
        if CACHING:
            kwargs["enable_plan_caching"] = True
        super().__init__(**kwargs)
        self._cached_plans_key = key
        self.cache_key = key

    def _create_global_plan(self, all_plans: list[SavePlan]) -> Any:
        _global_plans[self.cache_key] += 1
        return super()._create_global_plan(all_plans)

    def create_global_plan(self, all_plans: list[SavePlan]) -> Any:
        if not hasattr(DefaultSavePlanner, "_create_global_plan"):  # an older DCP: count here
            _global_plans[self.cache_key] += 1
        return super().create_global_plan(all_plans)

    def cached_local_plan(self, plan: SavePlan) -> SavePlan:
        """For a subclass that builds its local plan itself: what DCP's ``create_local_plan``
        does with the plan when caching is on (an unchanged plan is sent empty)."""
        self.plan = plan
        if not CACHING:
            return plan
        from torch.distributed.checkpoint.planner_helpers import _compare_save_plans

        cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
        if cached is not None and _compare_save_plans(plan, cached):
            return SavePlan([], usable=False)
        self._pending_local_plan = plan  # promoted to the cache once the save's plan succeeded
        return plan
