"""Device mesh, tensor parallelism and FSDP2 for the reference model (TorchTitan's recipe)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from dcpkit.config import ConfigError
from dcpkit.train.config import Parallelism


def mesh_shape(par: Parallelism, world_size: int) -> tuple[int, int]:
    """(data-parallel degree, tensor-parallel degree) for ``world_size`` ranks."""
    tp = par.tensor_parallel_degree
    if tp < 1 or world_size % tp:
        raise ConfigError(
            f"[parallelism] tensor_parallel_degree = {tp} does not divide the world size "
            f"({world_size})"
        )
    dp = par.data_parallel_shard_degree
    if dp == -1:
        dp = world_size // tp
    if dp * tp != world_size:
        raise ConfigError(
            f"[parallelism] data_parallel_shard_degree ({dp}) x tensor_parallel_degree ({tp}) "
            f"must equal the world size ({world_size}); use -1 to fill it"
        )
    return dp, tp


def build_mesh(device_type: str, dp: int, tp: int) -> DeviceMesh:
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp_shard", "tp"))


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    args = model.args
    tp = tp_mesh.size()
    if args.n_heads % tp or args.kv_heads % tp:
        raise ConfigError(
            f"[parallelism] tensor_parallel_degree = {tp} must divide n_heads ({args.n_heads}) "
            f"and n_kv_heads ({args.kv_heads})"
        )
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Replicate()
            ),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    if args.tie_word_embeddings:
        # Each plan distributes its module's weight into a parameter of its own, which would
        # silently untie them. Both plans shard the [vocab, dim] weight by rows (Shard(0)), so
        # one DTensor serves both.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            },
        )


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Tensor parallel over ``mesh["tp"]``, then FSDP2 over ``mesh["dp_shard"]`` (each if > 1)."""
    if mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if mesh["dp_shard"].size() > 1:
        apply_fsdp(model, mesh["dp_shard"])
    return model


def device_for_rank(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
