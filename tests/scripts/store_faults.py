"""Under torchrun: one rank's Nth storage operation fails with ConnectionError (as an object
store that stops answering), for every N until the operation completes; the other ranks'
operations never fail. Each rank prints, for each way in and each failing rank, one line
``RESULT {json}``: each attempt's outcome on every rank, and the operation that failed.

    store_faults.py FOLDER MODES FAIL_RANKS     # MODES: "save,load,...", FAIL_RANKS: "0,1"

The ways in (MODES):
- ``save``, ``save-async`` (written by a background thread): step 1 is saved, then each attempt
  saves the next step (``keep_latest_k`` 2: its retention runs too); ``save-first``: the same,
  each by a new manager (its first save takes the folder's lease);
- ``load``, ``load-unverified`` (``verify_on_load`` off), ``load-fallback`` (the latest step
  corrupt, ``fallback_on_corruption`` on: the load falls back to step 1): each attempt loads
  into a new manager;
- ``load_from`` (a run's ``latest``), ``verify`` (step 1): the same, through those calls.

Once an attempt completes, the last failure is made again with ``storage_retry_s`` 5: the
operation must try again and complete. The operations counted are the store's (list, stat,
read, checksum, write, remove, publish), a load's opening of each data file (a failure there is
the store's, never a corrupt step: ``load-fallback`` must not fall back on it) and DCP's writes,
made by the training thread, the background writer or a load's reading threads; the hold
against retention (best effort by design: a reader that cannot hold its step reads it without
one) is left alone. Every collective has a deadline: a rank
left waiting for another fails the run instead of hanging it.
"""

import dataclasses
import datetime
import hashlib
import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.fsdp import fully_shard

from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager, dist
from dcpkit.engine.async_save import AsyncSaveError
from dcpkit.formats.dcp_reader import LocalFiles
from dcpkit.storage.local import LocalPending, LocalStore, StepFileWriter

OPERATIONS = {
    LocalStore: ("list_names", "stat", "open_read", "checksum", "write_bytes", "remove", "delete"),
    LocalFiles: ("open",),  # a load's data files, read by its reading threads
    LocalPending: ("prepare", "own_files", "describe", "write_manifest", "write_file", "_commit"),
    StepFileWriter: ("write_data",),
}
calls = {"n": 0, "fail_at": 0, "failed": "", "rank": -1}
# The readers' holds and their records, read as markers (a failed read is no record): not armed.
MARKERS = ("dcpkit.storage.holds.", "dcpkit.storage.markers.read_record")
MARKERS += ("dcpkit.storage.markers.readable",)


THREADS = ("dcpkit-writer", "dcpkit-read")  # besides the training thread


def callers() -> list[str]:
    """The functions of dcpkit that led to the operation, innermost first."""
    names, frame = [], sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("dcpkit."):
            names.append(f"{frame.f_globals['__name__']}.{frame.f_code.co_name}")
        frame = frame.f_back
    return names


def inject() -> None:
    for cls, names in OPERATIONS.items():
        for name in names:
            original = getattr(cls, name)

            def failing(self, *args, _original=original, _name=name, **kwargs):  # type: ignore[no-untyped-def]
                thread = threading.current_thread()
                if thread is threading.main_thread() or thread.name.startswith(THREADS):
                    chain = callers()
                    if not any(c.startswith(MARKERS) for c in chain):
                        calls["n"] += 1
                        if calls["n"] == calls["fail_at"] and dist.rank() == calls["rank"]:
                            calls["failed"] = f"{_name} in {' < '.join(chain)}"
                            raise ConnectionError(f"the store stopped answering ({_name})")
                return _original(self, *args, **kwargs)

            setattr(cls, name, failing)


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(2)))
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def state_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.to_local().detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def fresh(mode: str) -> bool:
    """Whether each attempt is made by a manager of its own (else by the one that saved)."""
    return mode == "save-first" or not mode.startswith("save")


