"""DCP <-> Hugging Face safetensors, streaming, with model-family adapters.

``to_hf`` writes shards + ``model.safetensors.index.json``, ``config.json``,
``generation_config.json`` and tokenizer files; ``from_hf`` writes a model-only DCP checkpoint
that the trainer loads with ``initial_load_path``. Both stage their output and publish it only
when complete (and verified, with ``verify=True``).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dcpkit.convert.adapters import ConversionError, ModelAdapter, get_adapter
from dcpkit.convert.common import (
    DEFAULT_BUDGET,
    is_model_key,
    max_abs_diff,
    progress,
    row_blocks,
    staged_output,
)
from dcpkit.convert.dcpio import DCPCheckpoint, meta_tensor, write_dcp
from dcpkit.convert.safetensors_io import SafetensorsFolder, SafetensorsWriter
from dcpkit.integrity import build_manifest, data_files, describe_files, write_manifest
from dcpkit.units import parse_size

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<|im_end|>")


@dataclass
class ConversionResult:
    output: Path
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    dropped: list[tuple[str, str]] = field(default_factory=list)
    flavor: str = ""
    max_tensor_diff: float | None = None
    max_logits_diff: float | None = None
    notes: list[str] = field(default_factory=list)


# --- to HF ---------------------------------------------------------------------------------------


def to_hf(
    ckpt: str | Path,
    out: str | Path,
    family: str,
    flavor: str | Any,
    tokenizer: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    verify: bool = False,
    force: bool = False,
    budget: int = DEFAULT_BUDGET,
) -> ConversionResult:
    """Export the model of a DCP checkpoint as a Hugging Face folder.

    ``flavor`` is a flavor name or the model's args."""
    start = time.perf_counter()
    adapter = get_adapter(family)
    if isinstance(flavor, str):
        args = adapter.resolve_flavor(flavor)
    else:
        args, flavor = flavor, adapter.flavor_name(flavor) or "custom"
    out = Path(out)
    max_shard = parse_size(max_shard_size)
    tok = _find_tokenizer(Path(tokenizer)) if tokenizer else None
    with DCPCheckpoint(ckpt) as src:
        keys = [k for k in src.tensors if is_model_key(k)]
        if not keys:
            raise ConversionError(f"{ckpt} holds no model parameters")
        plan = adapter.plan_to_hf({k: src.shape(k) for k in keys}, args, flavor, str(ckpt))
        out_dtype = {s: dtype or src.dtype(s) for s, _, _ in plan.pairs}
        result = ConversionResult(out, dropped=plan.dropped, flavor=flavor)
        with staged_output(out, is_dir=True, force=force) as tmp:
            writer = SafetensorsWriter(
                tmp,
                [(hf, src.shape(s), out_dtype[s]) for s, hf, _ in plan.pairs],
                max_shard,
                metadata={"source": "dcpkit", "family": family, "flavor": flavor},
            )
            with progress(writer.total_size, "to-hf") as bar:
                for s, hf, tf in plan.pairs:
                    for rows in row_blocks(
                        src.shape(s), src.dtype(s).itemsize, budget, tf.row_block if tf else 1
                    ):
                        t = src.read(s, rows)
                        if tf is not None:
                            t = tf.to_hf(t)
                        t = t.to(out_dtype[s])
                        writer.write(hf, t, rows)
                        bar.update(t.numel() * t.element_size())
            writer.close()
            result.tensors, result.bytes = len(plan.pairs), writer.total_size
            config_dtype = dtype or _dominant_dtype(out_dtype.values())
            bos, eos = _special_ids(tok, args)
            _write_json(tmp / "config.json", adapter.hf_config(args, config_dtype, bos, eos))
            _write_json(
                tmp / "generation_config.json",
                {"_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos},
            )
            if tok is not None:
                _copy_tokenizer(tok, tmp, args, bos, eos, result)
            manifest = build_manifest(
                None,
                1,
                ["model"],
                describe_files(tmp, data_files(tmp)),
                dtype=str(config_dtype).removeprefix("torch."),
                source=f"{ckpt} ({family} {flavor})",
            )
            write_manifest(tmp, manifest)
            if verify:
                result.max_tensor_diff = _verify_hf_tensors(src, tmp, plan, out_dtype, budget)
                result.max_logits_diff = _verify_logits(adapter, args, tmp, result)
    result.seconds = time.perf_counter() - start
    return result


def _dominant_dtype(dtypes: Any) -> torch.dtype:
    dtypes = [d for d in dtypes if d.is_floating_point] or [torch.float32]
    return max(set(dtypes), key=dtypes.count)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _find_tokenizer(path: Path) -> dict[str, Path]:
    """Tokenizer files from a ``tokenizer.json`` / ``tokenizer.model`` file or a folder."""
    if not path.exists():
        raise FileNotFoundError(f"tokenizer {path} does not exist")
    if path.is_file():
        return {path.name if path.name in TOKENIZER_FILES else "tokenizer.json": path}
    found = {n: path / n for n in TOKENIZER_FILES if (path / n).is_file()}
    if not found:
        raise ConversionError(
            f"{path} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass the "
            "tokenizer.json the trainer wrote to its dump folder"
        )
    return found


def _special_ids(tok: dict[str, Path] | None, args: Any) -> tuple[int | None, int | None]:
    if tok and "tokenizer.json" in tok:
        data = json.loads(tok["tokenizer.json"].read_text())
        added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        vocab = data.get("model", {}).get("vocab", {})
        size = (
            max([*added.values(), *(vocab.values() if isinstance(vocab, dict) else [])], default=-1)
            + 1
        )
        if size > args.vocab_size:
            raise ConversionError(
                f"the tokenizer has {size} tokens, more than the model's vocabulary "
                f"({args.vocab_size}); pass the tokenizer the model was trained with"
            )
        bos = next((added[n] for n in _BOS_NAMES if n in added), None)
        eos = next((added[n] for n in _EOS_NAMES if n in added), None)
        return bos, eos
    if args.vocab_size == 128256:  # Llama 3's own tokenizer
        return 128000, 128001
    return None, None


def _copy_tokenizer(
    tok: dict[str, Path],
    out: Path,
    args: Any,
    bos: int | None,
    eos: int | None,
    result: ConversionResult,
) -> None:
    for name, path in tok.items():
        shutil.copyfile(path, out / name)
    if "tokenizer_config.json" not in tok and "tokenizer.json" in tok:
        data = json.loads(tok["tokenizer.json"].read_text())
        by_id = {t["id"]: t["content"] for t in data.get("added_tokens", [])}
        _write_json(
            out / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": by_id.get(bos),
                "eos_token": by_id.get(eos),
                "model_max_length": args.max_seq_len,
                "clean_up_tokenization_spaces": False,
            },
        )
    if "tokenizer.json" not in tok:
        result.notes.append(
            "only tokenizer.model was given: transformers' AutoTokenizer needs tokenizer.json"
        )


