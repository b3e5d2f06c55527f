"""Under torchrun: every kind of value a user's ``state_dict()`` may hold, saved through
CheckpointManager and loaded into fresh objects, in each async mode, as a state shared by all
ranks and as a per-rank one; each value compared for type and content.

state_matrix.py FOLDER_OR_URL    # prints "MATRIX OK <n values> <modes>" or the mismatches
"""

import collections
import sys

import numpy as np
import torch
import torch.distributed as torch_dist

from dcpkit import CheckpointConfig, CheckpointManager, dist

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.bool, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


def matrix(seed: int) -> dict:
    """The values, their content drawn from ``seed`` (the same types and shapes for any seed)."""
    g = torch.Generator().manual_seed(seed)
    v: dict = {}
    for dt in DTYPES:
        name = str(dt).removeprefix("torch.")
        base = torch.randint(0, 100, (2, 3), generator=g)
        if dt.is_floating_point or dt.is_complex:
            base = base.double() / 7
        v[f"scalar_{name}"] = base[0, 0].to(dt)  # a 0-dim tensor: the commonest counter
        v[f"tensor_{name}"] = base.to(dt)
    v["empty"] = torch.empty(0, 3)
    v["non_contiguous"] = torch.rand(3, 4, generator=g).t()[1:]
    shared = torch.rand(5, generator=g)
    v["shared_a"], v["shared_b"] = shared, shared
    n = int(torch.randint(0, 1000, (), generator=g))
    v.update(
        int=n, float=n / 3, bool=n % 2 == 0, str=f"name-{n}", bytes=bytes([n % 256, 0, 7]),
        none=None, complex=complex(n, 1), bytearray=bytearray(b"ab" * (n % 3)),
        dtype=torch.bfloat16, device=torch.device("cpu"), size=torch.Size([n, 2]),
        set={n, n + 1, "x"},
    )  # fmt: skip
    v["nested"] = {"list": [n, n + 1, {"deep": (n, "t")}], "tuple": (torch.tensor(n), n)}
    v["list_of_tensors"] = [torch.tensor(float(n)), torch.arange(n % 5 + 1)]
    v["numpy_array"] = np.arange(4.0) * n
    v["numpy_int_array"] = np.arange(3, dtype=np.int32) + n
    v["numpy_str_array"] = np.array([f"s{n}", "b"])
    v["numpy_int64"], v["numpy_float32"], v["numpy_bool"] = np.int64(n), np.float32(n), np.bool_(n)
    v["ordered"] = collections.OrderedDict([("b", n), ("a", n + 1)])
    v["counter"] = collections.Counter({"a": n})
    return v


class UserState:
    def __init__(self, values: dict) -> None:
        self.values = values

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state)


def difference(a, b, path: str) -> str | None:
    """Why ``b`` (loaded) is not ``a`` (saved): type, dtype, shape or content; None if equal."""
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} saved, {type(b).__name__} loaded"
    if torch.is_tensor(a):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{list(a.shape)} saved, {b.dtype}{list(b.shape)} loaded"
        bits = (lambda t: t.contiguous().reshape(-1).view(torch.uint8)) if a.numel() else None
        if bits and not torch.equal(bits(a), bits(b)):
            return f"{path}: content differs"
        return None
    if isinstance(a, np.ndarray | np.generic):
        same = a.dtype == b.dtype and np.shape(a) == np.shape(b) and np.array_equal(a, b)
        return None if same else f"{path}: {a!r} saved, {b!r} loaded"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} saved, {list(b)} loaded"
        return next((d for k in a if (d := difference(a[k], b[k], f"{path}.{k}"))), None)
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            return f"{path}: {len(a)} items saved, {len(b)} loaded"
        found = (difference(x, b[i], f"{path}[{i}]") for i, x in enumerate(a))
        return next((d for d in found if d), None)
    return None if a == b else f"{path}: {a!r} saved, {b!r} loaded"


def main() -> None:
    root = sys.argv[1].rstrip("/")
    torch_dist.init_process_group("gloo")
    rank = dist.rank()
    problems, modes = [], ["disabled", "async", "async_with_pinned_mem"]
    for mode in modes:
        folder = f"{root}/{mode}"
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        shared, mine = UserState(matrix(1)), UserState(matrix(100 + rank))
        config = CheckpointConfig(enable=True, folder=folder, async_mode=mode, interval=1)
        with CheckpointManager(
            config, ".", model, states={"user": shared}, per_rank_states={"own": mine}
        ) as mgr:
            mgr.save(1)  # asynchronous in the async modes; close() drains it
        fresh_shared, fresh_mine = UserState(matrix(7)), UserState(matrix(70 + rank))
        config = CheckpointConfig(enable=True, folder=folder, load_only=True)
        with CheckpointManager(
            config, ".", model, states={"user": fresh_shared}, per_rank_states={"own": fresh_mine}
        ) as mgr:
            assert mgr.load() == 1
        for name, saved, loaded in (
            ("user", shared.values, fresh_shared.values),
            ("own", mine.values, fresh_mine.values),
        ):
            found = difference(saved, loaded, f"{mode}:{name}")
            if found:
                problems.append(found)
        if not torch.equal(fresh_shared.values["shared_a"], fresh_shared.values["shared_b"]):
            problems.append(f"{mode}: the shared tensor's two entries differ")
    everyone = dist.all_gather_object(problems)
    if rank == 0:
        found = [p for part in everyone for p in part]
        if found:
            print("MATRIX MISMATCH " + " | ".join(found), flush=True)
        else:
            print(f"MATRIX OK {len(matrix(0))} values, {' '.join(modes)}", flush=True)
    torch_dist.barrier()  # no rank leaves while another is still in the group
    dist.settle()  # models still refer to the group (dcpkit.dist.settle)
    torch_dist.destroy_process_group()
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
