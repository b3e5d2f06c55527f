"""Whatever a user's ``state_dict()`` holds: saved and loaded with its type and content, in every
async mode, shared by all ranks or per rank, on local disk and S3; what cannot be read back
safely is refused at the save that meets it, naming the state, the key and the reason."""

from __future__ import annotations

import collections
import enum
import json

import numpy as np
import pytest
import torch

from conftest import BUCKET, run_script
from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager
from dcpkit.engine.values import fingerprint, fit_to_saved, tensor_bytes, unstorable

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.bool, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [1, 2])
def test_every_value_round_trips_in_every_mode_locally(tmp_path, nproc):
    proc = run_script(nproc, "state_matrix.py", str(tmp_path / "ckpt"))
    assert "MATRIX OK 60 values, disabled async async_with_pinned_mem" in proc.stdout


@pytest.mark.dist
def test_every_value_round_trips_in_every_mode_on_s3(s3):
    proc = run_script(2, "state_matrix.py", f"s3://{BUCKET}/state-matrix")
    assert "MATRIX OK 60 values, disabled async async_with_pinned_mem" in proc.stdout
    assert s3.exists(f"{BUCKET}/state-matrix/async_with_pinned_mem/step-1/dcpkit.json")


@pytest.mark.dist
def test_a_ddp_loop_resumes_bitwise_with_every_scheduler_and_async_mode(tmp_path):
    """A user's DDP loop with a sampler of 0-dim tensors, stopped at step 4 (the process exits)
    and resumed: loss on every rank, sampler position and lr equal an uninterrupted run's at
    steps 5-8, bit for bit, for StepLR, LambdaLR (a closure), OneCycleLR, SequentialLR and
    ReduceLROnPlateau, each in an async mode taken in turn (every mode seen; ``ddp_user_loop.py
    ROOT PHASE all`` runs every scheduler in every mode)."""

    def result(phase):
        proc = run_script(2, "ddp_user_loop.py", str(tmp_path), phase, timeout=600)
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        return json.loads(line.removeprefix("RESULT "))

    full = result("full")
    result("stop")
    resumed = result("resume")
    assert sorted(full) == [
        "async/LambdaLR", "async/ReduceLROnPlateau", "async_with_pinned_mem/OneCycleLR",
        "disabled/SequentialLR", "disabled/StepLR",
    ]  # fmt: skip
    for combo, steps in full.items():
        for step in ("5", "6", "7", "8"):
            assert resumed[combo][step] == steps[step], (combo, step)
    # the schedules really move, so the lr comparison means something
    for combo, steps in full.items():
        assert len({steps[s][3] for s in steps}) > 1, combo


class _Mode(enum.IntEnum):
    A = 1


_Pair = collections.namedtuple("_Pair", "a b")


class _Thing:
    pass


@pytest.mark.parametrize(
    "value,key,reason",
    [
        ({"obj": _Thing()}, "obj", "_Thing reads back only by running its code"),
        ({"q": collections.deque([1, 2])}, "q", "collections.deque reads back only by running"),
        ({"a": {"b": [1, _Mode.A]}}, "a.b[1]", "_Mode reads back only"),
        ({"p": _Pair(1, 2)}, "p", "a tuple of another class"),
        ({"d": collections.defaultdict(int)}, "d", "a dict of another class"),
        ({"arr": np.array([object()], dtype=object)}, "arr", "dtype object"),
        ({"k": {(1, 2): 3}}, "k[(1, 2)]", "its key is a tuple"),
        ({"f": print}, "f", "reads back only by running its code"),
        ({"s": torch.zeros(3).to_sparse()}, "s", "sparse_coo tensor"),
    ],
)
def test_what_cannot_be_read_back_is_refused_at_the_first_save(tmp_path, value, key, reason):
    class User:
        def state_dict(self):
            return value

        def load_state_dict(self, state):
            pass

    config = CheckpointConfig(enable=True, folder=str(tmp_path / "c"), interval=1)
    mgr = CheckpointManager(config, tmp_path, torch.nn.Linear(2, 2), states={"user": User()})
    with pytest.raises(CheckpointError) as caught:
        mgr.save(1)
    message = str(caught.value)
    assert f"states['user'], key {key!r} cannot be checkpointed" in message
    assert reason in message
    assert mgr.published_steps() == []
    mgr.close()


def test_storable_values_pass_the_check():
    ok = {"t": torch.tensor(1), "n": np.arange(3), "x": np.float32(1), "s": {1, "a"}, "c": 1j,
          "o": collections.OrderedDict(a=1), "z": torch.Size([2]), "d": torch.bfloat16}  # fmt: skip
    assert unstorable(ok) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprint_takes_every_tensor(dtype):
    base = torch.arange(6).reshape(2, 3)
    values = [base[0, 0].to(dtype), base.to(dtype), torch.empty(0, 2, dtype=dtype),
              base.to(dtype).t(), base.to(dtype)[:, 1]]  # fmt: skip
    prints = [fingerprint({"v": v}) for v in values]
    assert len(set(prints)) == len(prints)  # shape and content tell them apart
    changed = base.clone()
    changed[1, 2] = 0
    assert fingerprint(base.to(dtype)) != fingerprint(changed.to(dtype))
    assert fingerprint(base.to(dtype).t()) == fingerprint(base.to(dtype).t().contiguous())


def test_tensor_bytes_copies_only_what_is_not_contiguous():
    t = torch.arange(6, dtype=torch.int64)
    view = tensor_bytes(t)
    t[0] = 99  # the view reads the tensor's own memory
    assert bytes(view[:8]) == (99).to_bytes(8, "little")
    assert bytes(tensor_bytes(torch.tensor(7, dtype=torch.int16))) == b"\x07\x00"
    assert bytes(tensor_bytes(torch.tensor([1 + 2j]).conj())) == bytes(
        tensor_bytes(torch.tensor([1 - 2j]))
    )


def test_fingerprint_of_sets_and_numpy_does_not_depend_on_repr():
    big = np.zeros(5000)
    other = big.copy()
    other[2500] = 1  # repr() of both elides the middle
    assert fingerprint(big) != fingerprint(other)
    assert fingerprint({"b", "a", "c"}) == fingerprint({"c", "a", "b"})


def test_a_saved_tensor_larger_than_the_files_is_refused():
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    md = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([10**8]), [])
    fitted = fit_to_saved({"h": torch.zeros(2)}, "s", {"s.h": md}, limit=None)
    assert fitted["h"].shape == (10**8,) and fitted["h"].dtype == torch.float32
    with pytest.raises(CheckpointError, match=r"claims a torch.float32 tensor of shape"):
        fit_to_saved({"h": torch.zeros(2)}, "s", {"s.h": md}, limit=1 << 20)


def test_numpy_values_load_from_many_threads_at_once():
    """A load reads with several threads; torch's allow-list is process-wide, and its own
    ``safe_globals`` context dropped NumPy's globals under a thread still loading (7 of 2400
    loads failed that way with 8 threads)."""
    import io
    import threading

    from dcpkit.safe_pickle import load_value

    buf = io.BytesIO()
    torch.save({"a": np.arange(3.0), "n": np.int64(4)}, buf)
    data, errors = buf.getvalue(), []

    def work():
        for _ in range(300):
            try:
                assert load_value(data, "v")["n"] == 4
            except Exception as e:  # collected: the assertion below names them
                errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert np.ndarray not in torch.serialization.get_safe_globals()  # left as it was
