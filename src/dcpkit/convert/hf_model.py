"""``HFModel``: what the checkpoint engine needs to read and write Hugging Face folders of one
model family (its ``initial_load_in_hf`` and ``last_save_in_hf``): the family's adapter, the
model's args, and the tokenizer to ship."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dcpkit.convert.adapters import ConversionError, get_adapter
from dcpkit.convert.adapters.hf import HFConfig
from dcpkit.convert.fp8 import dequantizing
from dcpkit.convert.views import FromHF
from dcpkit.formats.dcp import DCPCheckpoint
from dcpkit.formats.safetensors import SafetensorsFolder


@dataclass
class HFModel:
    """Model family, args, and the tokenizer to ship with a Hugging Face export.

    ``args``: for a ``transformers`` model (family ``"hf"``), its config (``model.config``),
    that config as a dict, or the path of its ``config.json``; for one of dcpkit's families, a
    flavor name (``"8B"``), the family's model args, or a ``config.json`` (dict, object or
    path) to read them from."""

    family: str
    args: Any
    tokenizer: str | None = None
    peft: dict[str, Any] | None = None
    """For a PEFT model: its adapter's name and LoRA config (``convert.peft.peft_record``),
    recorded beside the base's config so that an export can write the adapter or merge it."""

    def __post_init__(self) -> None:
        from dcpkit.config import ConfigError

        try:
            adapter = get_adapter(self.family)
            self.args = _model_args(adapter, self.args)
        except ConversionError as e:
            raise ConfigError(f"HFModel({self.family!r}, ...): {e}") from None
        if self.tokenizer is not None and not isinstance(self.tokenizer, str | Path):
            raise ConfigError(
                f"HFModel tokenizer must be a path (tokenizer.json or a folder), got "
                f"{type(self.tokenizer).__name__}"
            )

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Before training: the model whose parameters (global shapes) are ``shapes`` can be
        exported by this family with these args, and the tokenizer is there; raises
        ``ValueError`` naming what is wrong (the last save would fail otherwise)."""
        adapter = get_adapter(self.family)
        flavor = adapter.flavor_name(self.args) or "custom"
        adapter.plan_to_hf(shapes, self.args, flavor, "the model given to CheckpointManager")
        if self.tokenizer and not Path(self.tokenizer).exists():
            raise ConversionError(f"the tokenizer {self.tokenizer} does not exist")

    def record(self) -> dict[str, Any]:
        """The model's family and a ``config.json`` of its args, for a checkpoint's manifest:
        an export of the checkpoint then needs no flavor."""
        adapter = get_adapter(self.family)
        record = {
            "family": self.family,
            "config": adapter.hf_config(self.args, torch.float32, None, None),
        }
        return record if self.peft is None else {**record, "peft": self.peft}

    def export(self, view: Any, out: Path) -> None:
        """Write the model of the DCP checkpoint ``view`` into the empty folder ``out``."""
        from dcpkit.convert.hf import write_hf_folder

        adapter = get_adapter(self.family)
        flavor = adapter.flavor_name(self.args) or "custom"
        with DCPCheckpoint(view.path, view.opener) as src:
            write_hf_folder(
                src, out, adapter, self.args, flavor, self.tokenizer, name=view.location
            )

    def read_model(self, view: Any) -> Iterator[tuple[str, str, torch.Tensor]]:
        """``(hf_name, our_name, tensor)`` for every parameter of the Hugging Face folder
        ``view``, one at a time, in this family's layout (RoPE permutation undone)."""
        adapter = get_adapter(self.family)
        folder = SafetensorsFolder(view.path, view.opener)
        try:
            folder = dequantizing(folder, None, view.location)
            plan = adapter.plan_from_hf(
                {k: folder.shape(k) for k in folder.names()},
                self.args,
                adapter.flavor_name(self.args) or "custom",
                view.location,
            )
            view = FromHF(folder, plan)
            for ours in view.names():
                yield view.hf_names(ours)[0], ours, view.read(ours)
        finally:
            folder.close()


def _model_args(adapter: Any, args: Any) -> Any:
    """``args`` as the family's model args (see ``HFModel``)."""
    if isinstance(args, str | Path):
        return adapter.resolve_flavor(str(args))
    to_dict = getattr(args, "to_dict", None)
    if callable(to_dict) and not isinstance(args, dict):  # a transformers PretrainedConfig
        args = to_dict()
    if isinstance(args, dict):
        return adapter.args_from_hf_config(args)
    known = {type(a) for a in adapter.flavors.values()} or {HFConfig}
    if type(args) not in known:
        expected = " or ".join(sorted(t.__name__ for t in known))
        raise ConversionError(
            f"args must be a flavor name, a config.json (a dict, a transformers config or its "
            f"path) or {expected}, got {type(args).__name__}"
        )
    return args
