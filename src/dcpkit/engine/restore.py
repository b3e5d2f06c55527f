"""Restoring a checkpoint into the live state, at any world size.

A template of the current state (DTensors with this run's sharding) -> ``dcp.load`` reshards the
saved chunks into it -> each piece restores itself. RNG state follows a documented rule at
another world size. A Hugging Face folder is read one tensor at a time through the model
family's codec.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from dcpkit import dist
from dcpkit.engine.reading import dcp_reader, load_into
from dcpkit.engine.states import (
    ModelState,
    PerRank,
    Stateful,
    rank_key,
    restore_rng,
    rng_source_rank,
)
from dcpkit.engine.together import together
from dcpkit.engine.values import fit_to_saved
from dcpkit.errors import CheckpointError
from dcpkit.formats.dcp_index import DcpIndex
from dcpkit.formats.dcp_reader import local_regions
from dcpkit.layout import (
    HF_FILES,
    METADATA,
    MODEL,
    OPTIMIZER,
    RNG,
    is_model_key,
)
from dcpkit.manifest import format_problem
from dcpkit.safe_pickle import UnsafeCheckpoint
from dcpkit.spellings import other_spellings

logger = logging.getLogger(__name__)


class HFCodec(Protocol):
    """Reading and writing Hugging Face folders of one model family (``dcpkit.HFModel``)."""

    def export(self, view: Any, out: Path) -> None:
        """Write the model of the DCP checkpoint ``view`` as a Hugging Face folder ``out``."""

    def read_model(self, view: Any) -> Iterator[tuple[str, str, torch.Tensor]]:
        """``(hf_name, our_name, tensor)`` for every parameter of the folder ``view``."""
        ...


def restore(
    store: Any,
    name: str,
    model: ModelState,
    states: dict[str, Stateful],
    *,
    model_only: bool = False,
    excluded: Iterable[str] = (),
    rng: bool = True,
    hf: HFCodec | None = None,
    own_rank: bool = False,
    checksums: dict[str, str] | None = None,
    metadata: Any = None,
    index: DcpIndex | None = None,
    seen: dict[str, Any] | None = None,
) -> list[str]:
    """Load checkpoint ``name`` of ``store`` into the live state; returns the pieces restored.
    ``checksums``: this rank's share of the files to verify as they are read; a mismatch
    raises :class:`FailedVerification` once every rank has read, with the live state partly
    loaded (load another checkpoint, or stop). ``metadata``: its ``.metadata``, parsed by the
    checks before, not parsed again; ``index``: likewise its index, as the checks read it.
    ``own_rank``: a checkpoint of this rank alone (the memory tier), read without collectives,
    its per-rank values and RNG this rank's own.

    Every rank fails together: when one fails before it reads (the store stopped answering, a
    file is broken), every rank raises its failure before any reads (``together``)."""
    location = store.location(name)
    gather = not own_rank and dist.is_dist()
    prepared = together(
        lambda: _prepare(
            store, name, model, states, model_only=model_only, excluded=excluded, rng=rng,
            hf=hf, own_rank=own_rank, checksums=checksums, metadata=metadata, index=index,
            seen=seen,
        ),
        location,
        gather,
    )  # fmt: skip
    if isinstance(prepared, list):  # a Hugging Face folder, loaded whole
        return prepared
    template, reader, stored, model_sd, wanted, per_rank, rng_plan, spelled = prepared
    load_into(template, reader, location, gather, stored)

    def apply() -> list[str]:
        names = {saved: live for live, saved in spelled.items()}
        model.load_state_dict({names.get(k, k): template[k] for k in model_sd})
        for group in wanted:
            obj = states[group]
            if group not in per_rank:
                obj.load_state_dict(template[group])
            elif per_rank[group][0] == "reshard":
                saved_states = [template[group][rank_key(i)] for i in range(per_rank[group][1])]
                obj.obj.load_state_dict(
                    obj.obj.reshard_state_dict(saved_states, dist.rank(), dist.world_size())
                )
            else:
                obj.obj.load_state_dict(template[group][rank_key(per_rank[group][1])])
        restored = [MODEL, *wanted]
        if rng_plan is not None:
            source, offset = rng_plan
            try:
                restore_rng(template[RNG][rank_key(source)], reseed_offset=offset, where=location)
            except UnsafeCheckpoint as e:
                raise CheckpointError(str(e)) from None
            except Exception as e:  # values of the right shape that no generator takes
                raise CheckpointError(
                    f"{location}: its RNG record {RNG}.{rank_key(source)} cannot be restored "
                    f"({type(e).__name__}: {e})"
                ) from None
            restored.append(RNG)
        return restored

    # applied on every rank; one that fails makes every rank fail, with its message
    return together(apply, location, gather)


def _prepare(
    store: Any,
    name: str,
    model: ModelState,
    states: dict[str, Stateful],
    *,
    model_only: bool,
    excluded: Iterable[str],
    rng: bool,
    hf: HFCodec | None,
    own_rank: bool,
    checksums: dict[str, str] | None,
    metadata: Any,
    index: DcpIndex | None,
    seen: dict[str, Any] | None,
) -> Any:
    """Everything a load does before it reads (``restore``): the pieces restored (a Hugging
    Face folder, loaded here), or the template, the reader, the stored bytes, the model's state
    dict, the groups wanted, the per-rank plan and the RNG plan."""
    location = store.location(name)
    names = set(store.list_names(name))
    if names & HF_FILES and METADATA not in names:
        wanted = [g for g in states if g not in set(excluded)]
        if wanted and not model_only:  # never a resume that silently restores the model alone
            raise CheckpointError(_missing_message(location, wanted, {"model_only": True}, set()))
        load_hf(store, name, model, hf)
        return [MODEL]
    manifest, _ = store.read_manifest(name)
    unknown = format_problem(manifest) if manifest is not None else None
    if unknown is not None:
        raise CheckpointError(f"{location}: {unknown}")
    try:
        reader, index = dcp_reader(store, name, checksums, metadata, manifest, index)
        metadata = index.catalog() if index is not None else reader.read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"{location} is not a checkpoint: it has no {METADATA}") from None
    except UnsafeCheckpoint as e:
        raise CheckpointError(str(e)) from None
    saved = set(metadata.state_dict_metadata)
    if seen is not None:  # what the load read by, for the next save (``Saver.resumed``)
        seen.update(index=index, world=(manifest or {}).get("world_size"))

    def has_group(group: str) -> bool:
        prefix = group + "."
        return group in saved or any(k.startswith(prefix) for k in saved)

    model_sd = model.state_dict()
    missing = sorted(k for k in model_sd if k not in saved)
    spelled = other_spellings(missing, saved) if missing else {}
    if spelled:
        first = next(iter(spelled))
        logger.info(
            "checkpoint: %s spells %d of the model's names otherwise (%s for %s): loaded by "
            "their common name", location, len(spelled), spelled[first], first,
        )  # fmt: skip
        model_sd = {spelled.get(k, k): v for k, v in model_sd.items()}
        missing = []
    if missing:
        shown = _listed(missing)
        raise CheckpointError(
            f"{location} does not hold {len(missing)} of this model's parameters ({shown}); "
            "is it a checkpoint of another model or flavor?"
        )
    template: dict[str, Any] = dict(model_sd)
    excluded = set(excluded)
    for group in excluded & set(states):
        logger.info("checkpoint: not loading %r (exclude_from_loading)", group)
    wanted = [] if model_only else [g for g in states if g not in excluded]
    want_rng = not model_only and rng and RNG not in excluded
    rng_saved = any(_RNG_KEY.match(k) for k in saved)
    missing = [g for g in wanted if not has_group(g)]
    if want_rng and not rng_saved and manifest is not None and not manifest.get("model_only"):
        missing.append(RNG)  # a full dcpkit checkpoint saved without it: the streams would differ
    if missing:
        raise CheckpointError(_missing_message(location, missing, manifest, saved))
    per_rank: dict[str, tuple[str, int]] = {}
    for group in wanted:
        obj = states[group]
        if isinstance(obj, PerRank) and own_rank:
            template[group] = {rank_key(dist.rank()): obj.obj.state_dict()}
            per_rank[group] = ("take", dist.rank())
        elif isinstance(obj, PerRank):
            template[group], per_rank[group] = _per_rank_template(obj, group, saved, location)
        else:
            template[group] = obj.state_dict()
        if group != OPTIMIZER:  # tensors of the saved shapes (the optimizer's follow the model)
            files = (manifest or {}).get("files") or {}
            limit = sum(e.get("size", 0) for e in files.values() if isinstance(e, dict)) or None
            try:
                template[group] = fit_to_saved(
                    template[group], group, metadata.state_dict_metadata, limit
                )
            except CheckpointError as e:
                raise CheckpointError(f"{location}: {e}") from None
    rng_plan = None
    if want_rng and rng_saved:
        rng_plan = (dist.rank(), 0) if own_rank else _plan_rng(saved, location)
        if rng_plan is not None:
            template[RNG] = {rank_key(rng_plan[0]): _rng_template(metadata, rng_plan[0], location)}
    elif want_rng:
        why = "a model-only save" if (manifest or {}).get("model_only") else "not written by dcpkit"
        logger.warning("checkpoint: %s holds no RNG state (%s); RNG starts fresh", location, why)
    if index is not None:  # DCP plans from the entries of the chunks this rank's shards overlap
        try:
            reader.adopt_metadata(index.metadata(local_regions(template)))
        except UnsafeCheckpoint as e:
            raise CheckpointError(str(e)) from None
    files = (manifest or {}).get("files") or {}
    stored = sum(e.get("size", 0) for n, e in files.items() if n.endswith(".distcp"))
    return template, reader, stored, model_sd, wanted, per_rank, rng_plan, spelled


def _listed(names: list[str]) -> str:
    more = len(names) - 8
    return ", ".join(names[:8]) + (f" and {more} more" if more > 0 else "")


def _missing_message(location: str, missing: list[str], manifest: Any, saved: set[str]) -> str:
    listing = ", ".join(repr(g) for g in missing)
    model_only = (manifest or {}).get("model_only") or all(is_model_key(k) for k in saved)
    if model_only:
        return (
            f"{location} holds the model only (a model-only save: the last save of a finished "
            f"run, a seed checkpoint or an export), not this run's {listing}. To go on from it "
            "with those starting fresh, set [checkpoint] load_model_only = true "
            "(initial_load_model_only for an initial_load_path); to resume everything, set "
            "load_step to a full checkpoint"
        )
    return (
        f"{location} holds no {listing}: loading it would start them fresh without a word. Pass "
        "the states it was saved with, or name them in [checkpoint] exclude_from_loading to "
        "start them fresh on purpose"
    )


def _per_rank_template(
    obj: PerRank, group: str, saved: set[str], location: str
) -> tuple[dict[str, Any], tuple[str, int]]:
    """What to load a per-rank state into, and how: ``("take", saved rank)`` by the rule
    ``r % saved_world_size``, or ``("reshard", saved_world_size)`` through its own hook."""
    pattern = re.compile(rf"^{re.escape(group)}\.rank_(\d+)(\.|$)")
    ranks = sorted({int(m.group(1)) for k in saved if (m := pattern.match(k))})
    if not ranks:
        raise CheckpointError(
            f"{location} holds {group!r} as one value for all ranks, but this run declares it "
            "per-rank (per_rank_states): pass it in states= to load it, as it was saved"
        )
    saved_world, world, rank = len(ranks), dist.world_size(), dist.rank()
    if saved_world != world and hasattr(obj.obj, "reshard_state_dict"):
        return {rank_key(i): _fresh(obj.obj.state_dict()) for i in range(saved_world)}, (
            "reshard",
            saved_world,
        )
    if saved_world != world and rank == 0:
        logger.warning(
            "checkpoint: %r saved by %d ranks, restored on %d: rank r takes saved rank r %% %d",
            group,
            saved_world,
            world,
            saved_world,
        )
    return {rank_key(rank % saved_world): obj.obj.state_dict()}, ("take", rank % saved_world)


def _fresh(value: Any) -> Any:
    """A copy whose tensors are new (several ranks' values load into one template)."""
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    return value


def load_hf(store: Any, name: str, model: ModelState, hf: HFCodec | None) -> None:
    """Model weights from a Hugging Face folder, one parameter at a time (on an object store,
    read in place by range requests): each full tensor read is copied into this rank's shard
    of the parameter, then the model loads its state dict through its own ``load_state_dict``
    (as a DCP load does: a model whose state-dict hooks reshape names, as TorchTitan's fused
    QKV projection, gets them as it expects). Every parameter must be in the folder."""
    location = store.location(name)
    if hf is None:
        raise CheckpointError(
            f"{location} is a Hugging Face folder; loading it needs hf_model=HFModel(...)"
        )
    live = model.state_dict()
    done: set[str] = set()
    with store.view(name) as view:
        for hf_name, ours, tensor in hf.read_model(view):
            if ours not in live:  # another TorchTitan spelling of the same parameter
                ours = other_spellings([ours], set(live)).get(ours, ours)
            target = live.get(ours)
            if target is None:
                raise CheckpointError(
                    f"{location}: {hf_name} maps to {ours}, which this model lacks"
                )
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"{location}: {hf_name} has shape {list(tensor.shape)} where this model's "
                    f"{ours} has {list(target.shape)}"
                )
            with torch.no_grad():
                if isinstance(target, DTensor):
                    local = distribute_tensor(
                        tensor, target.device_mesh, target.placements, src_data_rank=None
                    ).to_local()
                    target.to_local().copy_(local)
                else:
                    target.copy_(tensor)
            done.add(ours)
    missing = sorted(k for k in live if k not in done)
    if missing:
        shown = _listed(missing)
        raise CheckpointError(
            f"{location} does not hold {len(missing)} of this model's parameters ({shown}); "
            "is it a Hugging Face folder of another model or flavor?"
        )
    model.load_state_dict(live)


