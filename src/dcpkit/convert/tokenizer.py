"""Tokenizers as users have them, made into what ``AutoTokenizer`` loads offline.

Accepted: a ``tokenizer.json``; a folder of Hugging Face tokenizer files; a tiktoken BPE file
(Meta's Llama 3 ``tokenizer.model``: one ``base64-token rank`` per line); a SentencePiece
``tokenizer.model`` (a protobuf, BPE or unigram, as Llama 2 and many others ship).

Both ``tokenizer.model`` kinds are read as data by this module's own parsers, with every size
bounded by the bytes in the file, and rebuilt as a ``tokenizers`` tokenizer that gives the same
ids: a tiktoken file becomes a byte-level BPE whose merges follow the ranks (with the whole-word
shortcut tiktoken takes), a SentencePiece model keeps its pieces, scores, normalization and byte
fallback.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from pathlib import Path
from typing import Any

from dcpkit.convert.sentencepiece import sentencepiece_to_hf
from dcpkit.convert.tokenizer_files import (  # noqa: F401  (re-exported)
    HF_JSON,
    MAX_TOKENIZER_BYTES,
    SENTENCEPIECE,
    TIKTOKEN,
    Converted,
    TokenizerError,
    read_bounded,
    special_map,
    tokenizer_config,
)

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""The pre-tokenizer pattern of Llama 3's tiktoken tokenizer."""

_LLAMA3_NAMED = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_SPECIAL_TOKENS = _LLAMA3_NAMED + [
    f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(_LLAMA3_NAMED))
]
"""Llama 3's 256 special tokens, numbered after the BPE ranks (128000 ... 128255)."""


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet of GPT-2-style tokenizers: printable bytes stand for themselves,
    the others are shifted above U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE = _bytes_to_unicode()


def detect_model_file(path: Path) -> str:
    """``tiktoken`` or ``sentencepiece`` for a ``tokenizer.model`` file, by its content."""
    head = read_bounded(path)[:4096]
    first = head.split(b"\n", 1)[0].strip()
    if re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+", first):
        return TIKTOKEN
    if head[:1] == b"\x0a":  # field 1 (pieces), length-delimited: a SentencePiece ModelProto
        return SENTENCEPIECE
    raise TokenizerError(
        f"{path} is neither a tiktoken BPE file (lines of 'base64-token rank') nor a "
        "SentencePiece model (a protobuf starting with its pieces)"
    )


# --- tiktoken ------------------------------------------------------------------------------------


def read_tiktoken(path: Path) -> dict[bytes, int]:
    """``{token bytes: rank}`` from a tiktoken BPE file; ranks must be 0 ... n-1, each once."""
    ranks: dict[bytes, int] = {}
    seen: set[int] = set()
    for number, line in enumerate(read_bounded(path).splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise TokenizerError(f"{path}:{number}: expected 'base64-token rank'")
        try:
            token = base64.b64decode(parts[0], validate=True)
        except (binascii.Error, ValueError):
            raise TokenizerError(f"{path}:{number}: the token is not valid base64") from None
        rank = int(parts[1])
        if not token or token in ranks or rank in seen:
            raise TokenizerError(f"{path}:{number}: empty or repeated token or rank {rank}")
        ranks[token] = rank
        seen.add(rank)
    if not ranks:
        raise TokenizerError(f"{path} holds no tokens")
    if seen != set(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks are not 0 ... {len(ranks) - 1} without gaps")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"{path}: {len(missing)} single bytes have no token (e.g. {missing[0]:#04x}); "
            "a byte-level BPE needs all 256"
        )
    return ranks


def tiktoken_to_hf(
    path: Path,
    special_tokens: list[str] | None = None,
    pattern: str = LLAMA3_PATTERN,
    max_len: int | None = None,
) -> Converted:
    """A tiktoken BPE file as a byte-level BPE ``tokenizers`` tokenizer, Llama 3's special tokens
    numbered after the ranks (pass ``special_tokens`` for another list)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    ranks = read_tiktoken(path)
    specials = LLAMA3_SPECIAL_TOKENS if special_tokens is None else special_tokens

    def text(token: bytes) -> str:
        return "".join(BYTE_TO_UNICODE[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    # tiktoken merges the adjacent pair whose result has the lowest rank: that is the merge order.
    merges.sort()
    model = models.BPE(
        vocab=vocab, merges=[(m[3], m[4]) for m in merges], ignore_merges=True, fuse_unk=False
    )
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    bos = "<|begin_of_text|>" if "<|begin_of_text|>" in specials else None
    eos = "<|end_of_text|>" if "<|end_of_text|>" in specials else None
    if bos:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
        )
    config = tokenizer_config(bos, eos, None, max_len, tok)
    return Converted(tok.to_str(), config, TIKTOKEN, special_map(bos, eos, None))


def write_tiktoken(tokenizer_json: str, path: Path) -> int:
    """Write the byte-level BPE of ``tokenizer_json`` as a tiktoken file (special tokens left
    out, ranks in id order). Returns the number of tokens written."""
    data = json.loads(tokenizer_json)
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise TokenizerError("only a byte-level BPE tokenizer.json can be written as tiktoken")
    special = {t["content"] for t in data.get("added_tokens", [])}
    decode = {c: b for b, c in BYTE_TO_UNICODE.items()}
    items = sorted((i, t) for t, i in model["vocab"].items() if t not in special)
    with open(path, "w") as f:
        for rank, (_, token) in enumerate(items):
            raw = bytes(decode[c] for c in token)
            f.write(f"{base64.b64encode(raw).decode()} {rank}\n")
    return len(items)


def convert_model_file(path: Path, max_len: int | None = None) -> Converted:
    """A ``tokenizer.model`` (tiktoken or SentencePiece) as a Hugging Face tokenizer."""
    kind = detect_model_file(path)
    if kind == TIKTOKEN:
        return tiktoken_to_hf(path, max_len=max_len)
    return sentencepiece_to_hf(path, max_len=max_len)


def load_tokenizer(path: str | Path) -> tuple[Any, str]:
    """A ``tokenizers.Tokenizer`` from any accepted source, and the source's kind."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        elif (path / "tokenizer.model").is_file():
            path = path / "tokenizer.model"
        else:
            raise TokenizerError(f"{path} holds neither tokenizer.json nor tokenizer.model")
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {path} does not exist")
    if path.suffix == ".json":
        try:
            return Tokenizer.from_str(read_bounded(path).decode("utf-8")), HF_JSON
        except Exception as e:
            raise TokenizerError(f"{path} is not a tokenizer.json that loads: {e}") from None
    converted = convert_model_file(path)
    return Tokenizer.from_str(converted.tokenizer_json), converted.source_kind
