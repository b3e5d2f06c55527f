"""Hugging Face safetensors folders, read lazily and written tensor by tensor.

The writer lays out every shard up front (header with each tensor's offsets, then the file
preallocated), so tensors can be written in any order and in row blocks: memory holds one block.
Files are the standard format (``safetensors.safe_open`` and ``transformers`` read them).
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dcpkit.formats.base import TensorTable
from dcpkit.formats.blocks import block
from dcpkit.layout import HF_INDEX, HF_SINGLE
from dcpkit.manifest import HashingStream
from dcpkit.safe_pickle import check_file_name, check_inside

_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


def dtype_from_code(code: str) -> torch.dtype:
    try:
        return _CODE_DTYPES[code]
    except KeyError:
        raise ValueError(f"safetensors dtype {code} is not supported") from None


# --- reading -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stored:
    file: Path
    start: int  # absolute offset of the tensor's bytes
    shape: tuple[int, ...]
    dtype: torch.dtype


HEADER_MAX = 100 << 20
"""The largest safetensors header read (the format's own limit)."""


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, offset of the data buffer) of a safetensors file, checked: a JSON object
    whose every tensor has a known dtype, a non-negative shape, and offsets inside the file that
    match that shape and do not overlap."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, HEADER_MAX):
            raise ValueError(f"{path} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} has a corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a corrupt safetensors header: not a JSON object")
    data_start = 8 + n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = _checked_entry(path, name, info)
        if data_start + end > size:
            raise ValueError(f"{path} is truncated: {name} ends past the end of the file")
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, name), (begin, _, other) in itertools.pairwise(spans):
        if begin < end:
            raise ValueError(f"{path} has a corrupt header: {name} and {other} overlap")
    return header, data_start


def _checked_entry(path: Path, name: str, info: Any) -> tuple[int, int]:
    """The data offsets of one header entry, after checking that they fit its shape."""
    try:
        dtype = dtype_from_code(info["dtype"])
        shape = [int(s) for s in info["shape"]]
        begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} has a corrupt header entry for {name!r}: {e}") from None
    if min(shape, default=0) < 0 or begin < 0 or end < begin:
        raise ValueError(f"{path} has a corrupt header entry for {name!r}: {info}")
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    if end - begin != nbytes:
        raise ValueError(
            f"{path}: {name} holds {end - begin} bytes, its shape {shape} needs {nbytes}"
        )
    return begin, end


def read_index(path: Path) -> list[str]:
    """The shard files a Hugging Face index names: plain names in its own folder only."""
    if path.stat().st_size > HEADER_MAX:
        raise ValueError(f"{path} is not a valid index (too large)")
    try:
        weight_map = json.loads(path.read_bytes())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a valid index: {e}") from None
    for name in names:
        check_file_name(name, str(path))
        if not name.endswith(".safetensors"):
            raise ValueError(f"{path} names {name!r}, which is not a .safetensors file")
    return names


