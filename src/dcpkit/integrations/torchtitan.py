"""TorchTitan: ``DcpkitCheckpointManager``, a third implementation of TorchTitan's
``BaseCheckpointManager`` beside its own DCP manager.

TorchTitan builds its checkpointer from the ``checkpoint`` field of its ``Trainer.Config``
(``config.checkpoint.build(...)``): put this class's ``Config`` there and TorchTitan's
``Trainer`` checkpoints through dcpkit, its training loop unchanged::

    config = llama3_debugmodel()  # any of TorchTitan's config functions
    config.checkpoint = DcpkitCheckpointManager.Config(enable=True, interval=500)

``Config`` holds TorchTitan's ``[checkpoint]`` options (same names, defaults and meanings) and
dcpkit's own (``verify_on_load``, ``fallback_on_corruption``, the lease, storage retries and
options, the memory tier, the emergency save). Checkpoints keep TorchTitan's layout
(``step-N`` folders; the model's parameters at the top level beside ``optimizer``,
``lr_scheduler``, ``dataloader`` and ``train_state``), so TorchTitan's own manager resumes a run
dcpkit saved and dcpkit resumes a run TorchTitan's manager saved; dcpkit adds its manifest and
every rank's RNG.
"""

from __future__ import annotations

import dataclasses
import os
import types
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from torchtitan.components.checkpointer import (
    LR_SCHEDULER,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)

from dcpkit.config import CheckpointConfig, ConfigError
from dcpkit.engine.manager import CheckpointManager
from dcpkit.engine.preempt import EXIT_PREEMPTED
from dcpkit.errors import CheckpointError
from dcpkit.integrations.torchtitan_hf import AdapterHF


