"""Planning a load: which checkpoint (the latest published step, ``load_step``, or
``initial_load_path`` when the folder holds none), and, with ``verify_on_load``, proving it intact
first, falling back to the newest older step that is when ``fallback_on_corruption`` allows."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dcpkit import dist
from dcpkit.config import ConfigError
from dcpkit.engine.policy import choose_step, fallback_steps, is_seed_step
from dcpkit.engine.reading import FailedVerification
from dcpkit.engine.together import decided, retrying, together
from dcpkit.errors import CheckpointError, CorruptCheckpoint
from dcpkit.integrity import verify_checkpoint
from dcpkit.layout import (
    HF_FILES,
    HF_INDEX,
    HF_SINGLE,
    METADATA,
    METADATA_INDEX,
    RANK_FILE,
    parse_step,
    step_name,
)
from dcpkit.manifest import CHECKSUM_ALGORITHM
from dcpkit.storage import StoreError, open_location
from dcpkit.storage.holds import Hold, hold_step, letting_go

logger = logging.getLogger(__name__)


@dataclass
class LoadPlan:
    store: Any
    name: str | None
    step: int | None
    model_only: bool
    reason: str
    error: str | None = None
    own: bool = False
    """One of this run's published steps (an initial_load_path need not carry a marker)."""

    finished: bool = False
    """The error is a finished run's model-only step (a ``CheckpointError``, not an option's)."""

    @classmethod
    def failed(cls, error: str, finished: bool = False) -> LoadPlan:
        return cls(None, None, None, False, "", error=error, finished=finished)

    def raise_if_failed(self) -> None:
        if self.error:
            raise (CheckpointError if self.finished else ConfigError)(self.error)

    @property
    def location(self) -> str:
        return self.store.location(self.name) if self.name else ""


def check_reachable(store: Any) -> None:
    """Every rank: fail at start, naming the folder, when the store cannot be used."""
    error = dist.first_rank_error(store.check_reachable, (StoreError,))
    if error:
        raise CheckpointError(f"[checkpoint] folder {error}")


def plan_load(config: Any, store: Any, states: Any = ()) -> LoadPlan:
    """What to load (rank 0 decides; the plan is broadcast). ``states``: the names of the state
    groups the run holds besides the model (a model-only step would leave them fresh)."""
    choice = choose_step(store.published_steps(), config.load_step, store.root)
    if choice.error:
        return LoadPlan.failed(choice.error)
    if choice.step is not None:
        reason = choice.reason
        if config.load_step == -1 and config.initial_load_path:
            reason += " (initial_load_path is ignored: the checkpoint folder is not empty)"
        name = step_name(choice.step)
        model_only = is_seed_step(choice.step) or config.load_model_only
        others = set(states) - set(config.exclude_from_loading)
        if not model_only and others and _holds_model_only(store, name):
            return LoadPlan.failed(_finished_run_message(store, choice.step, config), True)
        return LoadPlan(store, name, choice.step, model_only, reason, own=True)
    if config.initial_load_path:
        return _plan_initial_load(config)
    return LoadPlan(None, None, None, False, f"{choice.reason}: starting fresh")


def plan_everywhere(config: Any, store: Any, states: Any = ()) -> LoadPlan:
    """``plan_load`` on rank 0, its plan (or its failure, raised together) on every rank; a
    store that does not answer is tried again within ``storage_retry_s``."""
    what = f"loading from {store.root}"
    return retrying(lambda: _plan_once(config, store, states), config.storage_retry_s, what)


def _plan_once(config: Any, store: Any, states: Any) -> LoadPlan:
    return decided(lambda: plan_load(config, store, states), store.root)


def _holds_model_only(store: Any, name: str) -> bool:
    """Whether published step ``name`` is a model-only save (a finished run's last save, in
    DCP or as a Hugging Face folder): loading it restores no step, optimizer or data."""
    try:
        manifest, _ = store.read_manifest(name)
    except Exception:  # unreadable: the verification that follows names the problem
        return False
    if manifest is not None:
        return bool(manifest.get("model_only"))
    names = set(store.list_names(name))
    return bool(names & HF_FILES) and METADATA not in names


def _finished_run_message(store: Any, step: int, config: Any) -> str:
    """Why a model-only step is not resumed, and the two ways on, naming the newest full
    checkpoint when the folder has one."""
    full = next(
        (s for s in sorted(store.published_steps(), reverse=True)
         if s < step and not is_seed_step(s) and not _holds_model_only(store, step_name(s))),
        None,
    )  # fmt: skip
    which = f"load_step = {step}" if config.load_step != -1 else "the latest published step"
    in_hf = METADATA not in store.list_names(step_name(step))
    hf = " and initial_load_in_hf = true" if in_hf else ""
    extend = (
        f"to extend the run, set load_step = {full} (its newest full checkpoint)"
        if full is not None
        else "this folder holds no full checkpoint to extend the run from"
    )
    return (
        f"{store.location(step_name(step))} ({which}) is a model-only save: the last save of a "
        "finished run (last_save_model_only), which holds no step, optimizer, data position or "
        "RNG. Resuming from it would start training again at step 1 over this run's own "
        "checkpoints, so nothing is loaded and nothing written. The run is finished; to train "
        f"on from its weights with everything else fresh, set [checkpoint] initial_load_path = "
        f"{store.location(step_name(step))!r}{hf} with an empty checkpoint folder (load_model_only "
        f"= true loads it here, but no save may then replace a step of the finished run); "
        f"{extend}"
    )


