"""DCP <-> Hugging Face safetensors, streaming, with model-family adapters.

``to_hf`` writes shards + ``model.safetensors.index.json``, ``config.json``,
``generation_config.json`` and tokenizer files; ``from_hf`` writes a model-only DCP checkpoint
that the trainer loads with ``initial_load_path``. Both stage their output and publish it only
when complete (and verified, with ``verify=True``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from dcpkit.convert.adapters import ConversionError, ModelAdapter, get_adapter
from dcpkit.convert.adapters.base import infer_family
from dcpkit.convert.common import DEFAULT_BUDGET, output, progress, row_blocks
from dcpkit.convert.fp8 import dequantizing
from dcpkit.convert.hf_files import (
    copy_tokenizer,
    find_tokenizer,
    special_ids,
    tokenizer_beside,
    write_json,
)
from dcpkit.convert.hf_verify import verify_dcp_tensors, verify_hf_tensors, verify_logits
from dcpkit.convert.model_record import (
    kept_config,
    model_record,
    plausible_args,
    recorded_model,
    resolve_model,
)
from dcpkit.convert.peft import to_peft_folder
from dcpkit.convert.result import ConversionResult
from dcpkit.convert.views import FromHF, ToHF
from dcpkit.formats.blocks import recycled_blocks
from dcpkit.formats.dcp import DCPCheckpoint, meta_tensor, write_dcp
from dcpkit.formats.safetensors import SafetensorsFolder, SafetensorsWriter
from dcpkit.formats.structure import refuse_broken
from dcpkit.layout import MODEL, dtype_name
from dcpkit.manifest import build_manifest
from dcpkit.readers import held_view
from dcpkit.storage import open_checkpoint
from dcpkit.storage.opening import local_path
from dcpkit.units import parse_size

# --- to HF ---------------------------------------------------------------------------------------


def to_hf(
    ckpt: str | Path,
    out: str | Path,
    family: str | None = None,
    flavor: str | Any = None,
    tokenizer: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    verify: bool = False,
    force: bool = False,
    budget: int = DEFAULT_BUDGET,
    storage_options: dict[str, Any] | None = None,
    step: int | str | None = None,
    merge: bool = False,
) -> ConversionResult:
    """Export the model of a DCP checkpoint (a folder or a URL) as a Hugging Face folder.

    ``family``: None infers it from the checkpoint's parameter names (said in the notes);
    ``flavor`` is a flavor name or the model's args (for family ``hf``: its config.json).
    ``step`` (a number or ``latest``): ``ckpt`` is a checkpoint folder. The step read is held
    against the run's retention until the export is written. A step of a PEFT model (its
    manifest records the LoRA config) is exported as its adapter folder, or with ``merge`` as
    the base model with the adapters merged in (``dcpkit.convert.peft``)."""
    start = time.perf_counter()
    with (
        held_view(ckpt, storage_options, step=step, purpose="to-hf") as view,
        DCPCheckpoint(view.path, view.opener) as src,
    ):
        refuse_broken(view)
        recorded, found = recorded_model(view.path), None
        if (
            tokenizer is None
            and (recorded or {}).get("family") == "hf"
            and local_path(view.location)
        ):
            tokenizer = found = tokenizer_beside(Path(view.path))  # a Trainer's output_dir
        said = f"tokenizer: {found}'s, beside the run's checkpoint folder (--tokenizer: another)"
        if (recorded or {}).get("peft") is not None and family in (None, "hf"):
            result = _peft(src, out, str(ckpt), recorded, merge, tokenizer, dtype, verify, force,
                           storage_options, max_shard_size, budget, start)  # fmt: skip
            result.notes += [said] if found else []
            return result
        if merge:
            raise ConversionError(f"{ckpt}: --merge merges a PEFT model's adapters; none is here")
        model = resolve_model(src, recorded, str(ckpt), family, flavor, "to-hf")
        adapter, args, flavor, original = model.adapter, model.args, model.flavor, model.original
        family, inferred = adapter.family, model.inferred
        with output(out, is_dir=True, force=force, storage_options=storage_options) as pending:
            tmp = pending.scratch()
            result, plan, out_dtype = write_hf_folder(
                src,
                tmp,
                adapter,
                args,
                flavor,
                tokenizer,
                dtype,
                max_shard_size,
                budget,
                str(ckpt),
                digests=pending.digests,
                original_config=original,
            )
            result.output = str(out)
            manifest = build_manifest(
                None,
                1,
                [MODEL],
                pending.describe(pending.local_files()),
                dtype=dtype_name(dtype or dominant_dtype(out_dtype.values())),
                source=f"{ckpt} ({family} {flavor})",
            )
            pending.write_manifest(manifest)
            if verify:
                result.max_tensor_diff = verify_hf_tensors(ToHF(src, plan), tmp, out_dtype, budget)
                exported = out_dtype.values()
                result.max_logits_diff = verify_logits(adapter, args, tmp, result, src, exported)
            pending.publish()
    if inferred:
        result.notes.insert(0, inferred)
    result.notes += [said] if found else []
    result.seconds = time.perf_counter() - start
    return result


def _peft(src, out, name, recorded, merge, tokenizer, dtype, verify, force, options, shard, budget,
          start):  # type: ignore[no-untyped-def]  # fmt: skip
    """``to_hf`` of a PEFT step: its adapter folder, or merged (see ``to_hf``)."""
    if verify:
        raise ConversionError(
            f"{name}: --verify compares an export with the step's own model, which for a PEFT "
            "step is the base with its adapters: load the export with PeftModel.from_pretrained "
            "(or, merged, from_pretrained) to check it"
        )
    with output(out, is_dir=True, force=force, storage_options=options) as pending:
        result = to_peft_folder(src, pending, name, recorded, merge, tokenizer, dtype,
                                parse_size(shard), budget)  # fmt: skip
        manifest = build_manifest(None, 1, [MODEL], pending.describe(pending.local_files()),
                                  source=f"{name} (PEFT{', merged' if merge else ''})")  # fmt: skip
        pending.write_manifest(manifest)
        pending.publish()
    result.output, result.seconds = str(out), time.perf_counter() - start
    return result


def write_hf_folder(
    src: DCPCheckpoint,
    dest: Path,
    adapter: ModelAdapter,
    args: Any,
    flavor: str,
    tokenizer: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    budget: int = DEFAULT_BUDGET,
    name: str = "",
    digests: dict[str, tuple[str, int]] | None = None,
    original_config: dict[str, Any] | None = None,
) -> tuple[ConversionResult, Any, dict[str, torch.dtype]]:
    """Write the model of ``src`` into the empty folder ``dest``: safetensors shards and their
    index, ``config.json``, ``generation_config.json`` and the tokenizer files. ``digests``
    receives the shards' checksums, hashed as they are written. ``original_config``: the
    ``config.json`` the model came with, written back changed only where the export must be
    (its dtype; token ids of a tokenizer given), each change listed in the result's notes."""
    tok = find_tokenizer(Path(tokenizer), args.max_seq_len) if tokenizer else None
    keys = [k for k in src.tensors if src.is_model_key(k)]
    if not keys:
        raise ConversionError(f"{name or src.path} holds no model parameters")
    src.check(keys)
    plan = adapter.plan_to_hf({k: src.shape(k) for k in keys}, args, flavor, name or str(src.path))
    view = ToHF(src, plan)
    out_dtype = {hf: dtype or view.dtype(hf) for hf in view.names()}
    result = ConversionResult(str(dest), dropped=plan.dropped, flavor=flavor)
    writer = SafetensorsWriter(
        dest,
        [(hf, view.shape(hf), out_dtype[hf]) for hf in view.names()],
        parse_size(max_shard_size),
        metadata={"source": "dcpkit", "family": adapter.family, "flavor": flavor},
        digests=digests,
    )
    with progress(writer.total_size, "to-hf") as bar, recycled_blocks():
        for hf in view.names():
            itemsize = view.dtype(hf).itemsize
            for rows in row_blocks(view.shape(hf), itemsize, budget, view.row_block(hf)):
                t = view.read(hf, rows).to(out_dtype[hf])
                writer.write(hf, t, rows)
                bar.update(t.numel() * t.element_size())
                del t  # before the next block is read: one block held at a time
    writer.close()
    result.tensors, result.bytes = len(plan.pairs), writer.total_size
    config_dtype = dtype or dominant_dtype(out_dtype.values())
    bos, eos = special_ids(tok, args)
    config = adapter.hf_config(args, config_dtype, bos, eos)
    if original_config is not None:
        config = kept_config(original_config, config_dtype, bos, eos, result.notes)
        bos, eos = config.get("bos_token_id"), config.get("eos_token_id")
    write_json(dest / "config.json", config)
    write_json(
        dest / "generation_config.json",
        {"_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos},
    )
    if tok is not None:
        copy_tokenizer(tok, dest, args, bos, eos, result)
    return result, plan, out_dtype


def dominant_dtype(dtypes: Any) -> torch.dtype:
    """The floating dtype most tensors have (a ``config.json``'s ``torch_dtype``)."""
    dtypes = [d for d in dtypes if d.is_floating_point] or [torch.float32]
    return max(set(dtypes), key=dtypes.count)


# --- from HF -------------------------------------------------------------------------------------


def from_hf(
    hf_dir: str | Path,
    ckpt: str | Path,
    family: str | None = None,
    flavor: str | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = False,
    force: bool = False,
    budget: int = DEFAULT_BUDGET,
    storage_options: dict[str, Any] | None = None,
) -> ConversionResult:
    """Import a Hugging Face folder (a path or a URL) as a model-only DCP checkpoint.
    ``family``: None infers it from the folder's ``config.json`` (said in the notes)."""
    start = time.perf_counter()
    with open_checkpoint(hf_dir, storage_options) as view:
        src = SafetensorsFolder(view.path, view.opener)
        try:
            inferred = None
            if family is None:
                family, why = infer_family(src.config())
                inferred = f"model family {family}: {why} (--model to choose another)"
            adapter = get_adapter(family)
            src = dequantizing(src, dtype, str(hf_dir))
            args, flavor = import_args(adapter, src.config(), flavor, str(hf_dir), src)
            shapes = {k: src.shape(k) for k in src.names()}
            plan = adapter.plan_from_hf(shapes, args, flavor, str(hf_dir))
            mapped = FromHF(src, plan)
            result = ConversionResult(str(ckpt), dropped=plan.dropped, flavor=flavor)
            result.notes += [inferred] if inferred else []
            out_dtype = {c: dtype or mapped.dtype(c) for c in mapped.names()}
            total = sum(mapped.nbytes(c) for c in mapped.names())
            with (
                output(ckpt, is_dir=True, force=force, storage_options=storage_options) as pending,
                progress(total, "from-hf") as bar,
            ):

                def produce(fqn: str, rows: tuple[int, int] | None) -> torch.Tensor:
                    t = mapped.read(fqn, rows).to(out_dtype[fqn])
                    bar.update(t.numel() * t.element_size())
                    return t

                state = {c: meta_tensor(mapped.shape(c), out_dtype[c]) for c in mapped.names()}
                row_block = {c: mapped.row_block(c) for c in mapped.names()}
                tmp = pending.scratch()
                # DCP's writer holds the block it wrote while the next one is produced: two
                # blocks of half the budget each.
                with recycled_blocks():
                    write_dcp(
                        tmp,
                        state,
                        produce,
                        max_chunk_bytes=budget // 2,
                        row_block=row_block,
                        digests=pending.digests,
                    )
                manifest = build_manifest(
                    None,
                    1,
                    [MODEL],
                    pending.describe(pending.local_files()),
                    dtype=dtype_name(dominant_dtype(out_dtype.values())),
                    source=f"{hf_dir} ({family} {flavor})",
                    model=model_record(family, src.config()),
                )
                pending.write_manifest(manifest)
                if verify:
                    result.max_tensor_diff = verify_dcp_tensors(tmp, mapped, out_dtype, budget)
                pending.publish()
        finally:
            src.close()
    result.tensors = len(state)
    result.bytes = sum(meta.numel() * meta.element_size() for meta in state.values())
    result.seconds = time.perf_counter() - start
    return result


def import_args(  # type: ignore[no-untyped-def]
    adapter: ModelAdapter, config: dict | None, flavor: str | None, name: str, src: Any = None
):
    """The model args of a Hugging Face folder: the flavor named (checked against its
    ``config.json``), else its ``config.json`` (checked against the bytes the folder holds)."""
    if flavor is not None:
        args = adapter.resolve_flavor(flavor)
        if config is not None:
            theirs = plausible_args(adapter, config, name, src)
            if adapter.expected_shapes(theirs) != adapter.expected_shapes(args):
                raise ConversionError(
                    f"{name}/config.json does not describe {adapter.family} flavor {flavor} (its "
                    "shapes differ); leave --flavor out to take the model from config.json"
                )
        return args, flavor
    if config is not None:
        args = plausible_args(adapter, config, name, src)
        return args, adapter.flavor_name(args) or "custom (from config.json)"
    raise ConversionError(f"{name} has no config.json; pass --flavor")
