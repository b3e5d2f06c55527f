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
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from dcpkit import dist
from dcpkit.engine.states import (
    ModelState,
    PerRank,
    Stateful,
    rank_key,
    restore_rng,
    rng_source_rank,
)
from dcpkit.engine.values import fit_to_saved
from dcpkit.errors import CheckpointError, first_failure
from dcpkit.formats.dcp_index import DcpIndex, bound_index
from dcpkit.formats.dcp_reader import DirectFileSystemReader, local_regions
from dcpkit.layout import (
    HF_FILES,
    METADATA,
    METADATA_INDEX,
    MODEL,
    OPTIMIZER,
    RNG,
    is_model_key,
)
from dcpkit.manifest import CHUNK, format_problem
from dcpkit.safe_pickle import UnsafeCheckpoint, safe_load_planner

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
) -> list[str]:
    """Load checkpoint ``name`` of ``store`` into the live state; returns the pieces restored.
    ``checksums``: this rank's share of the files to verify as they are read; a mismatch
    raises :class:`FailedVerification` once every rank has read, with the live state partly
    loaded (load another checkpoint, or stop). ``metadata``: its ``.metadata``, parsed by the
    checks before, not parsed again; ``index``: likewise its index, as the checks read it.
    ``own_rank``: a checkpoint of this rank alone (the memory tier), read without collectives,
    its per-rank values and RNG this rank's own."""
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

    def has_group(group: str) -> bool:
        prefix = group + "."
        return group in saved or any(k.startswith(prefix) for k in saved)

    model_sd = model.state_dict()
    missing = sorted(k for k in model_sd if k not in saved)
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
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
    _load(template, reader, location, gather=not own_rank and dist.is_dist())
    model.load_state_dict({k: template[k] for k in model_sd})
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
        restored.append(RNG)
    return restored


def _load(template: dict[str, Any], reader: Any, location: str, gather: bool) -> None:
    """``dcp.load`` of ``template`` through ``reader``, each rank planning its own reads: a
    load's global plan is every rank's local plan unchanged, so DCP's exchange of the plans
    (pickled, gathered, scattered back) and its barrier after the reads cost time and decide
    nothing. What DCP's collectives did besides is done here in one gather (``gather``): every
    rank fails when one did, and checksum problems found by any rank are reported by all."""
    error = None
    try:
        with dist.quiet_single_process():
            dcp.load(template, storage_reader=reader, planner=safe_load_planner(), no_dist=True)
    except CheckpointException as e:  # a BaseException, wrapping what the rank raised
        error = f"{location}: {first_failure(e)}"
    except UnsafeCheckpoint as e:
        error = f"{location}: {e}"
    problems = [str(p) for p in getattr(reader, "problems", [])]
    outcomes = dist.all_gather_object((error, problems)) if gather else [(error, problems)]
    errors = [(r, e) for r, (e, _) in enumerate(outcomes) if e is not None]
    if errors:
        rank, first = errors[0]
        where = f" (rank {rank})" if gather and rank != dist.rank() else ""
        raise CheckpointError(f"{first}{where}")
    found = sorted({p for _, part in outcomes for p in part})
    if found:
        raise FailedVerification(location, found)


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
    read in place by range requests)."""
    location = store.location(name)
    if hf is None:
        raise CheckpointError(
            f"{location} is a Hugging Face folder; loading it needs hf_model=HFModel(...)"
        )
    wanted = set(model.state_dict())
    options = StateDictOptions(full_state_dict=True, strict=False)
    with store.view(name) as view:
        for hf_name, ours, tensor in hf.read_model(view):
            if ours not in wanted:
                raise CheckpointError(
                    f"{location}: {hf_name} maps to {ours}, which this model lacks"
                )
            for part in model.parts:
                set_model_state_dict(part, {ours: tensor}, options=options)


class FailedVerification(CheckpointError):
    """A load found files of the checkpoint that do not match their manifest checksums."""

    def __init__(self, location: str, problems: list[str]) -> None:
        super().__init__(f"{location} failed verification: {'; '.join(problems[:5])}")
        self.problems = problems


def dcp_reader(
    store: Any,
    name: str,
    checksums: dict[str, str] | None = None,
    metadata: Any = None,
    manifest: Any = None,
    index: DcpIndex | None = None,
) -> tuple[Any, DcpIndex | None]:
    """The reader of checkpoint ``name`` (direct reads into the destination tensors, of local
    files or of remote ones by parallel ranged reads, verifying ``checksums`` as they stream
    through; else the store's own), and the index of its ``.metadata`` to plan from when
    ``manifest`` lists one (``index``: the one the checks read already; a remote one is
    downloaded alone). No index when ``metadata`` (parsed by the checks) is given."""
    folder = store.local_dir(name)
    if metadata is not None:
        index = None
    elif index is None and folder is not None:
        index = bound_index(Path(folder), manifest)
    elif index is None:
        index = _remote_index(store, name, manifest)
    if folder is not None:
        return DirectFileSystemReader(folder, checksums=checksums, metadata=metadata), index
    if (remote := store.remote_files(name)) is not None:  # parallel ranged reads
        files, fs = remote
        return DirectFileSystemReader(files.folder, None, checksums, metadata, files, fs), index
    if checksums:
        raise ValueError(f"{store.location(name)}: this store cannot verify while it loads")
    return store.dcp_reader(name), index


def _remote_index(store: Any, name: str, manifest: Any) -> DcpIndex | None:
    """The index of remote checkpoint ``name``'s ``.metadata`` when its manifest lists one:
    downloaded alone (at most the bytes the manifest gives it) into a temporary folder that
    is removed with the index."""
    listed = ((manifest or {}).get("files") or {}).get(METADATA_INDEX)
    if not isinstance(listed, dict) or not isinstance(listed.get("size"), int):
        return None
    tmp, index = tempfile.TemporaryDirectory(prefix="dcpkit-index-"), None
    try:
        folder, left = Path(tmp.name), listed["size"]
        path = f"{name}/{METADATA_INDEX}"
        with store.open_read(path) as src, open(folder / METADATA_INDEX, "wb") as dst:
            while left > 0 and (block := src.read(min(left, CHUNK))):
                dst.write(block)
                left -= len(block)
        stat = store.stat(f"{name}/{METADATA}")
        index = bound_index(folder, manifest, stat.size if stat is not None else None)
    except FileNotFoundError:  # listed but missing: the manifest check reports it
        index = None
    finally:
        if index is None:
            tmp.cleanup()
        else:
            weakref.finalize(index, tmp.cleanup)
    return index


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