def _verify_hf_tensors(
    src: DCPCheckpoint, folder: Path, plan: Any, out_dtype: dict[str, torch.dtype], budget: int
) -> float:
    """Read every written tensor back, undo the transform, compare with the source."""
    written = SafetensorsFolder(folder)
    worst = 0.0
    for s, hf, tf in plan.pairs:
        for rows in row_blocks(
            src.shape(s), src.dtype(s).itemsize, budget, tf.row_block if tf else 1
        ):
            back = written.read(hf, rows)
            if tf is not None:
                back = tf.from_hf(back)
            expected = src.read(s, rows).to(out_dtype[s])
            if not torch.equal(back, expected):
                raise ConversionError(
                    f"verification failed: {hf} read back differs from {s} "
                    f"(max abs diff {max_abs_diff(back, expected):.3g})"
                )
            worst = max(worst, max_abs_diff(back.float(), src.read(s, rows).float()))
    return worst


def _verify_logits(
    adapter: ModelAdapter, args: Any, folder: Path, result: ConversionResult
) -> float | None:
    """Load the folder with transformers and compare float32 logits with dcpkit's model."""
    from dcpkit.models import known_models

    if adapter.family not in known_models():
        result.notes.append(f"logits not compared: dcpkit has no {adapter.family} model")
        return None
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        result.notes.append("logits not compared: transformers is not installed")
        return None
    from dataclasses import replace

    from transformers.utils import logging as hf_logging

    from dcpkit.models import build_model

    hf_logging.disable_progress_bar()
    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf_model.eval()
    with torch.device("meta"):
        ours = build_model(adapter.family, replace(args, max_seq_len=64))
    ours.to_empty(device="cpu")
    ours.init_weights()
    written = SafetensorsFolder(folder)
    plan = adapter.plan_from_hf(
        {k: written.shape(k) for k in written.names()}, args, result.flavor, str(folder)
    )
    state = {}
    for hf, canon, tf in plan.pairs:
        t = written.read(hf)
        state[canon] = (tf.from_hf(t) if tf is not None else t).float()
    ours.load_state_dict(state, strict=True)
    ours.eval()
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = max_abs_diff(hf_model(tokens).logits, ours(tokens))
    if diff > 1e-4:
        raise ConversionError(
            f"verification failed: transformers' logits differ from dcpkit's by {diff:.3g} "
            "(more than 1e-4)"
        )
    return diff


