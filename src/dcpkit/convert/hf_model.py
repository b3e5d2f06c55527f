"""``HFModel``: what the checkpoint engine needs to read and write Hugging Face folders of one
model family (its ``initial_load_in_hf`` and ``last_save_in_hf``): the family's adapter, the
model's args, and the tokenizer to ship."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dcpkit.convert.adapters import get_adapter
from dcpkit.convert.fp8 import dequantizing
from dcpkit.convert.views import FromHF
from dcpkit.formats.dcp import DCPCheckpoint
from dcpkit.formats.safetensors import SafetensorsFolder


@dataclass
class HFModel:
    """Model family, args, and the tokenizer to ship with a Hugging Face export."""

    family: str
    args: Any
    tokenizer: str | None = None

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
