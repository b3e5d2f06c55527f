"""The rules a DCP checkpoint's storage must obey, in one place: every reader (a load's own
reader, the converters, ``diff``) and every verdict (``verify``, ``list``, a load's checks)
calls these, so that a tool that says OK has run what a load refuses on.

- A storage entry (``length`` bytes at ``offset`` of a data file) has no negative offset or
  length and lies inside a file that exists.
- Storage transforms (DCP's extensions, such as compression) are ones this torch's DCP can undo,
  and none in a step dcpkit wrote (it transforms no record).
- The record there is a ``torch.save`` archive of one tensor whose dtype and shape are the ones
  ``.metadata`` gives its chunk (a record's own header decides what its bytes are; a claim in
  ``.metadata`` that the record does not back is refused before anything is allocated).

Each rule's message names the key and the rule; the caller adds the file.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from typing import Any, BinaryIO

import torch

from dcpkit.formats.torchfile import TensorRef, TorchSaveFile


def storage_entry_problem(fqn: str, offset: int, length: int, file_size: int | None) -> str | None:
    """What is wrong with the storage entry of ``fqn``: ``length`` bytes at ``offset`` of a file
    of ``file_size`` bytes (None: the file is missing). None when it holds."""
    if offset < 0:
        return f"{fqn}: negative offset {offset} for its record"
    if length < 0:
        return f"{fqn}: negative length {length} for its record"
    if file_size is None:
        return f"is missing (it holds {fqn})"
    if offset + length > file_size:
        return (
            f"is {file_size} bytes, too short for {fqn} (its record ends at byte "
            f"{offset + length}): it is truncated"
        )
    return None


def open_record(f: BinaryIO, offset: int, length: int, fqn: str) -> TorchSaveFile:
    """The ``torch.save`` archive of ``fqn``'s record, parsed without running code; a
    ``ValueError`` naming the key and the rule when it is not one."""
    try:
        return TorchSaveFile(f, offset, length)
    except (ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{fqn}: not a readable torch.save record ({e})") from None


def record_problem(
    ref: Any, fqn: str, sizes: Sequence[int], dtype: torch.dtype | None
) -> str | None:
    """What is wrong with the tensor a record holds (``ref``, from its own header) as the chunk
    of ``fqn`` of shape ``sizes`` and ``dtype`` (None: not checked) that ``.metadata`` says it
    is. None when it is that tensor."""
    if not isinstance(ref, TensorRef):
        return f"{fqn}: its record holds {type(ref).__name__}, not a tensor"
    shape = [int(s) for s in ref.shape]
    if shape != [int(s) for s in sizes] or (dtype is not None and ref.dtype != dtype):
        what = str(dtype).removeprefix("torch.") if dtype is not None else "tensor"
        return (
            f"{fqn}: its record holds a {shape} {str(ref.dtype).removeprefix('torch.')} tensor, "
            f"where .metadata describes a {[int(s) for s in sizes]} {what} chunk"
        )
    return None


def check_record(
    f: BinaryIO,
    offset: int,
    length: int,
    fqn: str,
    sizes: Sequence[int],
    dtype: torch.dtype | None,
) -> TorchSaveFile:
    """The record of ``fqn``'s chunk, checked against what ``.metadata`` says of it; a
    ``ValueError`` naming the key and the rule broken otherwise."""
    archive = open_record(f, offset, length, fqn)
    problem = record_problem(archive.obj, fqn, sizes, dtype)
    if problem is not None:
        raise ValueError(problem)
    return archive


def transform_problem(fqn: str, name: str, descriptors: Any, raw_only: bool) -> str | None:
    """What is wrong with the storage transforms (DCP's extensions, such as compression) that
    ``.metadata`` names for ``fqn``'s record in file ``name``: in a step dcpkit wrote
    (``raw_only``: it has dcpkit's manifest) any, since dcpkit transforms no record; elsewhere
    names this torch's DCP cannot undo. None when there are none, or DCP can read them."""
    if not descriptors:
        return None
    said = f"{fqn}: .metadata says its record in {name} is stored with transforms"
    names = isinstance(descriptors, list | tuple) and all(isinstance(d, str) for d in descriptors)
    if not names:
        return f"{said} {descriptors!r}, which is no list of transform names"
    said += f" {list(descriptors)}"
    if raw_only:
        return (
            f"{said}, but dcpkit wrote this step (its dcpkit.json) and transforms no record: "
            ".metadata was changed after it was written"
        )
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    try:
        ExtensionRegistry().from_descriptor_list(list(descriptors))
    except Exception as e:  # ValueError for an unknown name or version, or what a class raises
        return f"{said}, which this torch's DCP cannot undo ({e})"
    return None