# --- from HF -------------------------------------------------------------------------------------


def from_hf(
    hf_dir: str | Path,
    ckpt: str | Path,
    family: str,
    flavor: str | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = False,
    force: bool = False,
    budget: int = DEFAULT_BUDGET,
) -> ConversionResult:
    """Import a Hugging Face folder as a model-only DCP checkpoint."""
    start = time.perf_counter()
    adapter = get_adapter(family)
    src = SafetensorsFolder(hf_dir)
    config = src.config()
    if flavor is not None:
        args = adapter.resolve_flavor(flavor)
        if config is not None:
            theirs = adapter.args_from_hf_config(config)
            if adapter.expected_shapes(theirs) != adapter.expected_shapes(args):
                raise ConversionError(
                    f"{hf_dir}/config.json does not describe {family} flavor {flavor} (its "
                    "shapes differ); leave --flavor out to take the model from config.json"
                )
    elif config is not None:
        args = adapter.args_from_hf_config(config)
        flavor = adapter.flavor_name(args) or "custom (from config.json)"
    else:
        raise ConversionError(f"{hf_dir} has no config.json; pass --flavor")
    shapes = {k: src.shape(k) for k in src.names()}
    plan = adapter.plan_from_hf(shapes, args, flavor, str(hf_dir))
    sources = {canon: (hf, tf) for hf, canon, tf in plan.pairs}
    out = Path(ckpt)
    result = ConversionResult(out, dropped=plan.dropped, flavor=flavor)
    out_dtype = {c: dtype or src.dtype(hf) for c, (hf, _) in sources.items()}
    total = sum(src.nbytes(hf) for hf, _ in sources.values())
    with staged_output(out, is_dir=True, force=force) as tmp, progress(total, "from-hf") as bar:

        def produce(fqn: str, rows: tuple[int, int] | None) -> torch.Tensor:
            hf, tf = sources[fqn]
            t = src.read(hf, rows)
            t = (tf.from_hf(t) if tf is not None else t).to(out_dtype[fqn])
            bar.update(t.numel() * t.element_size())
            return t

        state = {c: meta_tensor(shapes[hf], out_dtype[c]) for c, (hf, _) in sources.items()}
        row_block = {c: tf.row_block for c, (_, tf) in sources.items() if tf is not None}
        write_dcp(tmp, state, produce, max_chunk_bytes=budget, row_block=row_block)
        files = data_files(tmp)
        manifest = build_manifest(
            None,
            1,
            ["model"],
            describe_files(tmp, files),
            dtype=str(_dominant_dtype(out_dtype.values())).removeprefix("torch."),
            source=f"{hf_dir} ({family} {flavor})",
        )
        write_manifest(tmp, manifest)
        if verify:
            with DCPCheckpoint(tmp) as written:
                worst = 0.0
                for canon, (hf, tf) in sources.items():
                    block = tf.row_block if tf else 1
                    for rows in row_blocks(shapes[hf], src.dtype(hf).itemsize, budget, block):
                        back = written.read(canon, rows)
                        t = src.read(hf, rows)
                        expected = (tf.from_hf(t) if tf is not None else t).to(out_dtype[canon])
                        if not torch.equal(back, expected):
                            raise ConversionError(
                                f"verification failed: {canon} read back differs from {hf}"
                            )
                        worst = max(
                            worst,
                            max_abs_diff(
                                back.float(), t.float() if tf is None else tf.from_hf(t).float()
                            ),
                        )
                result.max_tensor_diff = worst
    result.tensors = len(sources)
    result.bytes = sum(meta.numel() * meta.element_size() for meta in state.values())
    result.seconds = time.perf_counter() - start
    return result