class SafetensorsFolder(TensorTable):
    """The tensors of an HF folder (``model.safetensors`` or shards with an index).

    Reads use plain file reads, not a memory map, so that only the block asked for is resident.
    """

    def __init__(self, path: str | Path, opener: Any = None) -> None:
        self.path = Path(path)
        self._open = opener or (lambda p: open(p, "rb"))  # noqa: SIM115
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path} does not exist")
        if self.path.is_file() and self.path.suffix == ".safetensors":
            files = {self.path.name: self.path}
            self.path = self.path.parent
        elif (self.path / HF_INDEX).is_file():
            files = {n: self.path / n for n in read_index(self.path / HF_INDEX)}
        elif (self.path / HF_SINGLE).is_file():
            files = {HF_SINGLE: self.path / HF_SINGLE}
        else:
            found = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not found:
                raise ValueError(
                    f"{self.path} holds no safetensors weights ({HF_SINGLE} or {HF_INDEX}); "
                    "is it a "
                    "Hugging Face model folder?"
                )
            files = {n: self.path / n for n in found}
        self.stored: dict[str, _Stored] = {}
        self.entries = self.stored
        for file in files.values():
            if not file.is_file():
                raise ValueError(f"{file} is named in {HF_INDEX} but missing")
            check_inside(self.path, file, str(self.path))
            header, data_start = read_header(file)
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                self.stored[key] = _Stored(
                    file,
                    data_start + info["data_offsets"][0],
                    tuple(info["shape"]),
                    dtype_from_code(info["dtype"]),
                )
        self._handles: dict[Path, object] = {}

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or rows ``[start, stop)`` of its first dimension (a fresh tensor)."""
        st = self.stored[key]
        shape = list(st.shape)
        row_bytes = st.dtype.itemsize
        for s in shape[1:]:
            row_bytes *= s
        first = 0
        if rows is not None:
            first, shape[0] = rows[0], rows[1] - rows[0]
        n = row_bytes * (shape[0] if shape else 1)
        f = self._handles.get(st.file)
        if f is None:
            f = self._handles[st.file] = self._open(st.file)
        f.seek(st.start + first * row_bytes)  # type: ignore[attr-defined]
        buf = block(n)
        if f.readinto(buf) != n:  # type: ignore[attr-defined]
            raise ValueError(f"{st.file} is truncated inside {key}")
        if n == 0:
            return torch.empty(shape, dtype=st.dtype)
        return torch.frombuffer(buf, dtype=st.dtype).view(shape)

    def config(self) -> dict | None:
        p = self.path / "config.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def close(self) -> None:
        for f in self._handles.values():
            f.close()  # type: ignore[attr-defined]
        self._handles.clear()


# --- writing -------------------------------------------------------------------------------------


@dataclass
class _Entry:
    file: str
    start: int  # absolute file offset of the tensor's bytes
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape[1:]:
            n *= s
        return n


class SafetensorsWriter:
    """Shards laid out in advance, filled by ``write(name, tensor, rows)``, indexed at ``close``."""

    def __init__(
        self,
        folder: Path,
        entries: list[tuple[str, tuple[int, ...], torch.dtype]],
        max_shard_bytes: int,
        metadata: dict[str, str] | None = None,
        digests: dict[str, tuple[str, int]] | None = None,
    ) -> None:
        """``digests`` receives each shard's checksum (name -> (xxh3-64, size)) hashed as it is
        written, for shards written front to back (the order of ``entries``, rows ascending);
        a shard written out of order is left out (its checksum is read back later)."""
        self.folder = folder
        self.digests = digests
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
        size = 0
        for name, shape, dtype in entries:
            n = dtype.itemsize
            for s in shape:
                n *= s
            if shards[-1] and size + n > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, shape, dtype, n))
            size += n
        count = len(shards)
        self.entries: dict[str, _Entry] = {}
        self.files: dict[str, object] = {}
        self.total_size = 0
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{count:05d}.safetensors"
            header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
            offset = 0
            for name, shape, dtype, n in shard:
                header[name] = {
                    "dtype": _DTYPE_CODES[dtype],
                    "shape": list(shape),
                    "data_offsets": [offset, offset + n],
                }
                offset += n
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            data_start = 8 + len(raw)
            f = open(folder / file, "w+b")  # noqa: SIM115
            if digests is not None:
                f = HashingStream(f)
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(data_start + offset)
            self.files[file] = f
            for name, shape, dtype, n in shard:
                begin = header[name]["data_offsets"][0]  # type: ignore[index]
                self.entries[name] = _Entry(file, data_start + begin, shape, dtype)
                self.total_size += n

    def write(self, name: str, tensor: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        e = self.entries[name]
        if tuple(tensor.shape[1:]) != e.shape[1:] and rows is not None:
            raise ValueError(f"{name}: block shape {tuple(tensor.shape)} does not fit {e.shape}")
        data = tensor.to(e.dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
        f = self.files[e.file]
        at = e.start + (rows[0] * e.row_bytes if rows else 0)
        f.seek(at)  # type: ignore[attr-defined]
        f.write(memoryview(data))  # type: ignore[attr-defined]

    def close(self) -> None:
        for file, f in self.files.items():
            f.flush()  # type: ignore[attr-defined]
            os.fsync(f.fileno())  # type: ignore[attr-defined]
            f.close()  # type: ignore[attr-defined]
            if isinstance(f, HashingStream) and self.digests is not None:
                digest = f.digest((self.folder / file).stat().st_size)
                if digest is not None:  # else written out of order: checksummed by reading it
                    self.digests[file] = digest
        index = {
            "metadata": {"total_size": self.total_size},
            "weight_map": {name: e.file for name, e in sorted(self.entries.items())},
        }
        (self.folder / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
