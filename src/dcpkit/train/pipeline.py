"""Pipeline parallelism for the reference trainer (``torch.distributed.pipelining``).

The model is cut into stages by layers; each stage is a copy of the model that keeps its own
layers (and the embeddings on the first stage, the final norm and output on the last), so every
parameter keeps the model's own name and a checkpoint does not depend on the layout. Stage ``s``
lives on pipeline rank ``s % pp`` (one stage per rank for GPipe / 1F1B, several, looped, for
Interleaved1F1B / LoopedBFS).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dcpkit.config import ConfigError
from dcpkit.train.config import Parallelism
from dcpkit.train.parallelize import num_stages, parallelize, split_stage, stage_layers

logger = logging.getLogger("dcpkit.train")


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _schedule_class(name: str) -> Any:
    from torch.distributed import pipelining

    return {
        "GPipe": pipelining.ScheduleGPipe,
        "1F1B": pipelining.Schedule1F1B,
        "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B,
        "LoopedBFS": pipelining.ScheduleLoopedBFS,
    }[name]


class Pipeline:
    """This rank's stages and the schedule that runs them; ``parts`` are the stage modules."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        par: Parallelism,
        device: torch.device,
        local_batch: int,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        if getattr(model.args, "tie_word_embeddings", False):
            raise ConfigError(
                "[parallelism] pipeline parallelism needs untied embeddings: the embedding and "
                "the output layer would sit on different stages; use a flavor without "
                "tie_word_embeddings"
            )
        pp = par.pipeline_parallel_degree
        self.pp_group = mesh["pp"].get_group()
        pp_rank = mesh["pp"].get_local_rank()
        total = num_stages(par, model.args.n_layers)
        layers = stage_layers(model.args.n_layers, total)
        mine = [s for s in range(total) if s % pp == pp_rank]
        self.first = 0 in mine
        self.last = total - 1 in mine
        self.parts = [
            parallelize(
                split_stage(model, layers[s], s == 0, s == total - 1).to(device), mesh, True
            )
            for s in mine
        ]
        stages = [
            PipelineStage(part, s, total, device, group=self.pp_group)
            for part, s in zip(self.parts, mine)
        ]
        micro = par.pipeline_parallel_microbatch_size
        if local_batch % micro:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_microbatch_size ({micro}) must divide the "
                f"local batch ({local_batch} = global_batch_size / data-parallel degree)"
            )
        n_micro = local_batch // micro
        cls = _schedule_class(par.pipeline_parallel_schedule)
        looped = len(stages) > 1
        if looped and n_micro % pp:
            raise ConfigError(
                f"[parallelism] {par.pipeline_parallel_schedule} needs a number of microbatches "
                f"({n_micro}) divisible by pipeline_parallel_degree ({pp})"
            )
        self.schedule = cls(
            stages if looped else stages[0], n_microbatches=n_micro, loss_fn=loss_fn
        )
        self.rule = (
            f"pipeline: {total} stages ({par.pipeline_parallel_schedule}, {n_micro} microbatches "
            f"of {micro}), layers per stage {[len(x) for x in layers]}; this rank holds stages "
            f"{mine}"
        )

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline; returns the batch's mean loss
        on every pipeline rank (summed over the stages, of which only the last has it)."""
        losses: list[torch.Tensor] = []
        target = labels if self.last else None
        if self.first:
            self.schedule.step(inputs, target=target, losses=losses)
        else:
            self.schedule.step(target=target, losses=losses)
        if self.last:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
        else:
            loss = torch.zeros((), device=inputs.device)
        torch_dist.all_reduce(loss, group=self.pp_group)
        return loss
