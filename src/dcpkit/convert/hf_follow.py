"""``dcpkit to-hf RUN OUT --follow``: export each step a run publishes, as it is published, one
Hugging Face folder per step (``OUT/step-N``, with the run's tokenizer when its folder has
one), until the run finishes. The steps not yet
exported are held (see ``storage.follow``), so retention never deletes one first. A step whose
folder is already in ``OUT`` (an earlier follow) is not exported again."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcpkit.console import summary
from dcpkit.convert.adapters import ConversionError
from dcpkit.convert.hf import ConversionResult, to_hf
from dcpkit.errors import CorruptCheckpoint, describe_error
from dcpkit.formats.dcp import NotACheckpoint
from dcpkit.layout import TEMP_PREFIX, parse_step
from dcpkit.readers import follow
from dcpkit.storage import open_store
from dcpkit.storage.opening import local_path

logger = logging.getLogger(__name__)


def run_tokenizer(checkpoint_folder: Any) -> str | None:
    """The tokenizer.json of the run whose checkpoint folder this is (in the run's folder, as
    the reference trainer writes it), or None: a local folder only."""
    folder = local_path(checkpoint_folder)
    found = folder.parent / "tokenizer.json" if folder is not None else None
    return str(found) if found is not None and found.is_file() else None


def to_hf_following(
    run: str | Path,
    out: str | Path,
    *,
    storage_options: dict[str, Any] | None = None,
    poll_s: float = 1.0,
    wait_s: float | None = None,
    on_result: Callable[[str, ConversionResult], None] | None = None,
    **to_hf_options: Any,
) -> dict[str, ConversionResult]:
    """Export every step of the run saving into ``run`` to ``out/step-N`` (``to_hf_options``:
    those of ``to_hf``, applied to each), in order, until the run finishes. Returns the exports
    made, by step name; ``on_result(name, result)`` is called after each. A step that cannot be
    exported (refused as corrupt, or no model to export) is said and passed over; once the run has
    finished, ``CorruptCheckpoint`` names every such step."""
    outputs = open_store(out, storage_options)
    for name in outputs.incomplete_names():  # an export a killed follower left half-written
        if not name.startswith(TEMP_PREFIX):  # only what an export writes before it renames
            continue
        summary(logger, f"to-hf: removing {outputs.location(name)}, left by an interrupted export")
        outputs.remove(name)
    exported = [s for s in map(parse_step, outputs.list_names()) if s is not None]
    done: dict[str, ConversionResult] = {}
    failed: dict[str, str] = {}  # a step whose folder cannot be exported, and why
    steps = follow(run, storage_options, purpose="to-hf --follow", poll_s=poll_s, wait_s=wait_s)
    for held in steps:
        step = parse_step(held.name)
        # the first step newer than OUT's: a gap before it is one no follower can fill now
        if exported and step is not None and step > max(exported) + 1:
            held.notes.append(
                f"{outputs.location()}'s newest export is step-{max(exported)} and the run's "
                f"next step is step-{step}: any step saved between them was deleted by the run's "
                "retention while no follower held it, and is not exported"
            )
            summary(logger, f"to-hf: note: {held.notes[-1]}")
        exported = exported if step is None or step <= max(exported, default=-1) else []
        if outputs.exists(held.name) and outputs.list_names(held.name):
            summary(logger, f"to-hf: {outputs.location(held.name)} exists: exported before")
            continue
        options = dict(to_hf_options)
        if options.get("tokenizer") is None:  # the run's own, as a Trainer's checkpoint has it
            options["tokenizer"] = run_tokenizer(held.store.root)
        try:
            result = to_hf(
                held.location, outputs.location(held.name), storage_options=storage_options,
                **options,
            )  # fmt: skip
        except (CorruptCheckpoint, ConversionError, NotACheckpoint) as e:  # the step's own fault
            failed[held.name] = describe_error(e)
            summary(logger, f"to-hf: could not export {held.name}: {failed[held.name]}")
            continue  # the run's later steps are exported all the same
        result.notes += held.notes
        done[held.name] = result
        if on_result is not None:
            on_result(held.name, result)
    if failed:
        raise CorruptCheckpoint(
            f"to-hf --follow exported {len(done)} step(s) and could not export "
            f"{len(failed)}: " + "; ".join(f"{name}: {why}" for name, why in failed.items())
        )
    return done
