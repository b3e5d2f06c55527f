"""Save planning at thousands of ranks, simulated in one process.

    python benchmarks/planning_scale.py [--models 8B,70B,405B] [--max-world 8192]
        [--max-items 6e6] [--json PATH] [--png PATH]

For Llama 3 8B, 70B and 405B (TorchTitan's flavors), model + AdamW, laid out as the trainer lays
them out (FSDP x TP: TP 8 within a node, FSDP across; TorchTitan's TP plan: column-wise
``wq wk wv w1 w3 output tok_embeddings``, row-wise ``wo w2``, norms replicated over TP; the
optimizer state in TorchTitan's flattened layout: ``exp_avg`` and ``exp_avg_sq`` sharded like the
parameter, a ``step`` tensor and the ``param_groups`` entries per parameter, replicated), this
builds every rank's DCP save plan (write items with their global offsets, as the ranks would send
them) for world sizes 8, 16, ... ``--max-world`` and runs, on them, what the coordinator of a DCP
save runs: DCP's ``DefaultSavePlanner.create_global_plan`` (deduplication, the global plan, the
metadata, its validation), then the ``.metadata`` as DCP writes it (pickled, with every chunk's
storage entry). It measures the coordinator's planning time, the ``.metadata`` size, the bytes of
the plans it gathers, and the cell's peak memory above its start; then a second save of the same
shapes through dcpkit's ``CachingPlanner``: every rank sends an empty plan, the coordinator reuses
the cached plan and metadata, and the global plannings are counted (1, not 2). And what every
rank of a load pays for that ``.metadata``, at every load: its parse by dcpkit's safe reader, and
the checks a verified load or ``dcpkit verify`` runs on it (chunks in bounds, disjoint, covering
every tensor, each with its storage entry). Beside them, the index of ``.metadata`` that dcpkit
writes at every save: what the coordinator pays to make it (from the metadata in memory) and its
size, and what one rank of a load at the same layout pays instead of the parse (reading the
entries of its own chunks from it: ``DcpIndex.metadata``) and instead of the checks (its share
of them, read from the index: ``index_problems``, the data files stood in by sparse files of
their true sizes).

Each cell runs in a process of its own (its peak memory is its own), forked from one that
imported torch once (a cell's peak then counts the pages of torch's code it first touches, a
few MiB, which a process of its own counted at its import). A cell whose plans hold more
than ``--max-items`` write items in all is not run on this machine: its figures are extrapolated
linearly from the measured cells of the same model (what one rank pays with the index, which
does not grow linearly, along a log-log fit of them), and marked so. Replicated write items (the
same on every rank) are one object shared by the ranks' plans, so the memory figure counts the
sharded items only; a real coordinator unpickles a copy per rank.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import pickle
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

from _launch import forked  # this script's folder is on sys.path

FLAVORS = {  # dim, layers, heads, kv heads, FFN hidden (TorchTitan's Llama 3 flavors)
    "8B": (4096, 32, 32, 8, 14336),
    "70B": (8192, 80, 64, 8, 28672),
    "405B": (16384, 126, 128, 8, 53248),
}
VOCAB = 128256
TP = 8
ADAMW_GROUP = (  # torch.optim.AdamW's param_groups entries, one DCP entry per parameter each
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "foreach",
    "maximize",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)


def parameters(flavor: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, global shape, TP style: 'col' = Shard(0), 'row' = Shard(1), 'rep' = Replicate)."""
    dim, layers, heads, kv, ffn = FLAVORS[flavor]
    hd = dim // heads
    out = [("tok_embeddings.weight", (VOCAB, dim), "col")]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            (p + "attention.wq.weight", (heads * hd, dim), "col"),
            (p + "attention.wk.weight", (kv * hd, dim), "col"),
            (p + "attention.wv.weight", (kv * hd, dim), "col"),
            (p + "attention.wo.weight", (dim, heads * hd), "row"),
            (p + "feed_forward.w1.weight", (ffn, dim), "col"),
            (p + "feed_forward.w2.weight", (dim, ffn), "row"),
            (p + "feed_forward.w3.weight", (ffn, dim), "col"),
            (p + "attention_norm.weight", (dim,), "rep"),
            (p + "ffn_norm.weight", (dim,), "rep"),
        ]
    return [*out, ("norm.weight", (dim,), "rep"), ("output.weight", (VOCAB, dim), "col")]


