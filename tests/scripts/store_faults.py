"""Under torchrun: one rank's Nth storage operation fails with ConnectionError (as an object
store that stops answering), for every N until the operation completes; the other ranks'
operations never fail. Each rank prints, for each failing rank, one line ``RESULT {json}``: each
attempt's outcome on every rank, and the operation that failed.

    store_faults.py FOLDER save|load FAIL_RANKS     # FAIL_RANKS: "0,1", each in turn

``save``: step 1 is saved, then each attempt saves the next step (``keep_latest_k`` 2: its
retention runs too); ``load``: each attempt loads the latest step into a new manager. The
operations counted are the store's (list, stat, read, checksum, write, remove, publish) and
DCP's writes, made by the training thread; the hold against retention (best effort by
design) is left alone. Every collective has a deadline: a rank left waiting for another
fails the run instead of hanging it.
"""

import datetime
import hashlib
import json
import sys
import threading

import torch
import torch.distributed as torch_dist
from torch.distributed.fsdp import fully_shard

from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager, dist
from dcpkit.storage.local import LocalPending, LocalStore, StepFileWriter

OPERATIONS = {
    LocalStore: ("list_names", "stat", "open_read", "checksum", "write_bytes", "remove", "delete"),
    LocalPending: ("prepare", "own_files", "describe", "write_manifest", "write_file", "_commit"),
    StepFileWriter: ("write_data",),
}
calls = {"n": 0, "fail_at": 0, "failed": "", "rank": -1}


def from_holds() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "dcpkit.storage.holds":
            return True
        frame = frame.f_back
    return False


def callers() -> str:
    """The functions of dcpkit that led to the failing operation, innermost first."""
    names, frame = [], sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("dcpkit."):
            names.append(frame.f_code.co_name)
        frame = frame.f_back
    return " < ".join(names)


def state_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.to_local().detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def inject() -> None:
    for cls, names in OPERATIONS.items():
        for name in names:
            original = getattr(cls, name)

            def failing(self, *args, _original=original, _name=name, **kwargs):  # type: ignore[no-untyped-def]
                counted = threading.current_thread() is threading.main_thread()
                if counted and not from_holds():
                    calls["n"] += 1
                    if calls["n"] == calls["fail_at"] and dist.rank() == calls["rank"]:
                        calls["failed"] = f"{_name} in {callers()}"
                        raise ConnectionError(f"the store stopped answering ({_name})")
                return _original(self, *args, **kwargs)

            setattr(cls, name, failing)


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(2)))
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def sweep(folder: str, mode: str, fail_rank: int) -> dict:
    cfg = CheckpointConfig(
        enable=True, folder=folder, interval=1, keep_latest_k=2, storage_retry_s=0
    )
    original = build(0)
    saver = CheckpointManager(cfg, ".", original)
    saver.save(1)
    if mode == "load":
        saver.close()
    expected = CheckpointError  # StoreUnavailable, a load's, is one
    outcomes = []
    saved, loaded, step = state_hash(original), None, 1
    for fail_at in range(1, 400):  # until an attempt completes
        model = build(1)
        mgr = CheckpointManager(cfg, ".", model) if mode == "load" else saver
        calls.update(n=0, fail_at=fail_at, failed="", rank=fail_rank)
        try:
            if mode == "load":
                mgr.load()
                loaded = state_hash(model)
            else:
                step += 1
                mgr.save(step)
            outcome = ["ok", ""]
        except expected as e:
            outcome = [type(e).__name__, str(e)]
        except Exception as e:  # a store error raised outside the ranks' agreement
            outcome = ["raw", f"{type(e).__name__}: {e}"]
        calls["fail_at"] = 0
        if mode == "load":
            mgr.close()
        gathered = dist.all_gather_object((outcome, calls["failed"]))
        outcomes.append([fail_at, [o for o, _ in gathered], gathered[fail_rank][1]])
        if all(o[0] == "ok" for o, _ in gathered):
            break
    if mode == "save":  # one more, the store answering: its retention deletes what is due
        step += 1
        saver.save(step)
        saver.close()  # rank 0's deletions done
    dist.barrier()
    return {
        "rank": dist.rank(), "fail_rank": fail_rank, "outcomes": outcomes,
        "published": saver.published_steps(), "last": step, "saved": saved, "loaded": loaded,
    }  # fmt: skip


def main() -> None:
    folder, mode, fail_ranks = sys.argv[1], sys.argv[2], sys.argv[3]
    torch_dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    inject()
    for fail_rank in map(int, fail_ranks.split(",")):
        line = sweep(f"{folder}/fail-{fail_rank}", mode, fail_rank)
        sys.stdout.write("RESULT " + json.dumps(line) + "\n")  # one write: lines never mix
    torch_dist.barrier()
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
