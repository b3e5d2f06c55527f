"""A first save planned from the layout the ranks share (``dcpkit.engine.described``): the
chunk formula against DTensor's own, ownership over every coordinate, and real saves under
torchrun whose metadata equals DCP's own planning and which DCP's own loader reads back."""

import itertools
import json
import math
import subprocess

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from conftest import cli, run_script
from dcpkit.engine import chunk_layout, described, planning
from dcpkit.engine.chunk_layout import Layout

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None


class _Fake:
    """Enough of a DTensor and its mesh for ``layout_of``."""

    def __init__(self, shape, mesh_shape, coordinate, placements):
        self.shape, self.ndim, self.placements = torch.Size(shape), len(shape), placements
        ranks = torch.arange(math.prod(mesh_shape)).view(mesh_shape)
        self.device_mesh = type(
            "Mesh",
            (),
            {"mesh": ranks, "shape": mesh_shape, "get_coordinate": lambda s: list(coordinate)},
        )()


CASES = [  # global shape, mesh shape, placements
    ((3, 8), (4,), [Shard(0)]),  # uneven: one zero-size chunk
    ((10, 7), (2, 3), [Replicate(), Shard(0)]),  # HSDP
    ((16, 6), (2, 2), [Shard(0), Shard(1)]),
    ((13, 5), (2, 3), [Shard(0), Shard(0)]),  # two mesh dims on one tensor dim
    ((0, 4), (2,), [Shard(0)]),  # no elements
    ((5,), (2, 2), [Shard(0), Replicate()]),
]
if _StridedShard is not None:  # FSDP over TP: (dp, tp), TP's chunk split by FSDP inside
    CASES += [((17, 4), (2, 3), [_StridedShard(0, split_factor=3), Shard(0)])]


@pytest.mark.parametrize("shape, mesh, placements", CASES)
def test_the_chunk_formula_is_dtensors(shape, mesh, placements):
    layouts = {}
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        fake = _Fake(shape, mesh, coordinate, placements)
        layout = chunk_layout.layout_of(fake)
        layouts[coordinate] = layout
        sizes, offsets = _compute_local_shape_and_global_offset(
            torch.Size(shape), mesh, list(coordinate), placements
        )
        ours = chunk_layout.chunk_at(shape, layout, coordinate)
        if math.prod(sizes) or not math.prod(shape):
            assert ours == (tuple(offsets), tuple(sizes)), coordinate
        else:  # a zero-size chunk: never written, its clamped offsets do not matter
            assert 0 in ours[1]
    # Every element in exactly one listed chunk; exactly one rank writes each chunk.
    any_layout = next(iter(layouts.values()))
    listed = chunk_layout.chunks(shape, any_layout)
    cover = torch.zeros(shape, dtype=torch.int64)
    for c in listed:
        cover[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] += 1
    assert bool((cover == 1).all())
    for number in range(3):
        writers = [
            chunk_layout.chunk_at(shape, lay, coord)
            for coord, lay in layouts.items()
            if chunk_layout.writes(lay, shape, number, math.prod(mesh))
        ]
        expected = sorted((tuple(c.offsets), tuple(c.sizes)) for c in listed)
        assert sorted(writers) == expected


def test_replicas_share_the_writes():
    shape, mesh, placements = (64, 4), (4, 2), [Replicate(), Shard(0)]
    counts = {r: 0 for r in range(4)}
    for number in range(40):
        for coordinate in itertools.product(range(4), range(2)):
            layout = chunk_layout.layout_of(_Fake(shape, mesh, coordinate, placements))
            if chunk_layout.writes(layout, shape, number, 8):
                counts[coordinate[0]] += 1
    assert set(counts.values()) == {20}  # every replica writes a quarter of the chunks


def test_a_submesh_copy_writes_once():
    """FSDP over the dp submesh of a (dp, tp) mesh: the copies (one per tp rank) do not all
    write the tensor; the one holding rank ``key % world`` does."""
    shape = (6, 4)
    copies = [torch.tensor([0, 2]), torch.tensor([1, 3])]  # dp submeshes of a 2 x 2 mesh
    for number in range(4):
        written = []
        for ranks in copies:
            for i in range(2):
                fake = _Fake(shape, (2,), (i,), [Shard(0)])
                fake.device_mesh.mesh = ranks
                layout = chunk_layout.layout_of(fake)
                assert layout is not None and layout.base == int(ranks[0])
                if chunk_layout.writes(layout, shape, number, 4):
                    written.append(chunk_layout.chunk_at(shape, layout, (i,)))
        assert sorted(written) == [((0, 0), (3, 4)), ((3, 0), (3, 4))]


