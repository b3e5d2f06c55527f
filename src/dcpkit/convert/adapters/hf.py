"""Models whose parameters already carry Hugging Face names (a ``transformers`` model trained
with ``CheckpointManager``): keys are written as they are, with the model's own ``config.json``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from dcpkit.convert.adapters.base import (
    HF_MODEL_TYPES,
    ConversionError,
    KeyPlan,
    ModelAdapter,
    rotary_buffer,
)

_CONFIG_MAX = 16 << 20
_TITAN_NAMED = re.compile(
    r"^(model\.)?(tok_embeddings\.|output\.weight$|"
    r"layers\.\d+\.(attention|feed_forward|moe|attention_norm|ffn_norm)\.)"
)


LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
"""What a ``config.json`` calls its number of layers (GPT-2's is ``n_layer``)."""


def layer_count(config: dict[str, Any]) -> Any:
    """The number of layers a ``config.json`` gives, under whichever name its model uses."""
    return next((config[k] for k in LAYER_NAMES if config.get(k) is not None), None)


@dataclass(frozen=True)
class HFConfig:
    """A ``transformers`` model's ``config.json``, as the model's args."""

    config: dict[str, Any] = field(hash=False)

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or 0)

    @property
    def max_seq_len(self) -> int:
        c = self.config
        return int(c.get("max_position_embeddings") or c.get("n_positions") or 2048)

    @property
    def n_layers(self) -> int:
        return int(layer_count(self.config) or 1)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))


def read_config_json(where: str | Path) -> dict[str, Any]:
    """A ``config.json`` (its path, or the folder that holds it), bounded in size."""
    path = Path(where)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConversionError(
            f"the model's config.json is needed (--config FILE); {path} does not exist"
        )
    if path.stat().st_size > _CONFIG_MAX:
        raise ConversionError(f"{path} is too large for a config.json")
    try:
        config = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} is not a JSON object")
    return config


class HFNamesAdapter(ModelAdapter):
    family = "hf"
    key_map: ClassVar[dict[str, str]] = {}
    flavors: ClassVar[dict[str, Any]] = {}

    def resolve_flavor(self, flavor: str) -> HFConfig:
        """``flavor``: the model's ``config.json`` (or the folder that holds it)."""
        return self.args_from_hf_config(read_config_json(flavor))

    def flavor_name(self, args: Any) -> str | None:
        return str(args.config.get("model_type") or "hf") if isinstance(args, HFConfig) else None

    def args_from_hf_config(self, config: dict[str, Any]) -> HFConfig:
        if not isinstance(config, dict) or "model_type" not in config:
            raise ConversionError("config.json has no model_type: not a transformers config")
        return HFConfig(dict(config))

    def hf_config(self, args: Any, dtype: torch.dtype, bos: int | None, eos: int | None) -> dict:
        config = dict(args.config)
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        if bos is not None:
            config["bos_token_id"] = bos
        if eos is not None:
            config["eos_token_id"] = eos
        return config

    def expected_shapes(self, args: Any) -> dict[str, tuple[int, ...]]:
        return {}  # the checkpoint's own tensors define the model

    def canonical(self, key: str) -> str:
        return key

    def to_hf_key(self, canonical: str) -> str | None:
        return canonical

    def from_hf_key(self, hf_key: str) -> str | None:
        return hf_key

    def plan_to_hf(
        self, shapes: dict[str, tuple[int, ...]], args: Any, flavor: str, where: str
    ) -> KeyPlan:
        titan = sorted(k for k in shapes if _TITAN_NAMED.match(k))
        if titan:  # written as they are, transformers would ignore every one of them
            family = HF_MODEL_TYPES.get(str(args.config.get("model_type")), "llama3")
            raise ConversionError(
                f"{where} holds TorchTitan's parameter names ({', '.join(titan[:3])}, ...), not "
                "the transformers model's: --model hf writes names as they are, and "
                "transformers would load none of them. Export it through its family's key "
                f"map: --model {family}"
            )
        pairs, dropped = [], []
        for key in shapes:
            if key == "lm_head.weight" and args.tie_word_embeddings:
                same = [k for k in shapes if k != key and shapes[k] == shapes[key]]
                tied = next(
                    (k for k in same if "embed" in k or ".wte." in k), "the input embedding"
                )
                dropped.append((key, f"tied to {tied} (HF omits it)"))
            else:
                pairs.append((key, key, None))
        return KeyPlan(pairs, dropped)

    def plan_from_hf(
        self, shapes: dict[str, tuple[int, ...]], args: Any, flavor: str, where: str
    ) -> KeyPlan:
        pairs, dropped = [], []
        for key in shapes:
            if rotary_buffer(key):
                dropped.append((key, "not a parameter (recomputed by the model)"))
            else:
                pairs.append((key, key, None))
        embed = "model.embed_tokens.weight"
        if args.tie_word_embeddings and embed in shapes and "lm_head.weight" not in shapes:
            pairs.append((embed, "lm_head.weight", None))  # the tied output, as the model has it
        return KeyPlan(pairs, dropped)