def _chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """torch.chunk's piece i of n into k: (start, size)."""
    c = -(-n // k)
    start = min(i * c, n)
    return start, max(0, min(c, n - start))


def local_chunk(shape: tuple[int, ...], style: str, dp: int, tp: int, d: int, t: int):  # type: ignore[no-untyped-def]
    """Offsets and sizes of rank (d, t)'s shard; FSDP shards dim 0 within the TP shard."""
    offsets, sizes = [0] * len(shape), list(shape)
    if style == "row":
        offsets[1], sizes[1] = _chunk(shape[1], tp, t)
        offsets[0], sizes[0] = _chunk(shape[0], dp, d)
    elif style == "col":
        t0, tn = _chunk(shape[0], tp, t)
        d0, sizes[0] = _chunk(tn, dp, d)
        offsets[0] = t0 + d0
    else:
        offsets[0], sizes[0] = _chunk(shape[0], dp, d)
    return offsets, sizes


def build_plans(flavor: str, world: int, ranks: list[int] | None = None) -> list:  # type: ignore[type-arg]
    """The DCP save plans of ``ranks`` (default: every rank)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    tp = min(TP, world)
    dp = world // tp
    props = TensorProperties(dtype=torch.float32)
    params = parameters(flavor)
    # State keys: the parameter, then its two AdamW moments (sharded like it).
    sharded = []
    for name, shape, style in params:
        for key in (name, f"optimizer.state.{name}.exp_avg", f"optimizer.state.{name}.exp_avg_sq"):
            sharded.append((key, torch.Size(shape), style))
    replicated = []  # identical on every rank: one object shared by all plans
    scalar = torch.Size([])
    for name, _, _ in params:
        key = f"optimizer.state.{name}.step"
        replicated.append(
            WriteItem(
                index=MetadataIndex(key, scalar),
                type=WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=scalar, sizes=scalar),
                    properties=props,
                    size=scalar,
                ),
            )
        )
        for opt in ADAMW_GROUP:
            replicated.append(
                WriteItem(
                    index=MetadataIndex(f"optimizer.param_groups.{name}.{opt}"),
                    type=WriteItemType.BYTE_IO,
                )
            )
    for key in ("lr_scheduler", "train_state"):
        replicated.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
    # state-dict paths as TorchTitan's flattened state dict has them (top-level state first)
    mappings = {key: tuple(key.split(".", 2)) for key, _, _ in sharded}
    mappings.update({item.index.fqn: tuple(item.index.fqn.split(".", 2)) for item in replicated})
    shared: dict = {}  # (key, offsets) -> item, for the chunks replicated over TP
    plans = []
    for rank in range(world) if ranks is None else ranks:
        d, t = divmod(rank, tp)
        items = list(replicated)
        for key, size, style in sharded:
            offsets, sizes = local_chunk(tuple(size), style, dp, tp, d, t)
            if not all(sizes):
                continue
            if style == "rep" and (key, d) in shared:
                items.append(shared[(key, d)])
                continue
            off = torch.Size(offsets)
            item = WriteItem(
                index=MetadataIndex(key, off),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=off, sizes=torch.Size(sizes)),
                    properties=props,
                    size=size,
                ),
            )
            if style == "rep":
                shared[(key, d)] = item
            items.append(item)
        dl = f"dataloader.dp_rank_{d}"
        items.append(WriteItem(index=MetadataIndex(dl), type=WriteItemType.BYTE_IO))
        plans.append(SavePlan(items, planner_data={**mappings, dl: ("dataloader", f"dp_rank_{d}")}))
    return plans


def layouts(flavor: str, world: int, rank: int) -> dict:  # type: ignore[type-arg]
    """Every DTensor's layout on ``rank`` (``dcpkit.engine.chunk_layout``), as TorchTitan's
    FSDP x TP gives it: the mesh (dp, tp); column-wise: TP's piece split by FSDP inside it
    (FSDP's strided shard); row-wise: FSDP on dim 0, TP on dim 1; norms: FSDP on dim 0,
    replicated over TP."""
    from dcpkit.engine.chunk_layout import Layout

    tp = min(TP, world)
    dp = world // tp
    coordinate = divmod(rank, tp)
    splits = {"col": (((1, 0), ()), ()), "row": (((0,), (1,)), ()), "rep": (((0,),), (1,))}
    out = {}
    for name, shape, style in parameters(flavor):
        split, replicated = splits[style]
        layout = Layout((dp, tp), 0, (tp, 1), coordinate, split[: len(shape)], replicated)
        for key in (name, f"optimizer.state.{name}.exp_avg", f"optimizer.state.{name}.exp_avg_sq"):
            out[key] = layout
    return out


def items_per_rank(flavor: str) -> int:
    n = len(parameters(flavor))
    return n * (3 + 1 + len(ADAMW_GROUP)) + 3


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def described_cell(flavor: str, world: int, metadata: bool, verify: bool = True) -> dict:  # type: ignore[type-arg]
    """One (model, world size), a job's first save planned from the layout the ranks share
    (``dcpkit.engine.described``). The coordinator (rank 0) describes its own plan (and checks
    the chunk formula against it), reduces the digests (the all-reduce, standing in: the least
    of rank 0's and another dp rank's vectors, which differ in the per-rank dataloader entry
    only, as every rank's do), takes its share, then plans the one thing gathered: every rank's
    per-rank state (its dataloader entry). That is the save's blocking part: the writes start
    after it. Then, while the ranks write (``metadata``), the coordinator lists every chunk from
    the layouts and pickles ``.metadata`` with a storage entry per chunk; with ``verify``,
    ``dcpkit verify``'s reading and checks of that file follow (``_verify_side``)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    from dcpkit.engine import described, planning

    tp = min(TP, world)
    other = tp if world > tp else 1  # a rank of another dp coordinate
    base = _rss("VmRSS")
    plan, plan_other = build_plans(flavor, world, [0, other])
    mappings = plan.planner_data
    t0 = time.perf_counter()
    mine = described.describe(plan, layouts(flavor, world, 0), mappings)
    describe_s = time.perf_counter() - t0
    theirs = described.describe(plan_other, layouts(flavor, world, other), plan_other.planner_data)
    first = [min(a, b) for a, b in zip(mine.first(), theirs.first())]
    second = [min(a, b) for a, b in zip(mine.second(), theirs.second())]
    t0 = time.perf_counter()
    agreed, why = described.decide(
        plan, layouts(flavor, world, 0), mappings, mine, first, second, 0, world
    )
    share_s = time.perf_counter() - t0
    if agreed is None:
        raise RuntimeError(f"the description does not agree: {why}")
    sent = []  # what each rank sends: its per-rank states' items (its dataloader entry)
    for rank in range(world):
        d = rank // tp
        dl = f"dataloader.dp_rank_{d}"
        item = WriteItem(index=MetadataIndex(dl), type=WriteItemType.BYTE_IO)
        sent.append(SavePlan([item], planner_data={dl: ("dataloader", f"dp_rank_{d}")}))
    gathered = sum(len(pickle.dumps(p)) for p in sent)
    key = planning.new_key()
    planner = planning.CachingPlanner(key)
    planner._agreed = agreed  # what the coordinator's create_local_plan left (``agree``)
    t0 = time.perf_counter()
    _, md = planner.create_global_plan(sent)
    plan_s = time.perf_counter() - t0
    blocking_peak = _rss("VmHWM") - base
    row = {
        "model": flavor,
        "world": world,
        "described_describe_s": describe_s,
        "described_share_s": share_s,
        "described_plan_s": plan_s,
        "described_blocking_s": describe_s + share_s + plan_s,
        "described_gathered_bytes": gathered,
        "described_blocking_peak_bytes": blocking_peak,
        "described_owned": len(agreed.owned),
        "described_global_plans": planning.global_plans(key),
        "described_plans": planning.described_plans(key),
    }
    if metadata:
        row.update(_streamed_metadata(md, agreed, world, verify))
    return row


def _reset_peak() -> None:
    """Start the peak resident memory (VmHWM) over from the current one (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _streamed_metadata(md, agreed, world: int, verify: bool) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """The described save's finish on its coordinator: every rank's write results (rows of
    integers, each chunk with one owner), received as the gather brings them (pickled, one per
    rank), then ``.metadata`` and its index written one tensor at a time (``write_streamed``,
    what the storage writer calls), to a real file, hashed as it is written. Its own time and
    peak memory (the results' simulation before it is not counted)."""
    import gc
    import tempfile

    import numpy as np
    import xxhash
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
    from torch.distributed.checkpoint.storage import WriteResult

    from dcpkit.engine.chunk_layout import pieces
    from dcpkit.engine.described_write import ROW, CompactResults

    parts = []  # (key, chunk, owner) for every chunk: rank = (key + chunk) % world
    for number, (_, _, size, layout) in enumerate(md.dtensors):
        count = math.prod(len(pieces(n, layout, layout.splits[d])) for d, n in enumerate(size))
        chunk = np.arange(count, dtype=np.int64)
        parts.append(np.stack([np.full(count, number), chunk, (chunk + number) % world]))
    every = np.concatenate(parts, axis=1)
    del parts
    order = np.argsort(every[2], kind="stable")
    every = every[:, order]
    bounds = np.searchsorted(every[2], np.arange(world + 1))
    small = []  # the other entries' results (the coordinator's values, the per-rank entries)
    for fqn, entry in md.state_dict_metadata.items():
        offset = entry.chunks[0].offsets if isinstance(entry, TensorStorageMetadata) else None
        small.append(
            WriteResult(MetadataIndex(fqn, offset), 64, _StorageInfo("__0_0.distcp", 0, 64))
        )
    with tempfile.TemporaryDirectory(prefix="dcpkit-meta-") as tmp:
        sent = Path(tmp) / "results"
        gathered = 0
        with open(sent, "wb") as f:
            for rank in range(world):
                mine = every[:, bounds[rank] : bounds[rank + 1]]
                rows = np.zeros(mine.shape[1], ROW)
                rows["key"], rows["chunk"] = mine[0], mine[1]
                rows["offset"] = np.arange(mine.shape[1]) * 4096
                rows["length"] = 4096
                data = pickle.dumps(
                    CompactResults([f"__{rank}_0.distcp"], rows, small if rank == 0 else [])
                )
                f.write(struct.pack("<Q", len(data)) + data)
                gathered += len(data)
        del every, order, mine, rows, data
        gc.collect()
        _reset_peak()
        base = _rss("VmRSS")
        t0 = time.perf_counter()
        results = []
        with open(sent, "rb") as f:  # what the coordinator receives, one rank's results each
            for _ in range(world):
                (n,) = struct.unpack("<Q", f.read(8))
                results.append(pickle.loads(f.read(n)))
        receive_s = time.perf_counter() - t0
        hasher = xxhash.xxh3_64()

        class Hashed:  # hashed as written, as the store's writer does
            def __init__(self, f):  # type: ignore[no-untyped-def]
                self.f, self.n = f, 0

            def write(self, data):  # type: ignore[no-untyped-def]
                hasher.update(data)
                self.n += len(data)
                return self.f.write(data)

        t0 = time.perf_counter()
        with open(Path(tmp) / ".metadata", "wb") as raw:
            out = Hashed(raw)
            md.write_streamed(out, results, None, "1.0.0")
        del results
        index = md.encode_index(out.n, hasher.hexdigest())
        write_s = time.perf_counter() - t0
        peak = _rss("VmHWM") - base
        files = {f"__{r}_0.distcp": int(bounds[r + 1] - bounds[r]) * 4096 for r in range(world)}
        verified = (
            _verify_side(Path(tmp), index, files, baseline=bounds[-1] <= 2_000_000)
            if verify
            else {}
        )
        checked = None
        if bounds[-1] <= 2_000_000:  # read back as a load reads it: every chunk, checked
            from dcpkit.formats.structure import metadata_problems
            from dcpkit.safe_pickle import load_metadata

            with open(Path(tmp) / ".metadata", "rb") as f:
                parsed = load_metadata(f, ".metadata")
            problems = metadata_problems(parsed)
            assert not problems, problems[:3]
            listed = sum(len(getattr(m, "chunks", ())) for m in parsed.state_dict_metadata.values())
            checked = listed - sum(
                len(getattr(m, "chunks", ())) for m in md.state_dict_metadata.values()
            )
            assert checked == bounds[-1], (checked, bounds[-1])
        return {
            "described_results_bytes": gathered,
            "described_receive_s": receive_s,
            "described_metadata_s": write_s,
            "described_metadata_bytes": out.n,
            "described_index_bytes": len(index or b""),
            "described_chunks": int(bounds[-1]),
            "described_chunks_read_back": checked,
            "described_peak_bytes": peak,
            **verified,
        }


def _verify_side(folder: Path, index: bytes, files: dict[str, int], baseline: bool) -> dict:  # type: ignore[type-arg]
    """``dcpkit verify``'s reading of that ``.metadata`` (in arrays: ``formats.metadata_arrays``)
    and its checks: every tensor's chunks in bounds, tiling it, not overlapping; every chunk's
    storage entry inside its data file (each file here as long as the writes' results say, its
    bytes a hole); the index compared with ``.metadata`` entry by entry. Not the records'
    headers nor the checksums, which need the data (810 GB at 405B). In a process of its own:
    its time and peak memory, beside the file's size; with ``baseline``, the same checks on the
    ``Metadata`` DCP's unpickler builds (what every verdict read before, and what a load reads
    without an index), in another."""
    (folder / ".metadata.index").write_bytes(index)
    for name, size in files.items():
        with open(folder / name, "wb") as f:
            f.truncate(max(size, 64))
    code = (
        "import json, sys, time\n"
        "from pathlib import Path\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from planning_scale import _rss\n"
        "from dcpkit.formats.dcp_index import DcpIndex\n"
        "from dcpkit.formats.structure import dcp_problems, index_mismatches\n"
        "folder = Path(sys.argv[1])\n"
        "t0 = time.perf_counter()\n"
        "bounded = sys.argv[3] == '1'\n"
        "problems, md = dcp_problems(folder, headers=False, bounded=bounded)\n"
        "read = md.chunks_read if bounded else None\n"
        "problems += index_mismatches(md, DcpIndex(folder / '.metadata.index'))\n"
        "s = time.perf_counter() - t0\n"
        "print(json.dumps({'verify_s': s, 'verify_peak_bytes': _rss('VmHWM'), "
        "'verify_arrays_bytes': md.nbytes() if bounded else None, 'verify_chunks': read, "
        "'verify_problems': [str(p) for p in problems[:3]]}))\n"
    )

    here = Path(__file__).parent

    def run(bounded: bool) -> dict:  # type: ignore[type-arg]
        proc = subprocess.run(
            [sys.executable, "-c", code, str(folder), str(here), str(int(bounded))],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"verify's checks failed: {proc.stderr[-2000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert not out.pop("verify_problems"), out
        return out  # type: ignore[no-any-return]

    out = run(True)
    if baseline:
        whole = run(False)
        out["verify_whole_s"], out["verify_whole_peak_bytes"] = (
            whole["verify_s"],
            whole["verify_peak_bytes"],
        )
    baseline = subprocess.run(  # the same process, without reading anything: its start's share
        [sys.executable, "-c", "import dcpkit.formats.structure, sys; sys.path.insert(0, "
         f"{str(Path(__file__).parent)!r}); from planning_scale import _rss; print(_rss('VmHWM'))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    out["verify_start_bytes"] = int(baseline.stdout.strip())
    return out


def cell(flavor: str, world: int, stock: bool) -> dict:
    """One (model, world size): the coordinator's planning, cold and cached."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

    from dcpkit.engine import planning
    from dcpkit.formats.structure import metadata_problems
    from dcpkit.safe_pickle import load_metadata

    base = _rss("VmRSS")
    t0 = time.perf_counter()
    plans = build_plans(flavor, world)
    build_s = time.perf_counter() - t0
    n_items = sum(len(p.items) for p in plans)
    t0 = time.perf_counter()
    gathered = sum(len(pickle.dumps(p)) for p in plans)  # what the coordinator receives
    pickle_s = time.perf_counter() - t0
    key = planning.new_key()
    t0 = time.perf_counter()
    final, metadata = planning.CachingPlanner(key).create_global_plan(plans)
    plan_s = time.perf_counter() - t0
    # What the writers report and DCP's finish() pickles into .metadata: a storage entry each.
    t0 = time.perf_counter()
    storage = {}
    for rank, plan in enumerate(final):
        path, offset = f"__{rank}_0.distcp", 0
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                length = 64
            else:
                length = math.prod(item.tensor_data.chunk.sizes) * 4
            storage[item.index] = _StorageInfo(path, offset, length)
            offset += length
    metadata.storage_data = storage
    written = pickle.dumps(metadata)
    metadata_bytes = len(written)
    metadata_s = time.perf_counter() - t0
    peak = _rss("VmHWM") - base
    # What each rank of a load pays for it: the parse, and a verified load's chunk checks.
    t0 = time.perf_counter()
    parsed = load_metadata(io.BytesIO(written), ".metadata")
    parse_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    problems = metadata_problems(parsed)
    check_s = time.perf_counter() - t0
    assert not problems, problems[:3]
    del parsed
    index = _index_side(metadata, written, plans, final, world)
    del written
    kept = sum(len(p.items) for p in final)
    # The second save of the same shapes: every rank's local plan is unchanged and sent empty.
    empty = [SavePlan([], usable=False)] * world
    t0 = time.perf_counter()
    planning.CachingPlanner(key).create_global_plan(empty)
    cached_s = time.perf_counter() - t0
    cached_gathered = sum(len(pickle.dumps(p)) for p in empty)
    stock_s = None
    if stock:  # the baseline: DCP's own planner on the same plans, no cache
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        t0 = time.perf_counter()
        DefaultSavePlanner().create_global_plan(plans)
        stock_s = time.perf_counter() - t0
    del torch
    return {
        "model": flavor,
        "world": world,
        "items": n_items,
        "items_after_dedup": kept,
        "build_plans_s": build_s,
        "gathered_bytes": gathered,
        "pickle_plans_s": pickle_s,
        "global_plan_s": plan_s,
        "dcp_global_plan_s": stock_s,
        "metadata_s": metadata_s,
        "metadata_bytes": metadata_bytes,
        "load_parse_s": parse_s,
        "load_check_s": check_s,
        **index,
        "peak_bytes": peak,
        "cached_global_plan_s": cached_s,
        "cached_gathered_bytes": cached_gathered,
        "global_plans": planning.global_plans(key),
        "caching": planning.CACHING,
    }


METRICS = (
    "global_plan_s",
    "metadata_bytes",
    "peak_bytes",
    "gathered_bytes",
    "load_parse_s",
    "load_check_s",
    "index_s",
    "index_bytes",
    "load_index_s",
    "index_check_s",
    "restart_claim_s",
    "restart_metadata_s",
)


PER_RANK = ("load_index_s", "index_check_s", "restart_claim_s")
"""What one rank pays with the index: about constant in the ranks, extrapolated along a
log-log fit of the measured cells (a straight line through them would turn negative)."""


def _index_side(metadata, written: bytes, plans: list, final: list, world: int) -> dict:  # type: ignore[type-arg]
    """The index of ``.metadata`` (``written``): what the save's coordinator pays to make it,
    and what one rank of a load at the same layout pays to read its own entries from it and to
    check its share of the structure (a verified load), the data files stood in by sparse files
    of their real sizes."""
    import tempfile

    import xxhash

    from dcpkit.formats.dcp_index import DcpIndex
    from dcpkit.formats.dcp_index_write import encode_index
    from dcpkit.formats.structure import index_problems

    t0 = time.perf_counter()
    data = encode_index(metadata, len(written), xxhash.xxh3_64_hexdigest(written))
    index_s = time.perf_counter() - t0
    assert data is not None
    rank = world // 2  # a rank in the middle of the mesh
    wanted: dict = {}
    for item in plans[rank].items:
        chunk = item.tensor_data.chunk if item.tensor_data is not None else None
        region = (list(chunk.offsets), list(chunk.sizes)) if chunk is not None else None
        wanted.setdefault(item.index.fqn, [] if region else None)
        if region:
            wanted[item.index.fqn].append(region)
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    with tempfile.TemporaryDirectory(prefix="dcpkit-index-") as tmp:
        folder = Path(tmp)
        (folder / ".metadata.index").write_bytes(data)
        for name, end in ends.items():
            with open(folder / name, "wb") as f:
                f.truncate(end)
        loads, checks = [], []
        for _ in range(3):  # the median of three: one rank's figures are tenths of a second
            t0 = time.perf_counter()
            index = DcpIndex(folder / ".metadata.index")
            mine = index.metadata(wanted)
            loads.append(time.perf_counter() - t0)
            assert set(mine.state_dict_metadata) == set(wanted)
            t0 = time.perf_counter()
            # its records' headers are read by the load's reader as it reads them (the data
            # files here are stand-ins of their sizes: bounds are checked, headers are not)
            problems = index_problems(folder, index, rank, world, headers=False)
            checks.append(time.perf_counter() - t0)
            assert not problems, problems[:3]
        load_s, check_s = sorted(loads)[1], sorted(checks)[1]
        restart = _restart_side(index, plans, final, rank, world)
    return {
        **restart,
        "index_s": index_s,
        "index_bytes": len(data),
        "load_index_s": load_s,
        "index_check_s": check_s,
        "index_chunks": sum(
            len(getattr(m, "chunks", ())) for m in mine.state_dict_metadata.values()
        ),
    }


def _restart_side(index, plans: list, final: list, rank: int, world: int) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """A restart's first save at the same layout (``engine/plan_seed.py``): what one rank pays
    to take its plan from the index (the median of three; its items are checked to be the ones
    the coordinator's planning gave it) and what the coordinator pays to build the metadata
    from the index; no plans gathered but DCP's empty ones. Up to 64 ranks every rank's share
    is taken, and together they are checked to hold every stored entry exactly once."""
    from dcpkit.engine import plan_seed

    claims = []
    for _ in range(3):
        t0 = time.perf_counter()
        taken = plan_seed.claim(plans[rank], index, rank)
        claims.append(time.perf_counter() - t0)
    assert taken is not None and len(taken) == len(final[rank].items), (rank, len(taken or ()))
    if world <= 64:
        total = sum(len(plan_seed.claim(plans[r], index, r) or ()) for r in range(world))
        assert total == index.stored_entries(), (total, index.stored_entries())
    t0 = time.perf_counter()
    md = plan_seed.global_metadata(index)
    metadata_s = time.perf_counter() - t0
    assert md.planner_data and len(md.state_dict_metadata) == len(index.entries)
    return {"restart_claim_s": sorted(claims)[1], "restart_metadata_s": metadata_s}


READ = re.compile(
    r"checkpoint: read ([\d.]+ \w+) from storage for ([\d.]+ \w+) stored \(([\d.]+)x\)"
)


def replica_reads(replicas: list[int]) -> list[dict]:  # type: ignore[type-arg]
    """What a load reads from storage at R data-parallel replicas: the reference trainer saves
    a checkpoint (1 rank), then resumes it with R ranks in a replicated layout under torchrun,
    once reading each record once per load (dcpkit's reader, the default) and once with each
    rank reading all it needs (``DCPKIT_SHARE_ABOVE=inf``: how every load read before), as the
    log line a user sees reports it."""
    import shutil
    import tempfile

    from dcpkit.launch import torchrun_command, torchrun_env

    config = Path(__file__).resolve().parents[1] / "configs" / "llama3_debugmodel.toml"

    def train(nproc: int, dump: Path, steps: int, env: dict[str, str] | None = None) -> str:
        args = ["--job.config_file", str(config), "--job.dump_folder", str(dump)]
        args += ["--training.steps", str(steps), "--checkpoint.interval", "2"]
        args += ["--parallelism.data_parallel_replicate_degree", str(nproc)]
        args += ["--parallelism.data_parallel_shard_degree", "1"]
        proc = subprocess.run(
            torchrun_command(nproc, args), env=torchrun_env(env), capture_output=True, text=True
        )
        out = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"the trainer failed at {nproc} rank(s):\n{out[-3000:]}")
        return out

    rows = []
    with tempfile.TemporaryDirectory(prefix="dcpkit-replicas-") as tmp:
        saved = Path(tmp) / "saved"
        train(1, saved, 2)
        for r in replicas:
            row: dict = {"replicas": r}  # type: ignore[type-arg]
            for shared in (False, True):
                dump = Path(tmp) / f"r{r}-{int(shared)}"
                shutil.copytree(saved / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
                env = None if shared else {"DCPKIT_SHARE_ABOVE": "inf"}
                found = READ.search(train(r, dump, 3, env))
                if found is None:
                    raise RuntimeError(f"no read report at {r} replicas")
                side = "shared" if shared else "each"
                row[f"{side}_read"], row["stored"] = found.group(1), found.group(2)
                row[f"{side}_ratio"] = float(found.group(3))
                shutil.rmtree(dump)
            print(
                f"  {r} replica(s): a load read {row['each_read']} ({row['each_ratio']:.2f}x of "
                f"{row['stored']} stored) with each rank reading for itself, {row['shared_read']} "
                f"({row['shared_ratio']:.2f}x) shared",
                flush=True,
            )
            rows.append(row)
    return rows


def _s(v: float | None) -> str:
    return f"{v:.2f} s" if v is not None else "not run"


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points) or 1.0
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def _slope(points: list[tuple[int, float]]) -> float:
    """Growth exponent: the slope of log y against log x, fitted over the measured world sizes
    from 32 on (the smallest ones are dominated by fixed costs); 1.0 = linear."""
    pts = [(math.log(x), math.log(y)) for x, y in points if x >= 32 and y > 0]
    if len(pts) < 2:
        pts = [(math.log(x), math.log(y)) for x, y in points if y > 0]
    return _fit(pts)[1] if len(pts) >= 2 else float("nan")


def _cell_result(spec: str) -> dict:
    flavor, world, stock, *kind = spec.split(":")
    if kind:
        return described_cell(flavor, int(world), stock == "1", kind[0] == "described-verify")
    return cell(flavor, int(world), stock == "1")


def _preload() -> None:
    """What every cell imports, imported once here: each cell's process is forked from this
    one, so it starts with torch imported instead of paying its import (~3 s) again."""
    import numpy  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import xxhash  # noqa: F401
    from torch.distributed.checkpoint import default_planner, filesystem  # noqa: F401

    from dcpkit.engine import described, described_write, plan_seed, planning  # noqa: F401
    from dcpkit.formats import dcp_index, dcp_index_write, structure  # noqa: F401


def _run_cell(spec: str, what: str) -> dict | None:
    """One cell in a process of its own (its peak memory is its own, measured from its start),
    forked from this one; None when it failed (its traceback on stderr)."""
    return forked(lambda: _cell_result(spec), what)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="8B,70B,405B")
    parser.add_argument("--max-world", type=int, default=8192)
    parser.add_argument(
        "--max-items",
        type=float,
        default=6e6,
        help="largest cell run on this machine, in write items (default 6e6: ~4 GiB)",
    )
    parser.add_argument(
        "--dcp-max-items",
        type=float,
        default=1.2e6,
        help="largest cell on which DCP's own planner (the baseline, quadratic) is timed too",
    )
    parser.add_argument(
        "--replicas",
        default="1,2,4,8",
        help="replica counts a load is measured at (the trainer under torchrun); '' skips it",
    )
    parser.add_argument(
        "--described-max-items",
        type=float,
        default=1.5e8,
        help="largest cell whose described save writes its .metadata here (default: all)",
    )
    parser.add_argument(
        "--verify-min-world",
        type=int,
        default=128,
        help="smallest world size whose described .metadata `dcpkit verify` reads and checks",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path, help="plot (default: next to --json)")
    parser.add_argument("--_cell", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts._cell:  # one cell alone, in this process (its figures as JSON)
        print("RESULT " + json.dumps(_cell_result(opts._cell)), flush=True)
        return 0
    _preload()
    models = [m.strip() for m in opts.models.split(",") if m.strip()]
    for m in models:
        if m not in FLAVORS:
            parser.error(f"unknown model {m!r}; known: {', '.join(FLAVORS)}")
    worlds = [w for w in (2**k for k in range(3, 14)) if w <= opts.max_world]
    rows: list[dict] = []
    for m in models:
        for w in worlds:
            if items_per_rank(m) * w > opts.max_items:
                continue
            stock = items_per_rank(m) * w <= opts.dcp_max_items
            r = _run_cell(f"{m}:{w}:{int(stock)}", f"{m} at {w} ranks")
            if r is None:
                return 1
            r["measured"] = True
            rows.append(r)
            print(
                f"  {m:>4} {w:>5} ranks: {r['items'] / 1e6:6.2f} M items, global plan "
                f"{r['global_plan_s']:7.2f} s (DCP's planner: {_s(r['dcp_global_plan_s'])}), "
                f".metadata {r['metadata_bytes'] / 2**20:8.1f} MiB, "
                f"peak {r['peak_bytes'] / 2**30:5.2f} GiB, cached {r['cached_global_plan_s']:.4f} s"
                f", global plannings {r['global_plans']}; a load's parse "
                f"{r['load_parse_s']:.2f} s, structure checks {r['load_check_s']:.2f} s; index "
                f"{r['index_bytes'] / 2**20:.1f} MiB made in {r['index_s']:.2f} s, a rank reads "
                f"its {r['index_chunks']} chunks in {r['load_index_s']:.3f} s, checks its share "
                f"in {r['index_check_s']:.3f} s; a restart's first save: 0 plannings, a rank takes "
                f"its plan in {r['restart_claim_s']:.3f} s, the coordinator its metadata in "
                f"{r['restart_metadata_s']:.2f} s, {r['cached_gathered_bytes']} B of plans "
                "gathered",
                flush=True,
            )
    growth = {}
    for m in models:
        measured = [r for r in rows if r["model"] == m]
        if len(measured) < 2:
            continue
        growth[m] = {k: _slope([(r["world"], r[k]) for r in measured]) for k in METRICS}
        fits = {k: _fit([(r["world"], r[k]) for r in measured]) for k in METRICS}
        for w in worlds:
            if any(r["model"] == m and r["world"] == w for r in rows):
                continue
            est = {k: fits[k][0] + fits[k][1] * w for k in METRICS}
            for k in PER_RANK:  # they do not grow linearly: along their log-log fit
                pts = [(r["world"], r[k]) for r in measured if r["world"] >= 32] or [
                    (r["world"], r[k]) for r in measured
                ]
                a, g = _fit([(math.log(x), math.log(y)) for x, y in pts])
                est[k] = math.exp(a + g * math.log(w))
            rows.append(
                {"model": m, "world": w, "items": items_per_rank(m) * w, "measured": False, **est}
            )
    for m in models:  # a job's first save planned from the layout: measured at every size
        for w in worlds:
            full = items_per_rank(m) * w <= opts.described_max_items
            kind = "described-verify" if full and w >= opts.verify_min_world else "described"
            d = _run_cell(f"{m}:{w}:{int(full)}:{kind}", f"{m} at {w} ranks (described)")
            if d is None:
                return 1
            row = next((r for r in rows if r["model"] == m and r["world"] == w), None)
            if row is None:  # no planning figures at this size (too few measured to fit)
                row = {"model": m, "world": w, "items": items_per_rank(m) * w, "measured": False}
                rows.append(row)
            row.update(d)
            meta = (
                f"; .metadata {d['described_metadata_bytes'] / 2**20:.1f} MiB written in "
                f"{d['described_metadata_s']:.2f} s from {d['described_results_bytes'] / 2**20:.1f}"
                f" MiB of write results, peak {d['described_peak_bytes'] / 2**30:.2f} GiB"
                if "described_metadata_s" in d
                else ""
            )
            if "verify_s" in d:
                meta += (
                    f"; verify's reading and checks {d['verify_s']:.1f} s, peak "
                    f"{d['verify_peak_bytes'] / 2**30:.2f} GiB (arrays "
                    f"{d['verify_arrays_bytes'] / 2**30:.2f} GiB)"
                )
            print(
                f"  {m:>4} {w:>5} ranks, first save planned from the layout: blocking "
                f"{d['described_blocking_s']:.3f} s (global plannings "
                f"{d['described_global_plans']}), {d['described_gathered_bytes'] / 2**10:.1f} KiB "
                f"of per-rank plans gathered, peak {d['described_blocking_peak_bytes'] / 2**20:.0f}"
                f" MiB{meta}",
                flush=True,
            )
    rows.sort(key=lambda r: (models.index(r["model"]), r["world"]))
    print(
        f"\n{'model':>5} {'ranks':>6} {'items M':>8} {'plan s':>8} {'DCP s':>7} "
        f"{'.metadata MiB':>14} {'gathered MiB':>13} {'peak GiB':>9} {'cached s':>9} "
        f"{'plannings':>9} {'load parse s':>12} {'checks s':>8} {'index MiB':>9} "
        f"{'made s':>7} {'rank reads s':>12} {'its checks s':>12} {'restart rank s':>14} "
        f"{'restart coord s':>15}"
    )
    for r in rows:
        if "global_plan_s" not in r:
            continue  # planned from the layout only: too few measured cells of it to fit
        tag = "" if r["measured"] else "  (extrapolated)"
        cached = f"{r['cached_global_plan_s']:>9.4f}" if r["measured"] else "        -"
        plans = f"{r['global_plans']:>9d}" if r["measured"] else "        -"
        print(
            f"{r['model']:>5} {r['world']:>6} {r['items'] / 1e6:>8.2f} {r['global_plan_s']:>8.2f} "
            f"{_s(r.get('dcp_global_plan_s')).replace(' s', '').replace('not run', '-'):>7} "
            f"{r['metadata_bytes'] / 2**20:>14.1f} {r['gathered_bytes'] / 2**20:>13.1f} "
            f"{r['peak_bytes'] / 2**30:>9.2f} {cached} {plans} {r['load_parse_s']:>12.2f} "
            f"{r['load_check_s']:>8.2f} {r['index_bytes'] / 2**20:>9.1f} {r['index_s']:>7.2f} "
            f"{r['load_index_s']:>12.3f} {r['index_check_s']:>12.3f} "
            f"{r['restart_claim_s']:>14.3f} {r['restart_metadata_s']:>15.2f}{tag}"
        )
    print(
        f"\na job's first save planned from the layout the ranks share:\n{'model':>5} {'ranks':>6} "
        f"{'blocking s':>10} {'gathered KiB':>12} {'blocking peak MiB':>17} {'.metadata MiB':>13} "
        f"{'written s':>9} {'results MiB':>11} {'peak GiB':>8} {'before: plan s':>14}"
    )
    for r in rows:
        if "described_blocking_s" not in r:
            continue
        written = (
            f"{r['described_metadata_bytes'] / 2**20:>13.1f} {r['described_metadata_s']:>9.2f} "
            f"{r['described_results_bytes'] / 2**20:>11.1f} "
            f"{r['described_peak_bytes'] / 2**30:>8.2f}"
            if "described_metadata_s" in r
            else f"{'-':>13} {'-':>9} {'-':>11} {'-':>8}"
        )
        before = f"{r['global_plan_s']:>14.2f}" if "global_plan_s" in r else f"{'-':>14}"
        print(
            f"{r['model']:>5} {r['world']:>6} {r['described_blocking_s']:>10.3f} "
            f"{r['described_gathered_bytes'] / 2**10:>12.1f} "
            f"{r['described_blocking_peak_bytes'] / 2**20:>17.0f} {written} {before}"
        )
    print("\ngrowth exponent, log-log fit over the measured world sizes >= 32 (1.0 = linear):")
    for m, g in growth.items():
        print(f"  {m}: " + ", ".join(f"{k} {v:.2f}" for k, v in g.items()))
    replicas = [int(r) for r in opts.replicas.split(",") if r.strip()]
    reads = []
    if replicas:
        print("\nbytes a load reads from storage, by data-parallel replicas:")
        reads = replica_reads(replicas)
    result = {
        "command": " ".join(["python", "benchmarks/planning_scale.py", *sys.argv[1:]]),
        "tp": TP, "max_items": opts.max_items, "rows": rows, "growth": growth, "reads": reads,
    }  # fmt: skip
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {opts.json}")
    png = opts.png or (opts.json.with_suffix(".png") if opts.json else None)
    if png:
        _plot(rows, models, png)
        print(f"wrote {png}")
    return 0


def _plot(rows: list[dict], models: list[str], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [
        ("global_plan_s", "coordinator's global planning (s)", 1),
        ("metadata_bytes", ".metadata (MiB)", 2**20),
        ("peak_bytes", "coordinator's peak memory (GiB)", 2**30),
    ]
    for ax, (key, title, scale) in zip(axes, panels):
        for m in models:
            pts = [r for r in rows if r["model"] == m]
            meas = [(r["world"], r[key] / scale) for r in pts if r["measured"]]
            ext = [(r["world"], r[key] / scale) for r in pts if not r["measured"]]
            (line,) = ax.plot(*zip(*meas), "o-", label=f"Llama 3 {m}") if meas else (None,)
            if ext:
                color = line.get_color() if line else None
                first = meas[-1:] + ext
                ax.plot(*zip(*first), "--", color=color, alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (TP 8 x FSDP)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle("DCP save planning, model + AdamW (solid: measured; dashed: extrapolated)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
