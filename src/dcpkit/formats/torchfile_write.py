"""Writing ``torch.save`` files one tensor (or one block of rows) at a time: the archive is laid
out with ``torch.serialization.skip_data`` (so the format is torch's own, its records named
after the final file, as ``torch.save`` names them), then each storage's bytes are filled in
place and each record's CRC-32, computed as its bytes are written, is patched into its local
header and its central directory entry: ``zipfile``'s ``testzip()`` passes and ``dcpkit verify``
can check every byte."""

from __future__ import annotations

import os
import shutil
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dcpkit.formats.torchfile import TensorRef, TorchSaveFile, _walk, walk_refs


def _fake_like(shape: tuple[int, ...], dtype: torch.dtype, mode: Any) -> torch.Tensor:
    with mode:
        return torch.empty(shape, dtype=dtype)


class TorchSaveWriter:
    """Writes a ``torch.save`` file whose tensors are filled in afterwards, block by block.

    ``layout`` is the object to save with ``TensorSpec`` leaves (anything else is saved as is).
    After construction, ``write(key, tensor, rows)`` puts data in place; ``close()`` makes it
    durable. ``torch.load`` reads the result like any other ``torch.save`` file.
    """

    def __init__(
        self,
        path: Path,
        layout: Any,
        leaves: list[tuple[str, tuple[int, ...], torch.dtype]],
        name: str | None = None,
    ) -> None:
        """``name``: the final file's name, which names the archive's records (``path`` may be
        a temporary file that becomes it)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.serialization import skip_data

        self.path = path
        mode = FakeTensorMode()
        fakes: dict[str, torch.Tensor] = {}
        for key, shape, dtype in leaves:
            fakes[key] = _fake_like(shape, dtype, mode)
        obj = _substitute(layout, fakes)
        skeleton = path.parent / f".skeleton-{os.getpid()}-{path.name}"
        skeleton.mkdir()
        try:
            named = skeleton / (name or path.name)
            with skip_data(materialize_fake_tensors=True):
                torch.save(obj, str(named))
            os.replace(named, path)
        finally:
            shutil.rmtree(skeleton, ignore_errors=True)
        # Read the layout back to learn where each storage's bytes went.
        with open(path, "rb") as f:
            reader = TorchSaveFile(f)
            refs = _collect_refs(reader.obj)
            offsets = dict(reader._offsets)
        specs: dict[str, str] = {}
        walk_specs(layout, lambda p, spec: specs.__setitem__(p, spec.key))
        if refs.keys() != specs.keys():
            raise RuntimeError("torch.save layout does not match the tensors to write")
        self._where: dict[str, tuple[int, TensorRef]] = {
            specs[p]: (offsets[ref.record], ref) for p, ref in refs.items()
        }
        # Per record: its CRC-32 so far and the bytes it covers, while writes run in order.
        self._crc: dict[str, tuple[int, int] | None] = {key: (0, 0) for key in self._where}
        self.f = open(path, "r+b")  # noqa: SIM115

    def write(self, key: str, tensor: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        offset, ref = self._where[key]
        row_bytes = ref.nbytes // ref.shape[0] if ref.shape and ref.shape[0] else 0
        at = rows[0] * row_bytes if rows else 0
        data = memoryview(tensor.to(ref.dtype).contiguous().reshape(-1).view(torch.uint8).numpy())
        self.f.seek(offset + at)
        self.f.write(data)
        running = self._crc[key]
        if running is not None and running[1] == at:  # in order: the CRC follows the bytes
            self._crc[key] = (zlib.crc32(data, running[0]), at + len(data))
        else:  # out of order: read the record back at close()
            self._crc[key] = None

    def close(self) -> None:
        """Patch every record's CRC-32 into the archive, then make it durable."""
        self.f.flush()
        crcs = {}
        for key, (offset, ref) in self._where.items():
            running = self._crc[key]
            if running is None or running[1] != ref.nbytes:
                running = (_crc_of(self.f, offset, ref.nbytes), ref.nbytes)
            crcs[ref.record] = running[0]
        _patch_crcs(self.f, crcs)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


_LOCAL_CRC, _CENTRAL_CRC = 14, 16  # the CRC-32 field in a zip local header / central entry
_CENTRAL = struct.Struct("<4s6H3L5H2L")


def _crc_of(f: Any, offset: int, length: int) -> int:
    crc, f_at = 0, offset
    while length > 0:
        f.seek(f_at)
        block = f.read(min(length, 1 << 24))
        if not block:
            raise ValueError("the archive ends inside a record")
        crc, f_at, length = zlib.crc32(block, crc), f_at + len(block), length - len(block)
    return crc


def _patch_crcs(f: Any, crcs: dict[str, int]) -> None:
    """Write ``crcs`` (record name -> CRC-32) into the local header and the central directory
    entry of each record; the other records' (the pickle, the version, ...) are computed from
    their bytes: ``torch.save`` leaves them out while a save elsewhere in the process has
    turned torch's CRC-32 off."""
    f.seek(0)
    archive = zipfile.ZipFile(f)
    pack = struct.Struct("<L").pack
    at = archive.start_dir
    for info in archive.infolist():  # central directory entries, in order
        f.seek(at)
        entry = _CENTRAL.unpack(f.read(_CENTRAL.size))
        name_len, extra_len, comment_len = entry[10], entry[11], entry[12]
        crc = crcs.get(info.filename)
        if crc is None:
            f.seek(info.header_offset)
            local = f.read(30)
            start = info.header_offset + 30 + sum(struct.unpack("<HH", local[26:30]))
            crc = _crc_of(f, start, info.file_size)
        f.seek(at + _CENTRAL_CRC)
        f.write(pack(crc))
        f.seek(info.header_offset + _LOCAL_CRC)
        f.write(pack(crc))
        at += _CENTRAL.size + name_len + extra_len + comment_len
    missing = set(crcs) - {i.filename for i in archive.infolist()}
    if missing:
        raise RuntimeError(f"torch.save wrote no record {sorted(missing)[0]}")


@dataclass(frozen=True)
class TensorSpec:
    """A placeholder for a tensor in the layout given to ``TorchSaveWriter``."""

    key: str


def _substitute(obj: Any, fakes: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, TensorSpec):
        return fakes[obj.key]
    if isinstance(obj, dict):
        return {k: _substitute(v, fakes) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_substitute(v, fakes) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_substitute(v, fakes) for v in obj)
    return obj


def _collect_refs(obj: Any, prefix: str = "") -> dict[str, TensorRef]:
    """Flattened ``{dotted.path: TensorRef}`` of a loaded layout, in pickle order."""
    out: dict[str, TensorRef] = {}
    walk_refs(obj, lambda path, ref: out.__setitem__(path, ref), prefix)
    return out


def walk_specs(obj: Any, fn: Callable[[str, TensorSpec], None]) -> None:
    _walk(obj, TensorSpec, fn, "")