def test_what_cannot_be_described():
    from torch.distributed.tensor import Partial

    assert chunk_layout.layout_of(_Fake((4,), (2,), (0,), [Partial()])) is None
    fake = _Fake((4,), (2,), (0,), [Shard(0)])
    fake.device_mesh.mesh = torch.tensor([0, 3])
    assert chunk_layout.layout_of(fake) is not None  # any stride
    fake = _Fake((4, 4), (2, 2), (0, 0), [Shard(0), Shard(1)])
    fake.device_mesh.mesh = torch.tensor([[0, 3], [1, 2]])
    assert chunk_layout.layout_of(fake) is None  # not base + coordinate . strides
    lay = Layout((2,), 0, (1,), (0,), ((0,),), ())
    assert chunk_layout.chunk_at((5,), lay, (0,)) == ((0,), (3,))


def _result(proc: subprocess.CompletedProcess) -> list[dict]:
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.dist
@pytest.mark.parametrize(
    "nproc, mode, layout",
    [
        (4, "disabled", "fsdp"),
        (4, "async", "hsdp"),
        (4, "async_with_pinned_mem", "tp"),
        (2, "disabled", "ddp"),
    ],
)
def test_a_first_save_gathers_no_plans(tmp_path, nproc, mode, layout):
    if not planning.CACHING:
        pytest.skip("this torch's DCP cannot cache save plans")
    folder = tmp_path / "ckpt"
    proc = run_script(nproc, "first_save_plans.py", str(folder), mode, layout)
    ranks = _result(proc)
    # No global planning on any rank, at the first save or the second (cached).
    assert [r["plans"] for r in ranks] == [[0, 0]] * nproc
    assert "is planned from the layout every rank shares" in proc.stderr
    assert "no plans gathered but the per-rank states' (reader, rng)" in proc.stderr
    # DCP's own load reads both steps back bit for bit on every rank (per-rank state too).
    assert all(r["bitwise"] == [True, True] for r in ranks)
    # The same keys, shapes, dtypes, paths and chunks with data as DCP's own planning.
    for compared in ranks[0]["compare"]:
        assert compared["problems"] == [] and compared["keys"] > 100
    for step in (1, 2):
        verified = cli("verify", str(folder / f"step-{step}"))
        assert verified.returncode == 0, verified.stdout + verified.stderr


@pytest.mark.dist
def test_described_plans_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv(described.ENV, "0")
    proc = run_script(2, "first_save_plans.py", str(tmp_path / "ckpt"), "disabled", "fsdp")
    ranks = _result(proc)
    assert [r["plans"] for r in ranks] == [[1, 1], [0, 0]]  # rank 0 plans the first save
    assert "planned from the layout" not in proc.stderr
    assert all(r["bitwise"] == [True, True] for r in ranks)


