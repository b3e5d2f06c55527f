"""Expert parallelism: each MoE layer's stacked experts sharded by expert over the ``ep`` ranks.

The ``ep`` ranks are taken from the data-parallel (FSDP) ranks, as in TorchTitan: the mesh
``("dp_mod_ep", "ep")`` splits the ``dp_shard`` ranks into groups of ``ep`` that share their
experts. Expert weights become DTensors ``[Replicate(), Shard(0)]`` on that mesh (a checkpoint
holds each expert once, under its plain name, and loads at any other expert-parallel degree);
FSDP shards every other parameter and leaves the experts alone. Tokens go to their experts by
an all-gather over the ``ep`` group, each rank applies its own experts, and the partial outputs
are summed back to the ranks that own the tokens (``GroupedExperts``).

Gradients: FSDP averages the other parameters' gradients over the data-parallel ranks; an
expert's gradient arrives summed over its ``ep`` group's tokens, so a hook sums it over the
``dp_mod_ep`` replicas and divides by the data-parallel degree: the same average.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dcpkit.config import ConfigError
from dcpkit.models.moe import GroupedExperts


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def build_ep_mesh(device_type: str, dp_shard: int, ep: int) -> DeviceMesh:
    """``("dp_mod_ep", "ep")`` over the data-parallel ranks: consecutive ranks share experts."""
    return init_device_mesh(device_type, (dp_shard // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    return {getattr(m, n) for m in expert_modules(model) for n in ("w1", "w2", "w3")}


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over ``mesh["ep"]`` (before FSDP, which must then be
    told to leave ``expert_parameters(model)`` alone)."""
    ep = mesh["ep"].size()
    replicas = mesh["dp_mod_ep"]
    dp = ep * replicas.size()
    modules = expert_modules(model)
    if not modules:
        raise ConfigError(
            "[parallelism] expert_parallel_degree > 1 needs a mixture-of-experts model "
            "(qwen3_moe, deepseek_v3)"
        )
    replica_group = replicas.get_group() if replicas.size() > 1 else None

    def average(p: torch.Tensor) -> None:
        g = p.grad.to_local()  # type: ignore[union-attr]
        if replica_group is not None:
            dist.all_reduce(g, group=replica_group)
        g.div_(dp)

    for experts in modules:
        if experts.num_experts % ep:
            raise ConfigError(
                f"[parallelism] expert_parallel_degree = {ep} must divide the number of experts "
                f"({experts.num_experts})"
            )
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            param = nn.Parameter(
                distribute_tensor(full.data, mesh, [Replicate(), Shard(0)]),
                requires_grad=full.requires_grad,
            )
            param.register_post_accumulate_grad_hook(average)
            setattr(experts, name, param)
        experts.ep_group = mesh["ep"].get_group()
        experts.first_expert = mesh["ep"].get_local_rank() * (experts.num_experts // ep)


def check_moe_layout(model: nn.Module, tp: int, pp: int, dp_replicate: int, ep: int) -> Any:
    """Refuse the combinations this trainer does not lay out for MoE models."""
    moe = bool(expert_modules(model))
    if moe and tp > 1:
        raise ConfigError(
            "[parallelism] tensor_parallel_degree > 1 is not supported for mixture-of-experts "
            "models; shard the experts with expert_parallel_degree instead"
        )
    if ep > 1 and (pp > 1 or dp_replicate > 1):
        raise ConfigError(
            "[parallelism] expert_parallel_degree > 1 combines with FSDP only (not with "
            "pipeline_parallel_degree or data_parallel_replicate_degree)"
        )