def _plan_initial_load(config: Any) -> LoadPlan:
    """``initial_load_path``: a DCP step folder, or with ``initial_load_in_hf`` a Hugging Face
    folder, local or on an object store (read in place, never downloaded whole)."""
    where = repr(str(config.initial_load_path))
    try:
        store, name = open_location(config.initial_load_path, config.storage_options)
        store.check_reachable()
        names = set(store.list_names(name))
    except StoreError as e:
        return LoadPlan.failed(f"[checkpoint] initial_load_path {e}")
    if config.initial_load_in_hf and not names & HF_FILES:
        return LoadPlan.failed(
            f"[checkpoint] initial_load_path {where} holds no Hugging Face safetensors "
            f"({HF_SINGLE} or {HF_INDEX}), and initial_load_in_hf = true"
        )
    if not config.initial_load_in_hf and METADATA not in names and names & HF_FILES:
        return LoadPlan.failed(
            f"[checkpoint] initial_load_path {where} is a Hugging Face folder (it holds "
            f"{', '.join(sorted(names & HF_FILES))}, no {METADATA}): set initial_load_in_hf = "
            "true to load it (with hf_model=HFModel(...) given to CheckpointManager)"
        )
    if not config.initial_load_in_hf and METADATA not in names:
        return LoadPlan.failed(
            f"[checkpoint] initial_load_path {where} is not a checkpoint (no {METADATA} in it); "
            "point it at a step-N folder"
        )
    return LoadPlan(
        store,
        name,
        None,
        config.initial_load_model_only,
        "initial_load_path (the checkpoint folder is empty)",
    )


def checksum_share(store: Any, name: str) -> dict[str, str] | None:
    """The files of checkpoint ``name`` whose checksums this rank verifies (every rank a share),
    with their expected xxh3-64; None without a manifest. Saved by as many ranks as load it,
    rank R verifies the files rank R wrote (``__R_I.distcp``): at a resume on the same layout
    those are the files it reads, hashed in the same pass. Other files, and every file at
    another world size, are dealt in turn."""
    manifest, _ = store.read_manifest(name)
    if manifest is None:
        return None
    world, rank = dist.world_size(), dist.rank()
    owned = {f: int(m.group(1)) for f in manifest["files"] if (m := RANK_FILE.match(f))}
    if set(owned.values()) != set(range(world)):
        owned = {}
    others = sorted(f for f in manifest["files"] if f not in owned)
    mine = [f for f, r in owned.items() if r == rank] + others[rank::world]
    return {
        n: e[CHECKSUM_ALGORITHM]
        for n in mine
        if isinstance(e := manifest["files"][n], dict)
        and isinstance(e.get(CHECKSUM_ALGORITHM), str)
    }


def gather_problems(problems: list[Any]) -> list[str]:
    """Every rank's problems, on every rank, sorted."""
    found: set[str] = set()
    for part in dist.all_gather_object([str(p) for p in problems]):
        found.update(part)
    return sorted(found)


def verify_everywhere(
    store: Any,
    name: str,
    require_commit: bool,
    only: set[str] | None = None,
    kept: dict[str, Any] | None = None,
) -> list[str]:
    """Problems with checkpoint ``name``; every rank checksums its share of the files (of
    ``only`` these, when given; sizes and structure are checked for all). Empty when it is
    intact. ``kept``: gets the ``Metadata`` the checks parsed, or the index of ``.metadata``
    they read, for the load to read by, and this rank's checksum share (``checksum_share``)."""

    def check() -> Any:
        share = checksum_share(store, name)
        if kept is not None:
            kept["share"] = share
        mine = None if share is None else sorted(n for n in share if only is None or n in only)
        return verify_checkpoint(
            store,
            name,
            checksum_files=mine,
            require_commit=require_commit,
            share=(dist.rank(), dist.world_size()),
        )

    report = together(check, store.location(name))  # a store that fails one rank fails all
    if kept is not None:
        kept["metadata"], kept["index"] = report.metadata, report.index
    return gather_problems(report.problems)