_RNG_KEY = re.compile(rf"^{RNG}\.rank_(\d+)(\.|$)")
_RNG_FIELD_MAX = 1 << 20  # an RNG state is a few KiB; a larger one is not an RNG state


def _rng_template(metadata: Any, rank: int, location: str) -> Any:
    """What to load saved rank ``rank``'s RNG state into: its fields (tensors of the saved
    shapes), or the single value of dcpkit 0.1's pickled blob."""
    prefix = f"{RNG}.{rank_key(rank)}"
    fields: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key == prefix:
            return b""  # dcpkit 0.1: one pickled blob
        if not key.startswith(prefix + "."):
            continue
        if isinstance(md, TensorStorageMetadata):
            nbytes = md.properties.dtype.itemsize * math.prod(int(s) for s in md.size)
            if min(md.size, default=0) < 0 or nbytes > _RNG_FIELD_MAX:
                raise CheckpointError(f"{location}: {key} is not an RNG state ({list(md.size)})")
            fields[key[len(prefix) + 1 :]] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            fields[key[len(prefix) + 1 :]] = None
    return fields


def _plan_rng(saved: set[str], location: str) -> tuple[int, int] | None:
    saved_ranks = sorted({int(m.group(1)) for k in saved if (m := _RNG_KEY.match(k))})
    if not saved_ranks:
        logger.warning("checkpoint: %s holds no RNG state; RNG streams start fresh", location)
        return None
    saved_world, world = len(saved_ranks), dist.world_size()
    source, offset = rng_source_rank(dist.rank(), saved_world)
    if saved_world != world and dist.rank() == 0:
        logger.warning(
            "checkpoint: RNG saved by %d ranks, restored on %d: rank r takes saved rank r %% %d%s",
            saved_world,
            world,
            saved_world,
            "; ranks beyond the saved ones fork that stream (offset r // saved)"
            if world > saved_world
            else "",
        )
    return source, offset