class DcpkitCheckpointManager(BaseCheckpointManager):
    """TorchTitan's checkpointer, written and restored by dcpkit's ``CheckpointManager``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """TorchTitan's checkpoint options and dcpkit's (see ``dcpkit.CheckpointConfig``)."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """Write in the background: ``async`` (a memory copy, then a writer) or
        ``async_with_pinned_mem``."""
        load_model_only: bool = False
        """Restore only the model from the folder's step (everything else starts fresh)."""
        verify_on_load: bool = True
        """Check every file's size and checksum before loading (the ranks split the work)."""
        fallback_on_corruption: bool = False
        """When the latest checkpoint fails verification, load the newest one that passes."""
        link_frozen: bool = True
        """Frozen parameters written once per run, later saves linking them."""
        lease_timeout_s: float = 60.0
        """The run's lease on its folder: another run takes it over after this long."""
        storage_retry_s: float = 120.0
        """How long a save retries transient storage errors before it fails."""
        storage_options: dict[str, Any] = field(default_factory=dict)
        """fsspec options when ``folder`` is a URL."""
        local_interval: int = 0
        """Memory tier: save every rank's shard to node-local memory this often; 0: off."""
        local_folder: str = ""
        """Memory-tier folder (empty: a folder of /dev/shm named after the checkpoint folder)."""
        local_keep: int = 2
        """Memory-tier steps kept."""
        local_replicas: int = 0
        """1: each rank also holds a copy of a partner rank's memory-tier shard, on another
        node."""
        emergency_save: bool = False
        """On SIGTERM (preemption), every rank finishes its step, saves it and the run exits
        with code 75 (checked at every step's save call, one small all-reduce)."""
        emergency_timeout_s: float = 60.0
        """Grace period after SIGTERM: past it (or at a second SIGTERM) the process exits."""
        hf_model: str = ""
        """``initial_load_in_hf`` and ``last_save_in_hf`` through one of dcpkit's model
        families (``"llama3:8B"``: family and flavor, as ``dcpkit to-hf --model --flavor``)
        instead of the state-dict adapter TorchTitan gives its checkpointer (for a model
        TorchTitan has none for)."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[Any],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
        **_unused: Any,
    ) -> None:
        self.enable = config.enable
        self.save_future: Future | None = None
        if not self.enable:
            return
        self.create_seed_checkpoint = config.create_seed_checkpoint
        converted = checkpoint_config(config)
        hf_model = None
        if config.initial_load_in_hf or config.last_save_in_hf:
            hf_model = hf_codec(config, sd_adapter)
            if config.initial_load_in_hf and not converted.initial_load_path:
                # TorchTitan's rule: the weights of the model's Hugging Face assets
                converted.initial_load_path = sd_adapter.hf_assets_path
        # TorchTitan's own stateful objects, saved as they make their state dicts: the same
        # keys as TorchTitan's manager writes (its models' state-dict hooks shape the names)
        self.manager = CheckpointManager(
            converted,
            base_folder or ".",
            ModelWrapper(model_parts),
            dataloader=_Dataloader(dataloader) if dataloader is not None else None,
            states={OPTIMIZER: optimizers, LR_SCHEDULER: lr_schedulers, **states},
            hf_model=hf_model,
        )

    def _load(self, step: int = -1) -> bool:
        if step != -1:
            self.manager.config.load_step = step
        return self.manager.load() is not None

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if curr_step == 0 and self.create_seed_checkpoint:
            self.manager.save_seed_checkpoint()
            return True
        if self.manager.preempted():  # SIGTERM reached a rank: save this step, then stop
            self.manager.save(curr_step, force=True)
            self.manager.close()
            raise SystemExit(EXIT_PREEMPTED)
        return self.manager.save(curr_step, last_step=last_step)

    def _maybe_wait_for_staging(self) -> None:
        self.manager.maybe_wait_for_staging()

    def _wait_for_saving(self) -> None:
        self.manager.wait()
        self.save_future = None

    def _close(self) -> None:
        self.manager.close()


class _Dataloader:
    """TorchTitan's dataloader, whose position cannot move to another data-parallel size: its
    ``load_state_dict`` asserts (``dataloader resharding is not supported yet``), or, on a rank
    the checkpoint has no position for, starts over with a warning. Either way refused here,
    while loading (before training), saying what to exclude."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return dict(self.loader.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("world_size") if isinstance(state, dict) else None
        now = getattr(self.loader, "dp_world_size", None)
        if isinstance(saved, int) and isinstance(now, int) and saved != now:
            raise CheckpointError(
                f"the checkpoint's dataloader positions are of {saved} data-parallel rank(s) and "
                f"this run has {now}: TorchTitan's dataloader cannot move its position to another "
                'data-parallel size. Add "dataloader" to checkpoint.exclude_from_loading to '
                "resume with the data order restarted (model, optimizer, schedule and step are "
                f"restored, resharded), or resume at a data-parallel size of {saved}"
            )
        self.loader.load_state_dict(state)


def hf_codec(config: Any, sd_adapter: Any) -> Any:
    """How Hugging Face folders are read and written for this run: dcpkit's family named by
    ``hf_model``, else the state-dict adapter TorchTitan gives the checkpointer."""
    if config.hf_model:
        from dcpkit.convert.hf_model import HFModel

        family, _, flavor = config.hf_model.partition(":")
        if not flavor:
            raise ConfigError(
                f'checkpoint.hf_model = "{config.hf_model}": give a family and a flavor, as '
                '"llama3:8B" (the names of dcpkit to-hf --model and --flavor)'
            )
        return HFModel(family, flavor)
    what = "initial_load_in_hf" if config.initial_load_in_hf else "last_save_in_hf"
    if sd_adapter is None:
        raise ConfigError(
            f"checkpoint.{what} = true, but TorchTitan gives no state-dict adapter for this "
            'model: set checkpoint.hf_model = "FAMILY:FLAVOR" to convert with one of dcpkit\'s '
            "model families (those of dcpkit to-hf --model), or save in DCP and convert afterwards "
            "(dcpkit to-hf)"
        )
    if config.initial_load_in_hf and not (config.initial_load_path or sd_adapter.hf_assets_path):
        raise ConfigError(
            "checkpoint.initial_load_in_hf = true, but neither checkpoint.initial_load_path nor "
            "the model's hf_assets_path names the Hugging Face folder to start from"
        )
    return AdapterHF(sd_adapter)


