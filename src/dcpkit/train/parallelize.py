"""Device mesh, tensor parallelism and FSDP2 for the reference model (TorchTitan's recipe)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

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
from dcpkit.train.config import PIPELINE_SCHEDULES, Parallelism
from dcpkit.train.expert_parallel import apply_expert_parallel, expert_parameters


@dataclass(frozen=True)
class Layout:
    """Degrees of every parallelism, in TorchTitan's mesh order (pp, dp_replicate, dp_shard,
    tp); their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    """Expert-parallel degree, borrowed from ``dp_shard`` (not a mesh dimension of its own)."""

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        parts = [f"dp_shard={self.dp_shard}", f"tp={self.tp}"]
        if self.dp_replicate > 1:
            parts.insert(0, f"dp_replicate={self.dp_replicate}")
        if self.pp > 1:
            parts.insert(0, f"pp={self.pp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        return " ".join(parts)


def mesh_layout(par: Parallelism, world_size: int) -> Layout:
    """The layout of ``world_size`` ranks; ``data_parallel_shard_degree = -1`` fills the rest."""
    tp, pp, rep = (
        par.tensor_parallel_degree,
        par.pipeline_parallel_degree,
        par.data_parallel_replicate_degree,
    )
    if world_size % tp:
        raise ConfigError(
            f"[parallelism] tensor_parallel_degree = {tp} does not divide the world size "
            f"({world_size})"
        )
    if world_size % (tp * pp * rep):
        raise ConfigError(
            f"[parallelism] pipeline_parallel_degree ({pp}) x data_parallel_replicate_degree "
            f"({rep}) x tensor_parallel_degree ({tp}) does not divide the world size "
            f"({world_size})"
        )
    dp = par.data_parallel_shard_degree
    if dp == -1:
        dp = world_size // (tp * pp * rep)
    if dp * tp * pp * rep != world_size:
        others = f" x tensor_parallel_degree ({tp})"
        if pp > 1:
            others += f" x pipeline_parallel_degree ({pp})"
        if rep > 1:
            others += f" x data_parallel_replicate_degree ({rep})"
        raise ConfigError(
            f"[parallelism] data_parallel_shard_degree ({dp}){others} must equal the world size "
            f"({world_size}); use -1 to fill it"
        )
    ep = par.expert_parallel_degree
    if dp % ep:
        raise ConfigError(
            f"[parallelism] expert_parallel_degree ({ep}) must divide data_parallel_shard_degree "
            f"({dp}): the expert-parallel ranks are taken from the FSDP ranks"
        )
    return Layout(pp=pp, dp_replicate=rep, dp_shard=dp, tp=tp, ep=ep)


def build_mesh(device_type: str, dp: int | Layout, tp: int = 1) -> DeviceMesh:
    """The device mesh: ``("pp", "dp_replicate", "dp_shard", "tp")`` for a :class:`Layout`,
    ``("dp_shard", "tp")`` for two degrees."""
    if isinstance(dp, Layout):
        layout = dp
        return init_device_mesh(
            device_type,
            (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
        )
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp_shard", "tp"))


def stage_layers(n_layers: int, num_stages: int) -> list[list[int]]:
    """Layer indices of each pipeline stage, spread evenly (earlier stages take the rest)."""
    if num_stages > n_layers:
        raise ConfigError(
            f"[parallelism] {num_stages} pipeline stages but the model has {n_layers} layers; "
            "use fewer stages (pipeline_parallel_degree, or layers_per_stage)"
        )
    base, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def num_stages(par: Parallelism, n_layers: int) -> int:
    pp = par.pipeline_parallel_degree
    if par.pipeline_parallel_layers_per_stage:
        stages = -(-n_layers // par.pipeline_parallel_layers_per_stage)
    else:
        stages = pp * PIPELINE_SCHEDULES[par.pipeline_parallel_schedule]
    per_rank = PIPELINE_SCHEDULES[par.pipeline_parallel_schedule]
    if stages % pp or (per_rank == 1 and stages != pp) or (per_rank > 1 and stages < 2 * pp):
        kind = "one stage" if per_rank == 1 else "at least two stages"
        raise ConfigError(
            f"[parallelism] {stages} pipeline stages over pipeline_parallel_degree = {pp} ranks: "
            f"{par.pipeline_parallel_schedule} needs {kind} per rank, the same on every rank"
        )
    return stages


def split_stage(model: nn.Module, layers: list[int], first: bool, last: bool) -> nn.Module:
    """A copy of ``model`` that keeps only ``layers`` (and the embeddings on the first stage, the
    final norm and output on the last): parameter names stay the model's own."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in layers}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if not first:
        part.tok_embeddings = None
    if not last:
        part.norm = None
        part.output = None
    return part


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


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    for block in model.layers.values():
        fully_shard(
            block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored
        )
    fully_shard(
        model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored
    )


def parallelize(
    model: nn.Module, mesh: DeviceMesh, pipelined: bool = False, ep_mesh: DeviceMesh | None = None
) -> nn.Module:
    """Tensor parallel over ``mesh["tp"]``, experts over ``ep_mesh`` (if given), then FSDP2 over
    ``mesh["dp_shard"]`` or, with replicas, HSDP over ``mesh["dp_replicate", "dp_shard"]``
    (each if > 1)."""
    names = mesh.mesh_dim_names or ()
    if mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if ep_mesh is not None:
        apply_expert_parallel(model, ep_mesh)
        # FSDP leaves the sharded experts alone (and, with one rank per expert group, there
        # is nothing else to shard them over).
        apply_fsdp(model, mesh["dp_shard"], not pipelined, expert_parameters(model))
        return model
    replicas = mesh["dp_replicate"].size() if "dp_replicate" in names else 1
    if replicas > 1:
        # HSDP: shards over dp_shard, replicated over dp_replicate; gradients are reduced over
        # both, and a checkpoint holds each shard once (DCP removes the replicas' duplicates).
        apply_fsdp(model, mesh["dp_replicate", "dp_shard"], not pipelined)
    elif mesh["dp_shard"].size() > 1:
        # Under a pipeline schedule, parameters stay gathered between microbatches.
        apply_fsdp(model, mesh["dp_shard"], not pipelined)
    return model


def device_for_rank(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
