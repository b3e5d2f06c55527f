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


IMPLEMENTATION_TOLERANCE = 1e-4  # two implementations of one model on the same weights, fp32


def logits_tolerance(dtypes: set[torch.dtype], scale: float) -> tuple[float, str]:
    """How far an export's logits may be from its source's: the implementations' own float32
    disagreement, or, when weights were rounded to a narrower dtype, 8 times that dtype's
    epsilon times the largest logit (rounding each weight by up to half an epsilon moves every
    logit by a few epsilons of its size). Returns the tolerance and how it was chosen."""
    narrow = [d for d in dtypes if d.is_floating_point and d.itemsize < 4]
    if not narrow:
        return IMPLEMENTATION_TOLERANCE, "float32 weights: the implementations' tolerance"
    eps = max(torch.finfo(d).eps for d in narrow)
    name = str(max(narrow, key=lambda d: torch.finfo(d).eps)).removeprefix("torch.")
    tol = max(IMPLEMENTATION_TOLERANCE, 8 * eps * max(1.0, scale))
    return tol, f"{name} weights: 8 x its epsilon ({eps:.3g}) x the largest logit ({scale:.3g})"


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))


def _against_source(
    result: Any, exported: torch.Tensor, source: torch.Tensor, dtypes: Any
) -> float:
    """The export's logits against the source model's: recorded in ``result`` with the
    tolerance the export's dtype implies; raises past it."""
    diff = max_abs_diff(exported, source)
    tol, why = logits_tolerance(set(dtypes), float(source.abs().max()))
    result.logits_tolerance, result.logits_tolerance_why = tol, why
    if diff > tol:
        raise ConversionError(
            f"verification failed: the export's logits differ from the source checkpoint's by "
            f"{diff:.3g}, more than the {tol:.3g} its dtype allows ({why})"
        )
    return diff


def verify_logits(
    adapter: ModelAdapter, args: Any, folder: Path, result: Any, source: Any, dtypes: Any
) -> float | None:
    """Load the exported folder with transformers and compare its float32 logits with dcpkit's
    model given the source checkpoint's own tensors (the difference the export's dtype made is
    in it, within the tolerance that dtype implies); when the export was rounded, also with
    dcpkit's model given the exported weights (names and model code, within 1e-4). ``dtypes``:
    the exported tensors' dtypes."""
    from dcpkit.models import known_models

    if adapter.family == "hf":
        return verify_logits_hf(folder, result, source, dtypes)
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
    ours.eval()
    tokens = _tokens(args.vocab_size)
    with torch.no_grad():
        exported = hf_model(tokens).logits
    if set(dtypes) != {source.dtype(k) for k in _model_keys(source)}:
        # rounded: the exported weights in dcpkit's model check the code and names alone
        written = SafetensorsFolder(folder)
        plan = adapter.plan_from_hf(
            {k: written.shape(k) for k in written.names()}, args, result.flavor, str(folder)
        )
        view = FromHF(written, plan)
        ours.load_state_dict({c: view.read(c).float() for c in view.names()}, strict=True)
        with torch.no_grad():
            same_weights = max_abs_diff(exported, ours(tokens))
        if same_weights > IMPLEMENTATION_TOLERANCE:
            raise ConversionError(
                f"verification failed: transformers' logits differ from dcpkit's on the same "
                f"weights by {same_weights:.3g} (more than {IMPLEMENTATION_TOLERANCE})"
            )
        result.max_implementation_diff = same_weights
    expected = set(ours.state_dict())
    canonical = {adapter.canonical(k): k for k in _model_keys(source)}  # any TorchTitan dialect
    state = {c: source.read(k).float() for c, k in canonical.items() if c in expected}
    ours.load_state_dict(state, strict=True)
    with torch.no_grad():
        return _against_source(result, exported, ours(tokens), dtypes)


def _model_keys(source: Any) -> list[str]:
    return [k for k in source.tensors if source.is_model_key(k)]


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


def verify_logits_hf(folder: Path, result: Any, source: Any, dtypes: Any) -> float | None:
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
    tokens = _tokens(int(config.vocab_size))
    with torch.no_grad():
        return _against_source(result, exported(tokens).logits, rebuilt(tokens).logits, dtypes)
