"""The files of a Hugging Face folder besides the weights: tokenizer files, special token ids,
``tokenizer_config.json``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from dcpkit.convert.adapters import ConversionError
from dcpkit.convert.tokenizer import TIKTOKEN, convert_model_file

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<|im_end|>")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def tokenizer_beside(step: Path) -> Path | None:
    """The folder of the run whose local step folder is ``step``, when it holds tokenizer files
    (a ``Trainer``'s ``output_dir``, where dcpkit's integration saves its tokenizer once)."""
    run = Path(step).parent.parent
    return run if any((run / n).is_file() for n in TOKENIZER_FILES) else None


def find_tokenizer(path: Path, max_len: int | None = None) -> dict[str, Path | str]:
    """The tokenizer files to ship, by name: a path to copy or the text to write.

    ``path``: a ``tokenizer.json``, a ``tokenizer.model`` (tiktoken or SentencePiece, converted
    to ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``), or a folder
    of tokenizer files (a folder without ``tokenizer.json`` has its ``tokenizer.model``
    converted; its ``tokenizer_config.json`` and chat template are kept).
    """
    if not path.exists():
        raise FileNotFoundError(f"tokenizer {path} does not exist")
    if path.is_file():
        if path.suffix == ".json":
            return {"tokenizer.json": path}
        found: dict[str, Path | str] = {"tokenizer.model": path}
    else:
        found = {n: path / n for n in TOKENIZER_FILES if (path / n).is_file()}
        if not found:
            raise ConversionError(
                f"{path} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass the "
                "tokenizer.json the trainer wrote to its dump folder"
            )
    if "tokenizer.json" not in found and "tokenizer.model" in found:
        model = Path(found["tokenizer.model"])
        converted = convert_model_file(model, max_len=max_len)
        found["tokenizer.json"] = converted.tokenizer_json
        config = dict(converted.config)
        if "tokenizer_config.json" in found:  # the source's own settings (chat template) win
            config.update(_read_json(Path(found["tokenizer_config.json"])))
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
        found["tokenizer_config.json"] = json.dumps(config, indent=2) + "\n"
        found.setdefault(
            "special_tokens_map.json", json.dumps(converted.special_tokens_map, indent=2) + "\n"
        )
        if converted.source_kind == TIKTOKEN:  # not a SentencePiece model: would mislead loaders
            del found["tokenizer.model"]
    return found


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} is not a JSON object")
    return data


def _text(source: Path | str) -> str:
    return source.read_text() if isinstance(source, Path) else source


def special_ids(tok: dict[str, Path | str] | None, args: Any) -> tuple[int | None, int | None]:
    if tok and "tokenizer.json" in tok:
        data = json.loads(_text(tok["tokenizer.json"]))
        added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        vocab = data.get("model", {}).get("vocab", {})
        ids = vocab.values() if isinstance(vocab, dict) else range(len(vocab))  # unigram: a list
        size = max([*added.values(), *ids], default=-1) + 1
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
    tok: dict[str, Path | str],
    out: Path,
    args: Any,
    bos: int | None,
    eos: int | None,
    result: Any,
) -> None:
    for name, source in tok.items():
        if isinstance(source, Path):
            shutil.copyfile(source, out / name)
        else:
            (out / name).write_text(source)
    if "tokenizer_config.json" not in tok and "tokenizer.json" in tok:
        data = json.loads(_text(tok["tokenizer.json"]))
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
