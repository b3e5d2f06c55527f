"""``dcpkit list``: the checkpoints of a checkpoint folder (local or remote), with their status."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcpkit.integrity import verify_checkpoint
from dcpkit.layout import parse_step
from dcpkit.readers import steps_folder
from dcpkit.storage import StepEntry, open_store
from dcpkit.storage.holds import StepGone, describe, held_steps, hold_step
from dcpkit.tools.prune import kept_steps
from dcpkit.units import human_bytes


class NotAFolder(ValueError):
    """The path is not a folder of checkpoints."""


@dataclass
class Listing:
    root: str
    entries: list[StepEntry]
    memory_root: str | None = None
    """This node's memory-tier folder of the run, when it has one."""
    memory: dict[str, list[int]] | None = None
    """``{"rank-K" | "replica-of-K": [published steps]}`` in that folder."""
    held: int = 0
    """How many of its steps readers hold (retention keeps them until released)."""


def memory_tier(durable_root: str, local_folder: str | None = None) -> tuple[str, dict]:
    """This node's memory-tier folder of the checkpoint folder ``durable_root`` (the default
    location unless ``local_folder``) and the steps each rank's part of it holds."""
    from dcpkit.engine.memory_tier import default_folder, holding_names

    root = local_folder or default_folder(durable_root)
    found = {}
    for name in holding_names(root):
        found[name] = open_store(str(Path(root) / name)).published_steps()
    return root, found


def list_checkpoints(
    folder: str | Path,
    checksums: bool = False,
    storage_options: dict[str, Any] | None = None,
    local_folder: str | None = None,
) -> Listing:
    """Every checkpoint and leftover under ``folder`` (or, for a run's folder such as a
    Trainer's ``output_dir``, under its ``checkpoint`` folder); a published one that fails
    verification (sizes and structure, and with ``checksums`` its checksums) is marked CORRUPT,
    and one that passes says what was verified."""
    store = open_store(folder, storage_options)
    store.check_reachable()
    st = store.stat("")
    if st is None:
        raise NotAFolder(
            f"{store.root} does not exist; pass a checkpoint folder (the one holding step-N)"
        )
    if not st.is_dir:
        raise NotAFolder(
            f"{store.root} is not a folder; pass the folder that holds step-N checkpoints"
        )
    store = steps_folder(folder, storage_options)  # a run's folder: its checkpoint folder
    entries = store.entries()
    held = held_steps(store, [e.step for e in entries if e.published and e.step is not None])
    kept = kept_steps(store)
    checked = "sizes, structure and checksums" if checksums else "sizes and structure"
    for entry in entries:
        if entry.published:
            _verify(store, entry, checksums, checked)
        readers = held.get(entry.step, []) if entry.published else []
        if entry.published and entry.step in kept:  # its readers too, if any live
            entry.status += "; " + kept[entry.step].status(store.root)
        elif readers:
            entry.status += f"; held by {len(readers)} reader(s): " + "; ".join(
                describe(r) for r in readers
            )
    memory_root, memory = memory_tier(store.root, local_folder)
    listing = Listing(store.root, entries, memory_root if memory else None, memory or None)
    listing.held = len(held)
    return listing


def _verify(store: Any, entry: StepEntry, checksums: bool, checked: str) -> None:
    """Verify a published entry, held against the run's retention meanwhile."""
    try:
        step = parse_step(entry.name)
        hold = hold_step(store, step, "list") if step is not None else None
    except StepGone:
        entry.status = "deleted by retention while listed"
        return
    except Exception:  # a folder this reader may not write to: verified without a hold
        hold = None
    try:
        report = verify_checkpoint(store, entry.name, checksums=checksums)
    finally:
        if hold is not None:
            hold.release()
    if not report.ok:
        entry.status = f"CORRUPT ({report.problems[0]})"
    elif report.files_checked:
        entry.status += f"; {checked} verified"
    else:
        entry.status += "; structure verified (no manifest: no sizes or checksums)"


def _human_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def listing_lines(listing: Listing) -> list[str]:
    """What ``dcpkit list`` prints: the durable tier, then this node's memory tier."""
    memory = []
    if listing.memory:
        memory = [f"memory tier on this node ({listing.memory_root}):"]
        for name, steps in sorted(listing.memory.items()):
            shown = ", ".join(map(str, steps)) if steps else "none published"
            memory.append(f"  {name:<16} steps {shown}")
    if not listing.entries:
        return [f"{listing.root}: no checkpoints", *memory]
    now = time.time()
    lines = [f"{'checkpoint':<18} {'step':>8} {'size':>10} {'age':>6}  status"]
    for row in listing.entries:
        step = "" if row.step is None else str(row.step)
        age = _human_age(now - row.mtime) if row.mtime is not None else "-"
        lines.append(f"{row.name:<18} {step:>8} {human_bytes(row.size):>10} {age:>6}  {row.status}")
    if listing.held:
        lines.append(f"{listing.held} step(s) held by readers: retention keeps them until released")
    return lines + memory


def corrupt(listing: Listing) -> list[str]:
    """The published checkpoints of ``listing`` that failed verification."""
    return [e.name for e in listing.entries if e.status.startswith("CORRUPT")]


def command(args: argparse.Namespace) -> int:
    """``dcpkit list``: exit 1 when a published checkpoint fails verification."""
    listing = list_checkpoints(
        args.folder, checksums=args.checksums, local_folder=args.local_folder
    )
    print("\n".join(listing_lines(listing)))
    bad = corrupt(listing)
    if bad:
        print(f"error: {len(bad)} checkpoint(s) failed verification: {', '.join(bad)}; run "
              "`dcpkit verify` on one for every problem", file=sys.stderr)  # fmt: skip
    return 1 if bad else 0