def checkpoint_config(config: Any) -> CheckpointConfig:
    """dcpkit's ``CheckpointConfig`` from a TorchTitan checkpoint ``Config`` (TorchTitan's own
    or ``DcpkitCheckpointManager.Config``): every option both know, by name."""
    known = {f.name for f in dataclasses.fields(CheckpointConfig) if f.init}
    given = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name in known and not f.name.startswith("_")
    }
    given.pop("initial_load_in_hf_quantized", None)
    return CheckpointConfig(**given)


class _CPUDevice:
    """The calls TorchTitan makes on ``torch.cuda`` (its device module), answered for the CPU."""

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=pages)

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass

    @staticmethod
    def is_available() -> bool:
        return True


def _flex_attention_on_cpu(
    self: Any,
    q_BLNH: Any,
    k_BLNH: Any,
    v_BLNH: Any,
    *,
    attention_masks: Any,
    score_mod: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    out_transform: Any = None,
    **kwargs: Any,
) -> Any:
    """TorchTitan's ``FlexAttention.forward`` as PyTorch's SDPA with the same mask (the block
    mask's ``mask_mod`` made dense): flex attention has no backward on the CPU."""
    import torch
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None or out_transform is not None:
        raise NotImplementedError("run_on_cpu: flex attention with a score_mod or out_transform")
    batch, q_len, kv_len = q_BLNH.shape[0], q_BLNH.shape[1], k_BLNH.shape[1]
    mask = create_mask(attention_masks.mask_mod, batch, None, q_len, kv_len, q_BLNH.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        q_BLNH.transpose(1, 2),
        k_BLNH.transpose(1, 2),
        v_BLNH.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return out.transpose(1, 2)


_DEVICE_USERS = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.tools.profiler",
    "torchtitan.models.common.token_dispatcher",
)


def run_on_cpu() -> None:
    """Let TorchTitan's ``Trainer`` run on a machine without GPUs (gloo, CPU tensors).

    TorchTitan picks CUDA unconditionally (``torchtitan.tools.utils``:
    ``_get_available_device_type() or "cuda"``), and its attention (flex attention, or varlen's
    flash kernels) has no CPU backward. This points TorchTitan's device helpers at the CPU and
    computes flex attention with SDPA under the same mask (mathematically the same attention;
    not bitwise the same kernel as on a GPU), whose block mask is made without ``torch.compile``
    (only its ``mask_mod`` is read: compiling it cost each process seconds at step 1); gloo's
    missing ``PREMUL_SUM`` is replaced by the same sum; ``torch.distributed.set_timeout``
    (which TorchTitan 0.3.0 calls after the first step) is provided when this torch lacks it.
    For tests and laptops; on GPUs, do not call it.
    """
    import importlib
    import sys

    import torch.distributed

    for name in _DEVICE_USERS:
        module = sys.modules.get(name) or importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = _CPUDevice
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.distributed import fsdp
    from torchtitan.models.common import attention

    attention.FlexAttention.forward = _flex_attention_on_cpu
    if hasattr(attention, "_compiled_create_block_mask"):  # only its mask_mod is read here
        attention._compiled_create_block_mask = create_block_mask
    if not hasattr(torch.distributed, "set_timeout"):  # TorchTitan 0.3.0 calls it after step 1
        torch.distributed.set_timeout = _set_timeout
    fsdp.disable_fsdp_gradient_division = _sum_gradients(fsdp.disable_fsdp_gradient_division)


def _set_timeout(timeout: Any, group: Any = None) -> None:
    """``torch.distributed.set_timeout``, which TorchTitan 0.3.0 calls and torch releases
    before it lack: the same through torch's own ``_set_pg_timeout``."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def _sum_gradients(disable: Any) -> Any:
    """TorchTitan reduces gradients as a sum divided by 1 (it scales them itself by the global
    token count), which FSDP sends as ``PREMUL_SUM(1.0)``: gloo has no such op, so the same sum
    is sent as ``SUM``."""

    def disable_fsdp_gradient_division(model: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        disable(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    return disable_fsdp_gradient_division
