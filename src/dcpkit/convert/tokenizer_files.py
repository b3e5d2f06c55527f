"""What the tokenizer readers share: the kinds of tokenizer file, the error they raise, the
converted result, the bounded read and the Hugging Face config they write."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcpkit.convert.adapters import ConversionError

MAX_TOKENIZER_BYTES = 512 << 20
"""A tokenizer file larger than this is refused (Llama 3's is 2.2 MB)."""

TIKTOKEN, SENTENCEPIECE, HF_JSON = "tiktoken", "sentencepiece", "tokenizer.json"


class TokenizerError(ConversionError):
    """A tokenizer file that cannot be read or converted; the message names the file."""


@dataclass
class Converted:
    """A tokenizer ready to write: ``tokenizer.json`` text and ``tokenizer_config.json``."""

    tokenizer_json: str
    config: dict[str, Any]
    source_kind: str
    special_tokens_map: dict[str, str] = field(default_factory=dict)


def read_bounded(path: Path) -> bytes:
    size = path.stat().st_size
    if size > MAX_TOKENIZER_BYTES:
        raise TokenizerError(
            f"{path}: {size} bytes, more than any tokenizer file this reads "
            f"({MAX_TOKENIZER_BYTES >> 20} MiB); is it a tokenizer?"
        )
    return path.read_bytes()


def special_map(
    bos: str | None, eos: str | None, unk: str | None, pad: str | None = None
) -> dict[str, str]:
    names = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
    return {k: v for k, v in names.items() if v}


def tokenizer_config(
    bos: str | None, eos: str | None, unk: str | None, max_len: int | None, tok: Any, pad=None
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **special_map(bos, eos, unk, pad),
    }
    if max_len:
        config["model_max_length"] = max_len
    return config