def _streamed_case():
    """A described save's coordinator side, by hand: two DTensors and a value, the write
    results of 4 ranks as rows, and the Metadata DCP's own finish would pickle for them."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.storage import WriteResult

    from dcpkit.engine.described_write import StreamedMetadata, compact

    props = TensorProperties(dtype=torch.float32)
    col = Layout((2, 2), 0, (2, 1), (0, 0), ((1, 0), ()), ())  # FSDP inside TP's piece
    row = Layout((2, 2), 0, (2, 1), (0, 0), ((0,), (1,)), ())
    cube = Layout((2, 2), 0, (2, 1), (0, 0), ((0,), (), (1,)), ())
    scalar = Layout((2, 2), 0, (2, 1), (0, 0), (), (0, 1))
    dtensors = [
        ("a.w", props, (17, 4), col),
        ("b.w", props, (6, 10), row),
        ("c.w", props, (3, 5, 70000), cube),
        ("d.step", props, (), scalar),
    ]
    numbers = {fqn: (i, size, lay) for i, (fqn, _, size, lay) in enumerate(dtensors)}
    results, expected_storage, expected = [[] for _ in range(4)], {}, {}
    for fqn, _, size, lay in dtensors:
        listed = chunk_layout.chunks(size, lay)
        expected[fqn] = TensorStorageMetadata(props, torch.Size(size), listed)
        for i, c in enumerate(listed):
            rank = i % 4
            at = 1000 * i + (5 << 33 if i == 1 else 0)  # a file offset past 2**32
            info = _StorageInfo(f"__{rank}_0.distcp", at, 7 + i)
            results[rank].append(WriteResult(MetadataIndex(fqn, c.offsets), 7 + i, info))
            expected_storage[MetadataIndex(fqn, c.offsets)] = info
    other = WriteResult(MetadataIndex("step"), 9, _StorageInfo("__0_0.distcp", 5, 9))
    results[0].append(other)
    expected_storage[other.index] = other.storage_data
    small = {"step": BytesStorageMetadata()}
    paths = {"a.w": ("a", "w"), "b.w": ("b", "w"), "step": ("step",)}
    base = Metadata(state_dict_metadata=dict(small), planner_data=paths)
    order = ["a.w", "step", "b.w", "c.w", "d.step"]  # the coordinator's plan order
    streamed = StreamedMetadata(base, dtensors, order)
    compacted = [compact(r, numbers) for r in results]
    want = Metadata(
        state_dict_metadata={**small, **expected}, planner_data=paths,
        storage_data=expected_storage, version="1.0.0",
    )  # fmt: skip
    return streamed, compacted, want


def test_a_streamed_metadata_is_dcps(tmp_path):
    """``.metadata`` written one tensor at a time unpickles (plain pickle, and dcpkit's
    restricted reader) to what DCP's own finish writes; its index says the same."""
    import io
    import pickle

    import xxhash

    from dcpkit.formats.dcp_index import DcpIndex
    from dcpkit.formats.dcp_index_write import encode_index
    from dcpkit.safe_pickle import load_metadata

    streamed, compacted, want = _streamed_case()
    assert all(len(c.rows) for c in compacted) and compacted[0].others  # rows, and the value
    out = io.BytesIO()
    streamed.write_streamed(out, compacted, None, "1.0.0")
    data = out.getvalue()
    for got in (pickle.loads(data), load_metadata(io.BytesIO(data), ".metadata")):
        assert type(got).__name__ == "Metadata" and type(got).__module__.startswith("torch")
        assert got.state_dict_metadata == want.state_dict_metadata
        assert list(got.state_dict_metadata) == ["a.w", "step", "b.w", "c.w", "d.step"]
        assert got.storage_data == want.storage_data
        assert got.planner_data == want.planner_data and got.version == "1.0.0"
    index = streamed.encode_index(len(data), xxhash.xxh3_64_hexdigest(data))
    assert index == encode_index(want, len(data), xxhash.xxh3_64_hexdigest(data))
    (tmp_path / "idx").write_bytes(index)
    assert DcpIndex(tmp_path / "idx").metadata().storage_data == want.storage_data
    # what DCP broadcasts to every rank after the save: small, without the listed chunks
    assert len(pickle.dumps(streamed)) < len(data)


@pytest.mark.parametrize("fault", ["missing", "twice"])
def test_a_streamed_metadata_refuses_writes_that_miss_a_chunk(fault):
    import io

    import numpy as np

    streamed, compacted, _ = _streamed_case()
    rows = compacted[1].rows
    if fault == "missing":
        compacted[1].rows = rows[1:]
    else:
        compacted[2].rows = np.concatenate([compacted[2].rows, rows[:1]])
    with pytest.raises(RuntimeError, match=r"a\.w: the ranks wrote .* chunks of its"):
        streamed.write_streamed(io.BytesIO(), compacted, None, "1.0.0")


def test_a_shard_without_a_layout_is_not_described():
    """A shard whose layout the rank does not know (a staged plan without its layouts, a
    ShardedTensor) is never taken for a whole tensor: every rank plans as DCP does."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem
    from torch.distributed.checkpoint.planner import WriteItemType as T

    def item(kind, offsets, sizes, size):
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        data = TensorWriteData(chunk, TensorProperties(dtype=torch.float32), torch.Size(size))
        return WriteItem(MetadataIndex("w", torch.Size(offsets)), kind, tensor_data=data)

    shard = SavePlan([item(T.SHARD, (4, 0), (4, 8), (8, 8))])
    whole = SavePlan([item(T.TENSOR, (0, 0), (8, 8), (8, 8))])
    assert described.describe(shard, {}, {}).failed == 1
    assert described.describe(whole, {}, {}).failed == 0
    agreed, why = described.decide(
        shard, {}, {}, described.describe(shard, {}, {}), [-1, 0, 0], None, 0, 2
    )
    assert agreed is None and "cannot give" in why
