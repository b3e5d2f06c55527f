"""The files of a Hugging Face folder besides the weights: tokenizer files, special token ids,
``tokenizer_config.json``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from dcpkit.convert.adapters import ConversionError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<|im_end|>")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def find_tokenizer(path: Path) -> dict[str, Path]:
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


def special_ids(tok: dict[str, Path] | None, args: Any) -> tuple[int | None, int | None]:
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


def copy_tokenizer(
    tok: dict[str, Path],
    out: Path,
    args: Any,
    bos: int | None,
    eos: int | None,
    result: Any,
) -> None:
    for name, path in tok.items():
        shutil.copyfile(path, out / name)
    if "tokenizer_config.json" not in tok and "tokenizer.json" in tok:
        data = json.loads(tok["tokenizer.json"].read_text())
        by_id = {t["id"]: t["content"] for t in data.get("added_tokens", [])}
        write_json(
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
