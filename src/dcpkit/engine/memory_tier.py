"""The memory tier: every ``local_interval`` steps each rank writes its own shard of the full
training state into a node-local folder in shared memory (``/dev/shm``), and, with
``local_replicas = 1``, sends a copy to a partner rank on another node.

A rank's step is a checkpoint of its own: DCP written without collectives (each rank's shards,
with their global offsets), a manifest with checksums, published by rename like a durable step.
It survives the training process, not the node; the partner's replica covers the node. Writing
happens in a background thread after a memory copy (training stalls for the copy only);
replication goes over a gloo group of its own, so it never interleaves with training's
collectives.

Recovery (at start, all ranks): the ranks gather which steps each holds, its own or as a
replica, and take the newest step newer than the durable tier's that is complete for every rank;
a rank without its own copy (a replaced node) receives it from the partner that holds the
replica. At another world size the memory tier is not used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from dcpkit import dist, failpoints
from dcpkit.console import summary
from dcpkit.engine.policy import steps_to_delete
from dcpkit.engine.reading import FailedVerification
from dcpkit.errors import CheckpointError
from dcpkit.integrity import check_files
from dcpkit.layout import MANIFEST, METADATA, METADATA_INDEX, step_name
from dcpkit.manifest import CHECKSUM_ALGORITHM, build_manifest
from dcpkit.storage import open_store

logger = logging.getLogger(__name__)

_HOLDING = re.compile(r"^(rank|replica-of)-\d+$")


def default_folder(durable_root: str) -> str:
    """``/dev/shm/dcpkit-<hash of the durable folder>``: one job's tier, found again by the same
    job after a restart, never shared with a job that checkpoints elsewhere."""
    if ":" not in durable_root:  # a local folder, named the same whatever the working directory
        durable_root = os.path.abspath(durable_root)
    return f"/dev/shm/dcpkit-{hashlib.sha1(durable_root.encode()).hexdigest()[:12]}"


def holding_names(root: str | Path) -> list[str]:
    """The ``rank-K`` and ``replica-of-K`` folders under a memory-tier folder."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if _HOLDING.match(p.name) and p.is_dir())


