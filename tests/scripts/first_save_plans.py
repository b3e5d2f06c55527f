"""Under torchrun: a user's loop whose first save is planned from the layout every rank shares.

    first_save_plans.py FOLDER MODE LAYOUT

LAYOUT: ``fsdp`` (FSDP2 over every rank), ``hsdp`` (2 replicas x world/2 shards), ``tp`` (FSDP2
over 2 x TP over world/2: FSDP's strided shards), ``ddp`` (a DDP model: plain tensors every
rank holds). Shapes are uneven (a 3-row weight over 4 shards leaves one empty). The loop trains
and saves steps 1 and 2 through CheckpointManager (MODE is the async_mode), with a sampler whose
state holds 0-dim tensors and a per-rank reader. Then each rank loads both steps with DCP's own
``dcp.load`` into a fresh state, and saves the live state with DCP's own planner beside them.
Rank 0 prints ``RESULT {json}``: per rank, the global plannings after each save, whether each
step loads back bitwise, and (rank 0) how the metadata compares with DCP's own planning.
"""

import logging
import sys

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from user_states import Reader, Sampler, report, snapshot, train_step

from dcpkit import CheckpointConfig, CheckpointManager, dist


def build(layout: str, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3), torch.nn.Linear(3, 5)
    )
    world = dist.world_size()
    if layout == "fsdp":
        for part in (model[0], model[2], model[3]):
            fully_shard(part)
        fully_shard(model)
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def loads_back(layout: str, path: str, saved: list[torch.Tensor]) -> bool:
    """DCP's own load of ``path`` into a fresh state equals ``saved``."""
    fresh, fresh_opt = build(layout, 7)  # other values, the same shapes
    sampler, reader = Sampler(), Reader()
    other = CheckpointManager(
        CheckpointConfig(enable=False), ".", fresh, optimizer=fresh_opt,
        states={"sampler": sampler}, per_rank_states={"reader": reader},
    )  # fmt: skip
    train_step(fresh, fresh_opt, sampler, reader, 1)  # the optimizer's state exists
    template = other.collect()
    dcp.load(template, checkpoint_id=path)  # DCP's own reader and planner
    other.model.load_state_dict({k: template[k] for k in other.model.state_dict()})
    other.states["optimizer"].load_state_dict(template["optimizer"])
    sampler.load_state_dict(template["sampler"])
    mine = template["reader"][f"rank_{dist.rank()}"]["position"]
    same = all(torch.equal(a, b) for a, b in zip(saved, snapshot(fresh, fresh_opt, sampler)))
    return same and int(mine) == 100 * dist.rank() + int(path.rstrip("/")[-1])


def compare(ours_path: str, dcps_path: str) -> dict:
    """Our metadata against DCP's own planning of the same state: keys, kinds, shapes, dtypes,
    state-dict paths, and every chunk with data."""
    ours = dcp.FileSystemReader(ours_path).read_metadata()
    theirs = dcp.FileSystemReader(dcps_path).read_metadata()
    problems = []
    if set(ours.state_dict_metadata) != set(theirs.state_dict_metadata):
        problems.append("keys")
    for key, md in theirs.state_dict_metadata.items():
        mine = ours.state_dict_metadata.get(key)
        if type(mine) is not type(md):
            problems.append(f"{key}: kind")
            continue
        if hasattr(md, "chunks"):
            if (mine.size, mine.properties.dtype) != (md.size, md.properties.dtype):
                problems.append(f"{key}: shape or dtype")

            def full(chunks):
                return sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks if c.sizes.numel())

            if full(mine.chunks) != full(md.chunks):
                problems.append(f"{key}: chunks {full(mine.chunks)} != {full(md.chunks)}")
    if ours.planner_data != theirs.planner_data:
        problems.append("planner_data")
    # the index dcpkit writes beside .metadata says what .metadata says, entry for entry
    from dcpkit.formats.dcp_index import DcpIndex

    indexed = DcpIndex(f"{ours_path}/.metadata.index").metadata()

    def entries(md):
        return {
            (k.fqn, tuple(k.offset) if k.offset is not None else None): (
                v.relative_path,
                v.offset,
                v.length,
            )
            for k, v in md.storage_data.items()
        }

    if entries(indexed) != entries(ours) or set(indexed.state_dict_metadata) != set(
        ours.state_dict_metadata
    ):
        problems.append("index")
    chunks = sum(len(getattr(md, "chunks", ())) for md in ours.state_dict_metadata.values())
    return {"problems": problems, "keys": len(ours.state_dict_metadata), "chunks": chunks}


def main() -> None:
    folder, mode, layout = sys.argv[1:4]
    logging.basicConfig(level=logging.INFO)  # dcpkit's log lines, as a user would see them
    torch_dist.init_process_group("gloo")
    model, opt = build(layout, 0)
    sampler, reader = Sampler(), Reader()
    cfg = CheckpointConfig(enable=True, folder=folder, interval=1, keep_latest_k=0, async_mode=mode)
    mgr = CheckpointManager(
        cfg, ".", model, optimizer=opt, states={"sampler": sampler},
        per_rank_states={"reader": reader},
    )  # fmt: skip
    result: dict = {"plans": [], "bitwise": []}
    saved = {}
    for step in (1, 2):
        train_step(model, opt, sampler, reader, step)
        saved[step] = snapshot(model, opt, sampler)
        mgr.save(step)
        mgr.maybe_wait_for_staging()
        mgr.wait()
        result["plans"].append(mgr.global_plans)
    reference = f"{folder}/dcp_reference"
    dcp.save(mgr.collect(), checkpoint_id=reference, planner=DefaultSavePlanner())
    mgr.close()
    for step in (1, 2):
        result["bitwise"].append(loads_back(layout, mgr.step_path(step), saved[step]))
    if dist.rank() == 0:
        result["compare"] = [compare(mgr.step_path(s), reference) for s in (1, 2)]
    report(result)


if __name__ == "__main__":
    main()