def verified(
    plan: LoadPlan,
    config: Any,
    store: Any,
    only: set[str] | None = None,
    kept: dict[str, Any] | None = None,
) -> LoadPlan:
    """``plan`` if its checkpoint verifies; else the newest older one that does, when
    ``fallback_on_corruption`` allows it; else an error listing the problems. ``only``: the
    files to checksum now (the load checksums the others as it reads them)."""
    assert plan.name is not None
    problems = verify_everywhere(plan.store, plan.name, plan.own, only, kept)
    if not problems:
        return plan
    return fallback(plan, problems, config, store)


def fallback(plan: LoadPlan, problems: list[str], config: Any, store: Any) -> LoadPlan:
    """After ``plan`` failed verification with ``problems``: the newest older checkpoint that
    verifies, when ``fallback_on_corruption`` allows it; else an error listing the problems."""
    listing = "; ".join(problems[:5]) + (
        f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    )
    if not (config.fallback_on_corruption and config.load_step == -1 and plan.own):
        raise CorruptCheckpoint(
            f"{plan.location} failed verification: {listing}. Run `dcpkit verify "
            f"{plan.location}` for the full list; set [checkpoint] fallback_on_corruption = true "
            "to load the newest intact checkpoint instead, or load_step to choose one"
        )
    failed = plan
    steps = together(store.published_steps, store.root)  # a store that fails one rank fails all
    for step in fallback_steps(steps, plan.step or 0):
        name = step_name(step)
        if dist.rank() == 0:
            logger.warning(
                "checkpoint: %s failed verification (%s); falling back to %s",
                failed.location,
                listing,
                store.location(name),
            )
        if not verify_everywhere(store, name, require_commit=True):
            reason = f"fallback: {plan.name} failed verification"
            model_only = is_seed_step(step) or config.load_model_only
            return LoadPlan(store, name, step, model_only, reason, own=True)
        failed = LoadPlan(store, name, step, is_seed_step(step), "", own=True)
    raise CorruptCheckpoint(
        f"no published checkpoint in {store.root} passes verification (the latest failed "
        f"with: {listing}); restore the files or start fresh in another folder"
    )


def restore_verified(
    plan: LoadPlan, config: Any, store: Any, restore: Callable[..., list[str]]
) -> tuple[LoadPlan, list[str]]:
    """``_restore_verified``, tried again while the store does not answer, within
    ``storage_retry_s`` (every rank together)."""
    what = f"loading {plan.location}"
    once = functools.partial(_restore_verified, plan, config, store, restore)
    with letting_go(_hold(plan) if dist.rank() == 0 else None, before=dist.barrier):
        return retrying(once, config.storage_retry_s, what)


def _hold(plan: LoadPlan) -> Hold | None:
    """Rank 0: hold the step a load reads against the retention of the run saving into its
    folder (another run's, with ``initial_load_path`` or ``load_only``): None when it is no
    step, or cannot be held (the load then says what is missing)."""
    step = parse_step(plan.name or "")
    if step is None:
        return None
    try:
        return hold_step(plan.store, step, "load")
    except Exception as e:  # never a failure of rank 0 alone: the others wait in the load
        logger.warning("checkpoint: %s is not held against retention: %s", plan.location, e)
        return None


def _restore_verified(
    plan: LoadPlan, config: Any, store: Any, restore: Callable[..., list[str]]
) -> tuple[LoadPlan, list[str]]:
    """``restore(store, name, model_only[, checksums=])`` the checkpoint of ``plan``, or with
    ``verify_on_load`` the one that proves intact: the files are checksummed as the load reads
    them (local or remote), in the same pass, each rank its share; a failure falls back as
    configured.
    Returns the plan loaded and the pieces restored."""
    fused = together(  # DCP data read by dcpkit's reader: it checksums the files as it loads
        lambda: plan.store.direct_reads and METADATA in plan.store.list_names(plan.name),
        plan.location,
    )
    if not config.verify_on_load:  # no checksums; sizes and structure still, as verify checks
        kept: dict[str, Any] = {}
        checked = verified(plan, config, store, only=set(), kept=kept)
        read_by = {"metadata": kept.get("metadata"), "index": kept.get("index")}
        if checked is plan and fused:
            return plan, restore(plan.store, plan.name, plan.model_only, **read_by)
        return checked, restore(checked.store, checked.name, checked.model_only)
    # .metadata (and its index) are read before any data is: checksummed first, whatever the mode.
    kept = {}  # the .metadata or index those checks read: the load reads by it
    first = {METADATA, METADATA_INDEX}
    checked = verified(plan, config, store, only=first if fused else None, kept=kept)
    if checked is plan and fused:
        share = dict(kept.get("share") or {})  # read in the checks, by every rank together
        for name in first:
            share.pop(name, None)
        md, index = kept.get("metadata"), kept.get("index")
        try:
            return plan, restore(
                plan.store, plan.name, plan.model_only, checksums=share, metadata=md, index=index
            )
        except FailedVerification as e:
            checked = fallback(plan, e.problems, config, store)
    # A fallback step (verified by a pass of its own), or one verified before (other stores).
    return checked, restore(checked.store, checked.name, checked.model_only)
