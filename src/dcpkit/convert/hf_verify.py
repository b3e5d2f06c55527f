"""Verification of a conversion by reading it back: every tensor compared with its source, and
the float32 logits of the exported folder, loaded by ``transformers``, compared with dcpkit's
own model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dcpkit.convert.adapters import ConversionError, ModelAdapter
from dcpkit.convert.common import max_abs_diff, row_blocks
from dcpkit.convert.views import FromHF
from dcpkit.formats.blocks import recycled_blocks
from dcpkit.formats.dcp import DCPCheckpoint
from dcpkit.formats.safetensors import SafetensorsFolder


def verify_hf_tensors(
    view: Any, folder: Path, out_dtype: dict[str, torch.dtype], budget: int
) -> float:
    """Read every written tensor back and compare it with the source seen through the plan
    (``view``: the source by HF key, transforms applied)."""
    written = SafetensorsFolder(folder)
    worst = 0.0
    with recycled_blocks():
        for hf in view.names():
            shape, itemsize = view.shape(hf), view.dtype(hf).itemsize
            for rows in row_blocks(shape, itemsize, budget, view.row_block(hf)):
                back = written.read(hf, rows)
                source = view.read(hf, rows)
                expected = source.to(out_dtype[hf])
                if not torch.equal(back, expected):
                    raise ConversionError(
                        f"verification failed: {hf} read back differs from {view.source(hf)} "
                        f"(max abs diff {max_abs_diff(back, expected):.3g})"
                    )
                worst = max(worst, max_abs_diff(back.float(), source.float()))
    return worst


def verify_logits(
    adapter: ModelAdapter, args: Any, folder: Path, result: Any, source: Any = None
) -> float | None:
    """Load the folder with transformers and compare float32 logits with dcpkit's model."""
    from dcpkit.models import known_models

    if adapter.family == "hf":
        return verify_logits_hf(folder, result, source)
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
    view = FromHF(written, plan)
    state = {c: view.read(c).float() for c in view.names()}
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


def verify_dcp_tensors(
    folder: Path, view: Any, out_dtype: dict[str, torch.dtype], budget: int
) -> float:
    """Read every tensor of the written DCP folder back and compare it with the HF source
    (``view``: the source by TorchTitan key)."""
    worst = 0.0
    with DCPCheckpoint(folder) as written, recycled_blocks():
        for canon in view.names():
            for rows in row_blocks(
                view.shape(canon), view.dtype(canon).itemsize, budget, view.row_block(canon)
            ):
                back = written.read(canon, rows)
                converted = view.read(canon, rows)
                if not torch.equal(back, converted.to(out_dtype[canon])):
                    raise ConversionError(
                        f"verification failed: {canon} read back differs from "
                        f"{view.hf_names(canon)[0]}"
                    )
                worst = max(worst, max_abs_diff(back.float(), converted.float()))
    return worst


def verify_logits_hf(folder: Path, result: Any, source: Any) -> float | None:
    """A transformers-named export: ``from_pretrained`` of the folder against the same
    architecture rebuilt from its config and given the source checkpoint's tensors."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        result.notes.append("logits not compared: transformers is not installed")
        return None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    exported = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(str(folder))
    rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = rebuilt.state_dict()
    for key in state:
        if key in source.tensors:
            state[key] = source.read(key).float()
    rebuilt.load_state_dict(state, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        rebuilt.tie_weights()
    vocab = int(config.vocab_size)
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = max_abs_diff(exported(tokens).logits, rebuilt(tokens).logits)
    if diff > 1e-4:
        raise ConversionError(
            f"verification failed: the export's logits differ from the checkpoint's by {diff:.3g}"
        )
    return diff