class Staging:
    """Buffers that hold a snapshot of the state while the background writer writes it:
    allocated at the first save, then refilled in place (no allocation, no page faults), as long
    as the shapes stay the same. DTensors stay DTensors around a buffer of their local shard."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def copy(self, value: Any, path: str = "") -> Any:
        if isinstance(value, DTensor):
            local = self._fill(path, value.to_local())
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if torch.is_tensor(value):
            return self._fill(path, value)
        if isinstance(value, dict):
            return {k: self.copy(v, f"{path}/{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [self.copy(v, f"{path}/{i}") for i, v in enumerate(value)]
        return value

    def _fill(self, path: str, tensor: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(path)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = self.buffers[path] = torch.empty_like(tensor, device="cpu")
        buf.copy_(tensor.detach())
        return buf


class MemoryTier:
    """This rank's memory-tier folder, its partner, and the background writer."""

    def __init__(self, config: Any, durable_root: str) -> None:
        self.rank, self.world = dist.rank(), dist.world_size()
        self.root = Path(config.local_folder or default_folder(durable_root))
        self.interval = config.local_interval
        self.keep = config.local_keep
        self.own = open_store(str(self.root / f"rank-{self.rank}"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        stride = local_world if self.world > local_world else 1
        self.replicate = config.local_replicas > 0 and self.world > 1
        self.partner = (self.rank + stride) % self.world
        self.source = (self.rank - stride) % self.world
        self.held = open_store(str(self.root / f"replica-of-{self.source}"))
        for store in (self.own, self.held):
            store.remove_incomplete()  # a write a crash interrupted
        if self.replicate and stride == 1 and self.rank == 0 and local_world > 1:
            logger.warning(
                "checkpoint: memory tier: every rank is on one node; the replicas survive a "
                "process's loss, not the node's"
            )
        # A group of its own (every rank creates it, in the same order): replication never
        # interleaves with training's collectives.
        self.group = torch_dist.new_group(backend="gloo") if dist.is_dist() else None
        self.staging = Staging()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_stall_s = 0.0
        self._checksums: dict[str, str] = {}  # of the step recover() chose, its data files

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    # --- saving ----------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], groups: list[str], mesh: Any) -> float:
        """Copy ``state`` and write it in the background; returns the seconds training waited
        (the previous write, if still running, then the copy)."""
        start = time.perf_counter()
        self.wait()
        staged = self.staging.copy(state)
        self._thread = threading.Thread(
            target=self._write, args=(step, staged, groups, mesh), daemon=True, name="dcpkit-mem"
        )
        self._thread.start()
        self.last_stall_s = time.perf_counter() - start
        return self.last_stall_s

    def wait(self) -> None:
        """Block until the background write (and replication) is done; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"memory tier: {error}") from error

    def _write(self, step: int, staged: dict[str, Any], groups: list[str], mesh: Any) -> None:
        ok = False
        try:
            pending = self.own.begin(step_name(step), step)
            pending.prepare()
            with dist.quiet_single_process():
                dcp.save(staged, storage_writer=pending.dcp_writer(), no_dist=True)
            failpoints.hit("local_write", step, self.rank)
            files = pending.describe(pending.local_files())
            pending.write_manifest(
                build_manifest(step, self.world, groups, files, mesh=mesh, source="memory")
            )
            pending.publish()
            _retain(self.own, self.keep)
            ok = True
        except BaseException as e:  # reported by wait(); the replication below still runs
            self._error = e
        if self.replicate:
            try:
                self._replicate(step if ok else None)
            except BaseException as e:
                self._error = self._error or e

    def _replicate(self, step: int | None) -> None:
        """Send this rank's step to the partner, receive the source's into ``held``."""
        outgoing = _pack(self.own, step_name(step)) if step is not None else b""
        incoming = _exchange(outgoing, self.partner, self.source, self.group)
        if incoming:
            _unpack(self.held, incoming)
            _retain(self.held, self.keep)

    # --- recovery --------------------------------------------------------------------------------

    def holdings(self) -> dict[str, Any]:
        """``{"rank-K" | "replica-of-K": [steps]}`` in this node's folder, whatever rank wrote
        them (a restarted job may give this node other ranks), written at this world size; and
        under ``"other_worlds"`` the world sizes of steps left out."""
        out: dict[str, Any] = {"other_worlds": set()}
        for name in holding_names(self.root):
            entry = self.root / name
            store, steps = open_store(str(entry)), []
            for s in store.published_steps():
                manifest, _ = store.read_manifest(step_name(s))
                world = (manifest or {}).get("world_size")
                if world == self.world:
                    steps.append(s)
                else:
                    out["other_worlds"].add(world)
            out[entry.name] = steps
        return out

    def recover(self, durable_latest: int | None) -> int | None:
        """A collective: the newest step complete in memory for every rank and newer than
        ``durable_latest``, with this rank's own copy in place; None to use the durable tier."""
        table = dist.all_gather_object(self.holdings())
        others = sorted(w for held in table for w in held.pop("other_worlds") if w)
        if others and self.rank == 0:
            logger.info(
                "checkpoint: memory tier steps written at world size %s are not used at world "
                "size %d (a memory-tier restore needs the same ranks); the durable tier reshards",
                sorted(set(others)),
                self.world,
            )
        where: dict[tuple[int, int], list[tuple[int, str]]] = {}  # (rank, step) -> holders
        for q, held in enumerate(table):
            for entry, steps in held.items():
                owner = int(entry.rsplit("-", 1)[1])
                for s in steps:
                    where.setdefault((owner, s), []).append((q, entry))
        candidates = sorted({s for _, s in where}, reverse=True)
        newer = [s for s in candidates if durable_latest is None or s > durable_latest]
        chosen = next((s for s in newer if all((r, s) in where for r in range(self.world))), None)
        if chosen is None:
            if candidates and self.rank == 0:
                logger.info(
                    "checkpoint: memory tier holds steps %s, none newer than the durable tier's "
                    "(%s) and complete on every rank: using the durable tier",
                    sorted(set(candidates)),
                    durable_latest,
                )
            return None
        name = step_name(chosen)
        fetched = []
        for r in range(self.world):  # every rank in the same order: sends and receives pair up
            holders = where[(r, chosen)]
            if (r, f"rank-{r}") in holders:
                continue  # its own copy, in place
            q, entry = next(((q, e) for q, e in holders if q == r), holders[0])
            fetched.append(r)
            if q == r == self.rank:  # on this node already, under another name
                _unpack(self.own, _pack(open_store(str(self.root / entry)), name))
            elif self.rank == q:
                _send(_pack(open_store(str(self.root / entry)), name), r, self.group)
            elif self.rank == r:
                _unpack(self.own, _recv(q, self.group))
        # this rank's files (a rank's step holds its own shards only): every size, and the
        # checksums of what is parsed before the data; the data's as the load reads it (load())
        manifest, problems = self.own.read_manifest(name)
        if manifest is not None:
            problems = check_files(self.own, name, manifest, names=[METADATA, METADATA_INDEX])
            self._checksums = {
                n: e[CHECKSUM_ALGORITHM]
                for n, e in manifest["files"].items()
                if n not in (METADATA, METADATA_INDEX) and isinstance(e, dict)
                and isinstance(e.get(CHECKSUM_ALGORITHM), str)
            }  # fmt: skip
        bad = dist.all_gather_object(str(problems[0]) if problems else None)
        if any(bad):
            if self.rank == 0:
                logger.warning(
                    "checkpoint: memory tier step %d failed verification (%s): using the "
                    "durable tier",
                    chosen,
                    next(b for b in bad if b),
                )
            return None
        if self.rank == 0:
            logger.info(
                "checkpoint: memory tier: step %d (durable tier: %s); ranks %s from their own "
                "memory, %s from their peers' replicas",
                chosen,
                durable_latest,
                [r for r in range(self.world) if r not in fetched],
                fetched or "none",
            )
        return chosen

    def load(
        self, durable_latest: int | None, durable: str | None, restore: Callable[..., list[str]]
    ) -> int | None:
        """A collective: ``restore`` (the manager's) the step ``recover`` chose, each rank its
        copy, its data checksummed as it is read. None: use the durable tier (nothing newer
        here, or a copy failed its checksums: the durable load overwrites it); with no durable
        checkpoint (``durable`` None) a failed copy is an error, the live state partly loaded."""
        step = self.recover(durable_latest)
        if step is None:
            return None
        start, failed = time.perf_counter(), None
        try:
            loaded = restore(self.own, step_name(step), False, own_rank=True,
                             checksums=self._checksums)  # fmt: skip
        except Exception as e:  # any rank's failure, every rank's decision: none waits alone
            why = e.problems[0] if isinstance(e, FailedVerification) else f"{type(e).__name__}: {e}"
            loaded, failed = [], f"rank {self.rank}: {why}"
        bad = [b for b in dist.all_gather_object(failed) if b]
        if not bad:
            summary(logger, f"checkpoint: loaded step {step} from the memory tier "
                    f"({', '.join(loaded)}) in {time.perf_counter() - start:.2f}s")  # fmt: skip
            return step
        if durable is None:
            raise CheckpointError(
                f"checkpoint: memory tier step {step} failed verification as it was loaded "
                f"({bad[0]}) and there is no durable checkpoint to load instead: the live state "
                f"is partly overwritten. Remove the memory tier ({self.root}) to start afresh."
            )
        if self.rank == 0:
            why = "failed verification as it was loaded"
            logger.warning("checkpoint: memory tier step %d %s (%s): loading the durable tier's "
                           "%s instead", step, why, bad[0], durable)  # fmt: skip
        return None

    def close(self) -> None:
        self.wait()


def _retain(store: Any, keep: int) -> None:
    for s in steps_to_delete(store.published_steps(), keep):
        store.delete(step_name(s))


# --- moving a step between ranks -----------------------------------------------------------------


def _pack(store: Any, name: str) -> bytes:
    """Every file of step ``name`` as one buffer: a JSON header line, then the bytes."""
    files = {n: store.read_bytes(f"{name}/{n}") for n in store.list_names(name)}
    header = json.dumps({"name": name, "files": {n: len(b) for n, b in files.items()}})
    return header.encode() + b"\n" + b"".join(files.values())


_FILE_NAME = re.compile(r"^(\.metadata|dcpkit\.json|__\d+_\d+\.distcp)$")


def _unpack(store: Any, data: bytes) -> None:
    """Write a packed step into ``store`` and publish it (the manifest travels with it)."""
    end = data.index(b"\n")
    header = json.loads(data[:end])
    name, sizes = header["name"], header["files"]
    pending = store.begin(name, int(name.split("-")[-1]))
    pending.prepare()
    offset, folder = end + 1, pending.scratch()
    for n, size in sizes.items():
        if not _FILE_NAME.match(n):
            raise CheckpointError(f"memory tier: a peer sent a file named {n!r}")
        (folder / n).write_bytes(data[offset : offset + size])
        offset += size
    if MANIFEST not in sizes:
        raise CheckpointError(f"memory tier: {name} from a peer has no manifest")
    pending.publish()


def _as_tensor(data: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def _exchange(outgoing: bytes, to: int, frm: int, group: Any) -> bytes:
    """Send ``outgoing`` to rank ``to`` while receiving from rank ``frm`` (both may be one)."""
    size_out = torch.tensor([len(outgoing)], dtype=torch.int64)
    size_in = torch.zeros(1, dtype=torch.int64)
    reqs = [
        torch_dist.isend(size_out, to, group=group),
        torch_dist.irecv(size_in, frm, group=group),
    ]
    for r in reqs:
        r.wait()
    buf_in = torch.empty(int(size_in.item()), dtype=torch.uint8)
    reqs = []
    if outgoing:
        reqs.append(torch_dist.isend(_as_tensor(outgoing), to, group=group))
    if buf_in.numel():
        reqs.append(torch_dist.irecv(buf_in, frm, group=group))
    for r in reqs:
        r.wait()
    return buf_in.numpy().tobytes()


def _send(data: bytes, to: int, group: Any) -> None:
    torch_dist.send(torch.tensor([len(data)], dtype=torch.int64), to, group=group)
    torch_dist.send(_as_tensor(data), to, group=group)


def _recv(frm: int, group: Any) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    torch_dist.recv(size, frm, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    torch_dist.recv(buf, frm, group=group)
    return buf.numpy().tobytes()
