"""Hugging Face folders in and out of TorchTitan's ``Trainer`` through the state-dict adapter
TorchTitan gives its checkpointer (``sd_adapter``: ``to_hf`` and ``from_hf`` of the model's
own names, RoPE permutation included): ``initial_load_in_hf`` starts a run from a Hugging Face
folder, ``last_save_in_hf`` ends it with one.

Both work one layer at a time (the adapters map each transformer layer on its own), so memory
holds a layer, not the model. The export writes ``config.json`` and the tokenizer files when
the run's ``hf_assets_path`` holds them (as TorchTitan's ``download_hf_assets`` leaves it):
``from_pretrained`` needs the ``config.json``."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dcpkit.convert.hf import dominant_dtype
from dcpkit.convert.hf_files import TOKENIZER_FILES, write_json
from dcpkit.convert.model_record import kept_config
from dcpkit.formats.dcp import DCPCheckpoint, meta_tensor
from dcpkit.formats.safetensors import SafetensorsFolder, SafetensorsWriter

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_SHARD_BYTES = 5 << 30  # Hugging Face's own default shard size
_ASSETS = (*TOKENIZER_FILES, "generation_config.json")


def by_layer(names: list[str]) -> list[list[str]]:
    """``names`` grouped by the transformer layer they belong to (``layers.N.`` in TorchTitan's
    names, ``model.layers.N.`` in Hugging Face's), the rest (embeddings, final norm, output)
    as one group first: what an adapter maps together."""
    groups: dict[int, list[str]] = {}
    for name in names:
        m = _LAYER.search(name)
        groups.setdefault(int(m.group(1)) if m else -1, []).append(name)
    return [groups[k] for k in sorted(groups)]


class AdapterHF:
    """dcpkit's Hugging Face codec (``HFCodec``) made of TorchTitan's ``sd_adapter``."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        assets = getattr(adapter, "hf_assets_path", None)
        self.assets = Path(assets) if assets else None

    def config_json(self) -> dict[str, Any] | None:
        """The model's ``config.json`` among the run's Hugging Face assets, if there."""
        path = self.assets / "config.json" if self.assets else None
        if path is None or not path.is_file() or path.stat().st_size > 16 << 20:
            return None
        config = json.loads(path.read_text())
        return config if isinstance(config, dict) else None

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Before training: the adapter maps every parameter of this model (on meta tensors)."""
        for group in by_layer(sorted(shapes)):
            try:
                self.adapter.to_hf({k: meta_tensor(shapes[k], torch.float32) for k in group})
            except Exception as e:
                raise ValueError(
                    f"TorchTitan's state-dict adapter ({type(self.adapter).__name__}) cannot "
                    f"map {group[0]}: {type(e).__name__}: {e}"
                ) from None

    def export(self, view: Any, out: Path) -> None:
        """The model of the DCP checkpoint ``view`` as a Hugging Face folder ``out``."""
        with DCPCheckpoint(view.path, view.opener) as src:
            keys = [k for k in src.tensors if src.is_model_key(k)]
            src.check(keys)
            groups = by_layer(keys)
            layout: list[tuple[str, tuple[int, ...], torch.dtype]] = []
            for group in groups:  # the names, shapes and dtypes, from meta tensors
                hf = self.adapter.to_hf({k: meta_tensor(src.shape(k), src.dtype(k)) for k in group})
                layout += [(name, tuple(t.shape), t.dtype) for name, t in hf.items()]
            meta = {"source": "dcpkit", "adapter": type(self.adapter).__name__}
            writer = SafetensorsWriter(out, layout, _SHARD_BYTES, metadata=meta)
            for group in groups:
                hf = self.adapter.to_hf({k: src.read(k) for k in group})
                for name, tensor in hf.items():
                    writer.write(name, tensor)
                del hf
            writer.close()
        self._write_assets(out, dominant_dtype(d for _, _, d in layout))

    def _write_assets(self, out: Path, dtype: torch.dtype) -> None:
        config = self.config_json()
        if config is None:
            where = f"{self.assets}/config.json" if self.assets else "hf_assets_path/config.json"
            logger.warning(
                "checkpoint: the Hugging Face export %s has no config.json (no %s): "
                "from_pretrained needs the model's config.json beside the weights",
                out,
                where,
            )
            return
        notes: list[str] = []
        write_json(out / "config.json", kept_config(config, dtype, None, None, notes))
        for note in notes:
            logger.info("checkpoint: %s", note)
        for name in _ASSETS:
            if self.assets and (self.assets / name).is_file():
                shutil.copyfile(self.assets / name, out / name)

    def read_model(self, view: Any) -> Iterator[tuple[str, str, torch.Tensor]]:
        """``(hf_names, our_name, tensor)`` of the Hugging Face folder ``view``, a layer at a
        time, through the adapter's ``from_hf``."""
        folder = SafetensorsFolder(view.path, view.opener)
        try:
            for group in by_layer(sorted(folder.names())):
                ours = self.adapter.from_hf({k: folder.read(k) for k in group})
                where = f"{group[0]} (of {len(group)} tensors)"
                for name, tensor in ours.items():
                    yield where, name, tensor
        finally:
            folder.close()
