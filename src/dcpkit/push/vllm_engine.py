"""dcpkit's weight transport inside a vLLM engine: a ``WeightTransferEngine`` that receives a
push over gloo (CPU, or any machine without NCCL), registered as ``dcpkit_gloo`` by the plugin
entry point dcpkit installs (``vllm.general_plugins``), so a server started with
``--weight-transfer-config '{"backend": "dcpkit_gloo"}'`` takes pushes with no code of its own.

A push never leaves the engine with a mix of two versions: the buckets are received beside the
model while the engine keeps serving its weights, and only a push that arrived whole (every
bucket, in order, the count the trainer announced) is loaded, at ``finish_weight_update``.
A push that breaks off (the trainer died, a bucket was lost) is dropped, at its next bucket or
at the ``finish_weight_update`` that ends its session; the model keeps the version it had.
The price: the engine holds one copy of the weights in host memory beside its model, kept
from push to push (memory faulted in anew at every push costs more than the transfer).
This module imports vLLM: it is loaded only inside an engine."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from dcpkit.push.wire import BACKEND, broadcast, entries_from, open_group, unpack

logger = logging.getLogger(__name__)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's rendezvous is, and this engine's place in the push's group."""

    host: str
    port: int
    world_size: int
    rank_offset: int = 1
    session: str = ""
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One bucket announced (``wire.message``), or the end of a push (``end``, ``count``)."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    nbytes: int = 0
    bucket: int = 0
    version: str = ""
    end: bool = False
    count: int = 0


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives a push's buckets over gloo and swaps the whole version in at its end."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.buffers: list[torch.Tensor] = []
        self._reset()

    def _reset(self) -> None:
        if getattr(self, "staged", None):
            logger.warning("%s: dropped the %d tensors of version %r, a push that broke off; "
                           "the engine keeps the weights it had", BACKEND, len(self.staged),
                           self.version)  # fmt: skip
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.next_bucket, self.complete, self.version = 0, False, ""

    def _bucket(self, index: int, nbytes: int) -> torch.Tensor:
        """Bucket ``index``'s memory, kept from push to push (faulted in once)."""
        while len(self.buffers) <= index:
            self.buffers.append(torch.empty(0, dtype=torch.uint8))
        if self.buffers[index].numel() < nbytes:
            self.buffers[index] = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffers[index][:nbytes]

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a trainer that comes back opens a new group
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.group = open_group(init_info.host, init_info.port, rank, init_info.world_size,
                                init_info.session, init_info.timeout_s)  # fmt: skip

    def start_weight_update(self) -> None:
        self._reset()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(f"{BACKEND}: init_weight_transfer_engine was not called")
        info = update_info
        try:
            if info.bucket != self.next_bucket or (self.version and info.version != self.version):
                raise RuntimeError(
                    f"{BACKEND}: bucket {info.bucket} of version {info.version!r} arrived where "
                    f"bucket {self.next_bucket} of {self.version or 'a new version'!r} was due"
                )
            self.version, self.next_bucket = info.version, info.bucket + 1
            if info.end:
                if info.count != len(self.staged):
                    got = len(self.staged)
                    raise RuntimeError(f"{BACKEND}: version {info.version!r} announced "
                                       f"{info.count} tensors, {got} arrived")  # fmt: skip
                self.complete = True
                return
            entries = entries_from(
                {"names": info.names, "dtype_names": info.dtype_names, "shapes": info.shapes}
            )
            self._check_size(info, entries)  # before any memory is taken for it
            buffer = self._bucket(info.bucket, info.nbytes)
            broadcast(self.group, buffer).wait()
            self.staged.extend(unpack(buffer, entries))
        except BaseException:
            self._reset()  # what arrived of this version is dropped; the model is untouched
            raise

    def _check_size(self, info: GlooUpdateInfo, entries: list[Any]) -> None:
        """A bucket's bytes are its tensors', and fit in the memory the machine can give: a
        message that claims more is refused before anything is allocated for it."""
        if any(d < 0 for e in entries for d in e.shape):
            raise RuntimeError(f"{BACKEND}: bucket {info.bucket} names a negative dimension")
        need = sum(e.nbytes for e in entries)
        kept = self.buffers[info.bucket].numel() if info.bucket < len(self.buffers) else 0
        free = _available()
        if need != info.nbytes or need - kept > free:
            raise RuntimeError(
                f"{BACKEND}: bucket {info.bucket} says {info.nbytes} bytes, its tensors "
                f"{need}; {free} bytes of memory are available: refused"
            )

    def finish_weight_update(self) -> None:
        if not self.complete:  # a push broken off (its trainer stopped): the session ends
            self._reset()
            return
        staged = self.staged
        self.staged = []
        self._reset()
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        self.model.load_weights(staged)
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.group = None
        self._reset()


def _available() -> int:
    """The bytes of memory this machine can still give (Linux's MemAvailable: free memory and
    the page cache it can drop), or its free pages elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: ``dcpkit_gloo`` known to vLLM's factory (every
    vLLM process calls it; a second call does nothing)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "dcpkit.push.vllm_engine", "GlooWeightTransferEngine"
        )
