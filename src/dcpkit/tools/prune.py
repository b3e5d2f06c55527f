"""``dcpkit prune``: what a run's retention left to readers that are gone, deleted now.

Retention never deletes a step a reader holds: it records its decision
(``.dcpkit-holds/kept-step-N.json``) and the last reader to let go deletes the step, or the run's
next save does. A reader killed outright never lets go; once its hold has expired, the run's next
save deletes the step, but a run that has ended saves no more. ``prune`` acts on retention's own
records only, as a reader letting go would: a step whose record names it, is not the folder's
newest step, and is held by no live reader is deleted; a step still held is left, naming its
readers. It also removes the hold files of readers whose holds expired (they hold nothing) and
deleters' markers left by a deleter that died. It never judges a step by its age or its number:
a step without retention's record, or with a record that is not one, is left alone.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcpkit.layout import parse_step, step_name
from dcpkit.readers import steps_folder
from dcpkit.storage.holds import (
    DELETING,
    HOLD_PREFIX,
    HOLDS,
    KEPT,
    STALE_DELETING_S,
    alive,
    covers,
    delete_unless_held,
    describe,
    not_a_decision,
)
from dcpkit.storage.markers import read_record


@dataclass
class Kept:
    """A step retention kept for readers: its decision and the holds now covering it."""

    step: int
    decision: dict[str, Any]
    holders: list[dict[str, Any]]
    gone: list[dict[str, Any]] = field(default_factory=list)
    """The records of the readers it was kept for whose holds have expired."""

    def status(self, folder: str) -> str:
        """What ``list`` says of the step."""
        if self.holders:
            who = "; ".join(describe(h) for h in self.holders)
            return f"held by {len(self.holders)} reader(s): {who}; kept past retention for them"
        why = "its reader's hold expired"
        if self.gone:
            last = max(float(h.get("heartbeat") or 0) for h in self.gone)
            expires = max(float(h.get("expires_s") or 0) for h in self.gone)
            ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last + expires))
            why += f" at {ended} ({describe(self.gone[0])})"
        return (
            f"kept past retention for a reader; {why}: the run's next save or "
            f"`dcpkit prune {folder}` deletes it"
        )


def kept_steps(store: Any) -> dict[int, Kept]:
    """``{step: Kept}`` for each published step (but the newest) that retention's own record
    says it kept for readers; records that are not retention's decisions are left out."""
    names = store.list_names(HOLDS)
    kept = [n for n in names if n.startswith(KEPT) and n.endswith(".json")]
    if not kept:
        return {}
    published = store.published_steps()
    newest = max(published, default=None)
    holds, now = _holds(store, names), time.time()
    found = {}
    for name in kept:
        step = parse_step(name.removeprefix(KEPT).removesuffix(".json"))
        if step is None or step not in published or not_a_decision(store, name, step, newest):
            continue
        decision = read_record(store, f"{HOLDS}/{name}") or {}
        ids = decision.get("held_by") if isinstance(decision.get("held_by"), list) else []
        mine = [h for h in holds if covers(h, step)]
        live = [h for h in mine if alive(h, now)]
        gone = [h for h in holds if h.get("id") in ids and not alive(h, now)]
        found[step] = Kept(step, decision, live, gone)
    return found


def _holds(store: Any, names: list[str]) -> list[dict[str, Any]]:
    found = []
    for name in names:
        if name.startswith(HOLD_PREFIX) and name.endswith(".json"):
            record = read_record(store, f"{HOLDS}/{name}")
            if record is not None:
                found.append({**record, "_file": name})
    return found


@dataclass
class Pruned:
    folder: str
    deleted: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    """Steps retention kept that live readers still hold, with their readers."""
    removed: list[str] = field(default_factory=list)
    """Markers removed: expired holds, deleters' markers left by a dead deleter."""

    def lines(self) -> list[str]:
        out = [f"deleted {self.folder}/{name}, kept by retention for a reader now gone"
               for name in self.deleted]  # fmt: skip
        out += [f"kept {line}" for line in self.held]
        out += [f"removed {self.folder}/{HOLDS}/{name}" for name in self.removed]
        return out or [f"{self.folder}: nothing to prune"]


def prune(folder: str | Path, storage_options: dict[str, Any] | None = None) -> Pruned:
    """Delete the steps of ``folder`` that retention kept for readers who are gone, and the
    markers of dead readers and deleters (see the module's text)."""
    store = steps_folder(folder, storage_options)
    store.check_reachable()
    st = store.stat("")
    if st is None or not st.is_dir:
        raise ValueError(f"{store.root} is no folder; pass a checkpoint folder or a run's folder")
    pruned = Pruned(store.root)
    for step, kept in sorted(kept_steps(store).items()):
        if kept.holders:
            pruned.held.append(f"{step_name(step)}: {kept.status(store.root)}")
        elif not delete_unless_held(store, step, store.delete):
            pruned.deleted.append(step_name(step))
    now = time.time()
    names = store.list_names(HOLDS)
    for record in _holds(store, names):
        if not alive(record, now):
            store.remove(f"{HOLDS}/{record['_file']}")
            pruned.removed.append(record["_file"])
    for name in names:
        if name.startswith(DELETING) and name.endswith(".json"):
            record = read_record(store, f"{HOLDS}/{name}") or {}
            started = record.get("started")
            if isinstance(started, int | float) and now - started > STALE_DELETING_S:
                store.remove(f"{HOLDS}/{name}")
                pruned.removed.append(name)
    store.remove_empty_folder(HOLDS)
    return pruned


def command(args: argparse.Namespace) -> int:
    print("\n".join(prune(args.folder).lines()))
    return 0
