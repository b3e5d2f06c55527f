"""DCP <-> one ``torch.save`` file, streaming (one tensor, or one row block, at a time).

``to_torch`` keeps the checkpoint's structure (TorchTitan's top-level layout: parameters at the
top, ``optimizer``/``lr_scheduler``/... as nested dicts), as PyTorch's ``dcp_to_torch_save``
does; ``model_only`` writes the parameters alone, ready for ``model.load_state_dict``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from dcpkit.convert.common import DEFAULT_BUDGET, output, progress, row_blocks
from dcpkit.convert.hf import ConversionResult
from dcpkit.formats.blocks import recycled_blocks
from dcpkit.formats.dcp import DCPCheckpoint, meta_tensor, nest, write_dcp
from dcpkit.formats.structure import refuse_broken
from dcpkit.formats.torchfile import TensorRef, TorchSaveFile, UnsupportedContent, walk_refs
from dcpkit.formats.torchfile_write import TensorSpec, TorchSaveWriter
from dcpkit.layout import MODEL, is_model_key
from dcpkit.manifest import build_manifest
from dcpkit.readers import held_view
from dcpkit.storage import open_checkpoint


def to_torch(
    ckpt: str | Path,
    out: str | Path,
    model_only: bool = False,
    force: bool = False,
    budget: int = DEFAULT_BUDGET,
    storage_options: dict[str, Any] | None = None,
    step: int | str | None = None,
) -> ConversionResult:
    """Write a DCP checkpoint (a folder or a URL; or a checkpoint folder with ``step``, a
    number or ``latest``) as one ``torch.save`` file, holding the step read against retention."""
    start = time.perf_counter()
    with (
        held_view(ckpt, storage_options, step=step, purpose="to-torch") as view,
        DCPCheckpoint(view.path, view.opener) as src,
    ):
        refuse_broken(view)
        keys = [k for k in src.tensors if not model_only or src.is_model_key(k)]
        src.check(keys)
        objects = [] if model_only else list(src.objects)
        if not keys and not objects:
            raise ValueError(f"{ckpt} holds nothing to convert")
        flat: dict[tuple[str, ...], Any] = {}
        for k in keys:
            flat[(k,) if model_only else src.path_of(k)] = TensorSpec(k)
        for k in objects:
            flat[src.path_of(k)] = src.read_object(k)
        leaves = [(k, src.shape(k), src.dtype(k)) for k in keys]
        total = sum(src.nbytes(k) for k in keys)
        with output(out, is_dir=False, force=force, storage_options=storage_options) as pending:
            writer = TorchSaveWriter(pending.scratch(), nest(flat), leaves, Path(str(out)).name)
            with progress(total, "to-torch") as bar, recycled_blocks():
                for k in keys:
                    for rows in row_blocks(src.shape(k), src.dtype(k).itemsize, budget):
                        t = src.read(k, rows)
                        writer.write(k, t, rows)
                        bar.update(t.numel() * t.element_size())
            writer.close()
            pending.publish()
    return ConversionResult(
        str(out), tensors=len(keys), bytes=total, seconds=time.perf_counter() - start
    )


def from_torch(
    pth: str | Path,
    ckpt: str | Path,
    force: bool = False,
    budget: int = DEFAULT_BUDGET,
    storage_options: dict[str, Any] | None = None,
    trust_pickle: bool = False,
) -> ConversionResult:
    """Write a ``torch.save`` file (a dict of tensors and plain values) as a DCP checkpoint.
    ``trust_pickle``: the file may name other Python objects (their code runs: only for a file
    you wrote yourself)."""
    start = time.perf_counter()
    with open_checkpoint(pth, storage_options) as view, _open_file(view) as f:
        try:
            archive = TorchSaveFile(f, trust_pickle=trust_pickle)
        except UnsupportedContent:
            raise
        except ValueError as e:
            raise ValueError(f"{pth}: {e}") from None
        if not isinstance(archive.obj, dict):
            raise ValueError(
                f"{pth} holds a {type(archive.obj).__name__}, not a dict of tensors (a state dict)"
            )
        refs: dict[str, TensorRef] = {}
        walk_refs(archive.obj, refs.__setitem__)
        state = _with_meta(archive.obj)
        total = sum(r.nbytes for r in refs.values())
        with (
            output(ckpt, is_dir=True, force=force, storage_options=storage_options) as pending,
            progress(total, "from-torch") as bar,
        ):

            def produce(fqn: str, rows: tuple[int, int] | None) -> torch.Tensor:
                t = archive.read(refs[fqn], rows)
                bar.update(t.numel() * t.element_size())
                return t

            with recycled_blocks():
                write_dcp(
                    pending.scratch(),
                    state,
                    produce,
                    max_chunk_bytes=budget,
                    digests=pending.digests,
                )
            groups = sorted({k.split(".", 1)[0] if not is_model_key(k) else MODEL for k in refs})
            files = pending.describe(pending.local_files())
            pending.write_manifest(build_manifest(None, 1, groups, files, source=str(pth)))
            pending.publish()
    return ConversionResult(
        str(ckpt), tensors=len(refs), bytes=total, seconds=time.perf_counter() - start
    )


def _open_file(view: Any) -> Any:
    if not view.path.is_file():
        raise FileNotFoundError(f"{view.location} is not a file")
    return view.opener(view.path)


def _with_meta(obj: Any) -> Any:
    if isinstance(obj, TensorRef):
        return meta_tensor(obj.shape, obj.dtype)
    if isinstance(obj, dict):
        return {k: _with_meta(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_with_meta(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_with_meta(v) for v in obj)
    return obj