def attempt(cfg: CheckpointConfig, mode: str, saver: Any, step: int, fail_at: int) -> tuple:
    """One save or load with the failure armed at ``fail_at``: (outcome, the loaded state's
    hash). A manager of its own is built before the failure is armed."""
    model = build(1)
    mgr = CheckpointManager(cfg, ".", model) if fresh(mode) else saver
    calls.update(n=0, failed="", fail_at=fail_at)
    loaded = None
    try:
        if mode.startswith("save"):
            mgr.save(step)
            mgr.wait()  # a background save's failure is raised here
        elif mode == "load_from":
            mgr.load_from(cfg.folder, step="latest")
        elif mode == "verify":
            problems = mgr.verify(cfg.folder, step=1)
            assert problems == [], problems
        else:
            assert mgr.load() == 1
        loaded = state_hash(model)
        outcome = ["ok", ""]
    except (CheckpointError, AsyncSaveError) as e:  # StoreUnavailable, a load's, is one
        outcome = [type(e).__name__, str(e)]
    except Exception as e:  # a store error raised outside the ranks' agreement
        outcome = ["raw", f"{type(e).__name__}: {e}"]
    calls["fail_at"] = 0
    if fresh(mode):
        mgr.close()
    return outcome, loaded


def sweep(folder: str, mode: str, fail_rank: int) -> dict:
    cfg = CheckpointConfig(
        enable=True, folder=folder, interval=1, keep_latest_k=2, storage_retry_s=0,
        verify_on_load=mode != "load-unverified", fallback_on_corruption=mode == "load-fallback",
        async_mode="async" if mode == "save-async" else "disabled",
    )  # fmt: skip
    original = build(0)
    saver = CheckpointManager(cfg, ".", original)
    saver.save(1)
    saver.wait()
    saved = state_hash(original)
    if mode == "load-fallback":  # step 2, whose data is then damaged
        with torch.no_grad():
            for p in original.parameters():
                p.add_(1.0)
        saver.save(2)
        if dist.rank() == 0:
            data = Path(folder) / "step-2" / "__0_0.distcp"
            data.write_bytes(data.read_bytes()[:-8] + bytes(8))
        dist.barrier()
    if fresh(mode):
        saver.close()
    calls["rank"] = fail_rank
    outcomes, step, loaded = [], 1, None
    for fail_at in range(1, 400):  # until an attempt completes
        step += 1
        outcome, loaded = attempt(cfg, mode, saver, step, fail_at)
        gathered = dist.all_gather_object((outcome, calls["failed"]))
        outcomes.append([fail_at, [o for o, _ in gathered], gathered[fail_rank][1]])
        if all(o[0] == "ok" for o, _ in gathered):
            break
    failures = [fail_at for fail_at, outcome, _ in outcomes if outcome[0][0] != "ok"]
    step += 1  # the last failure again, within storage_retry_s: tried again, it completes
    retry_cfg = dataclasses.replace(cfg, storage_retry_s=5)
    saver.config = retry_cfg
    retried, _ = attempt(retry_cfg, mode, saver, step, failures[-1] if failures else 0)
    retried_after = dist.all_gather_object(calls["failed"])[fail_rank]
    if mode.startswith("save"):  # one more, the store answering: its retention deletes
        step += 1
        final = CheckpointManager(cfg, ".", build(1)) if fresh(mode) else saver
        final.save(step)
        final.close()  # rank 0's deletions done
    dist.barrier()
    return {
        "mode": mode, "rank": dist.rank(), "fail_rank": fail_rank, "outcomes": outcomes,
        "retried": [retried, retried_after], "published": saver.published_steps(),
        "last": step, "saved": saved, "loaded": loaded,
    }  # fmt: skip


def main() -> None:
    folder, modes, fail_ranks = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
    torch_dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    inject()
    for mode in modes:
        for fail_rank in map(int, fail_ranks):
            line = sweep(f"{folder}/{mode}-{fail_rank}", mode, fail_rank)
            sys.stdout.write("RESULT " + json.dumps(line) + "\n")  # one write: lines never mix
    torch_dist.barrier()
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
