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
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcpkit.convert.adapters import ConversionError

MAX_TOKENIZER_BYTES = 512 << 20
"""A tokenizer file larger than this is refused (Llama 3's is 2.2 MB)."""

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


def _read_bounded(path: Path) -> bytes:
    size = path.stat().st_size
    if size > MAX_TOKENIZER_BYTES:
        raise TokenizerError(
            f"{path}: {size} bytes, more than any tokenizer file this reads "
            f"({MAX_TOKENIZER_BYTES >> 20} MiB); is it a tokenizer?"
        )
    return path.read_bytes()


def detect_model_file(path: Path) -> str:
    """``tiktoken`` or ``sentencepiece`` for a ``tokenizer.model`` file, by its content."""
    head = _read_bounded(path)[:4096]
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
    for number, line in enumerate(_read_bounded(path).splitlines(), 1):
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
    config = _config(bos, eos, None, max_len, tok)
    return Converted(tok.to_str(), config, TIKTOKEN, _special_map(bos, eos, None))


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


# --- SentencePiece -------------------------------------------------------------------------------

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2


@dataclass
class SentencePieceModel:
    pieces: list[tuple[str, float, int]]
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    split_digits: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True
    precompiled_charsmap: bytes = b""
    treat_whitespace_as_suffix: bool = False


class _Proto:
    """A protobuf wire-format reader over ``data``; every length is checked against the bytes."""

    def __init__(self, data: bytes, path: Path) -> None:
        self.data, self.pos, self.path = data, 0, path

    def fail(self, what: str) -> TokenizerError:
        return TokenizerError(f"{self.path}: not a valid SentencePiece model ({what})")

    def varint(self) -> int:
        value = shift = 0
        while True:
            if self.pos >= len(self.data) or shift > 63:
                raise self.fail("truncated varint")
            b = self.data[self.pos]
            self.pos += 1
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7

    def fields(self):
        while self.pos < len(self.data):
            key = self.varint()
            number, wire = key >> 3, key & 7
            if wire == 0:
                yield number, self.varint()
            elif wire == 1:
                yield number, self.take(8)
            elif wire == 2:
                yield number, self.take(self.varint())
            elif wire == 5:
                yield number, self.take(4)
            else:
                raise self.fail(f"wire type {wire}")

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise self.fail(f"a field of {n} bytes with {len(self.data) - self.pos} left")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def read_sentencepiece(path: Path) -> SentencePieceModel:
    """The parts of a SentencePiece ``ModelProto`` a tokenizer needs."""
    model = SentencePieceModel(pieces=[])
    for number, value in _Proto(_read_bounded(path), path).fields():
        if number == 1 and isinstance(value, bytes):
            piece, score, kind = "", 0.0, NORMAL
            for n, v in _Proto(value, path).fields():
                if n == 1 and isinstance(v, bytes):
                    try:
                        piece = v.decode("utf-8")
                    except UnicodeDecodeError:
                        raise TokenizerError(f"{path}: a piece is not UTF-8") from None
                elif n == 2 and isinstance(v, bytes) and len(v) == 4:
                    score = struct.unpack("<f", v)[0]
                elif n == 3 and isinstance(v, int):
                    kind = v
            model.pieces.append((piece, score, kind))
        elif number == 2 and isinstance(value, bytes):
            trainer = {n: v for n, v in _Proto(value, path).fields()}
            model.model_type = trainer.get(3, UNIGRAM)
            model.treat_whitespace_as_suffix = bool(trainer.get(24, 0))
            model.split_digits = bool(trainer.get(25, 0))
            model.byte_fallback = bool(trainer.get(35, 0))
            model.unk_id = _signed(trainer.get(40, 0))
            model.bos_id = _signed(trainer.get(41, 1))
            model.eos_id = _signed(trainer.get(42, 2))
            model.pad_id = _signed(trainer[43]) if 43 in trainer else -1
        elif number == 3 and isinstance(value, bytes):
            norm = {n: v for n, v in _Proto(value, path).fields()}
            model.precompiled_charsmap = norm.get(2, b"") if isinstance(norm.get(2), bytes) else b""
            model.add_dummy_prefix = bool(norm.get(3, 1))
            model.remove_extra_whitespaces = bool(norm.get(4, 1))
            model.escape_whitespaces = bool(norm.get(5, 1))
    if not model.pieces:
        raise TokenizerError(f"{path}: a SentencePiece model with no pieces")
    if model.model_type not in (UNIGRAM, BPE):
        raise TokenizerError(
            f"{path}: SentencePiece model type {model.model_type} (word or char) is not "
            "supported; BPE and unigram are"
        )
    if model.treat_whitespace_as_suffix:
        raise TokenizerError(f"{path}: treat_whitespace_as_suffix models are not supported")
    n = len(model.pieces)
    for name in ("unk_id", "bos_id", "eos_id", "pad_id"):
        if getattr(model, name) >= n:
            raise TokenizerError(f"{path}: {name} {getattr(model, name)} but {n} pieces")
    return model


def sentencepiece_to_hf(path: Path, max_len: int | None = None) -> Converted:
    """A SentencePiece model as a ``tokenizers`` tokenizer with the same pieces and ids."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    sp = read_sentencepiece(path)
    unk = sp.pieces[sp.unk_id][0] if sp.unk_id >= 0 else None
    if sp.model_type == UNIGRAM:
        model = models.Unigram(
            [(p, s) for p, s, _ in sp.pieces],
            unk_id=sp.unk_id if sp.unk_id >= 0 else None,
            byte_fallback=sp.byte_fallback,
        )
    else:
        vocab = {p: i for i, (p, _, _) in enumerate(sp.pieces)}
        mergeable = {p: (-s, i) for i, (p, s, k) in enumerate(sp.pieces) if k == NORMAL}
        merges = []
        for piece, priority in mergeable.items():
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in vocab and right in vocab:
                    merges.append((priority, vocab[left], vocab[right], left, right))
        # SentencePiece merges the adjacent pair whose result scores highest.
        merges.sort()
        model = models.BPE(
            vocab=vocab,
            merges=[(m[3], m[4]) for m in merges],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=sp.byte_fallback,
        )
    tok = Tokenizer(model)
    steps = []
    if sp.precompiled_charsmap:
        steps.append(normalizers.Precompiled(sp.precompiled_charsmap))
    if sp.remove_extra_whitespaces:
        steps += [
            normalizers.Strip(left=True, right=True),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if sp.add_dummy_prefix:
        steps.append(normalizers.Prepend("\u2581"))
    if sp.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    if sp.split_digits:
        tok.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    decode = [decoders.Replace("\u2581", " ")]
    if sp.byte_fallback:
        decode.append(decoders.ByteFallback())
    decode.append(decoders.Fuse())
    if sp.add_dummy_prefix:
        decode.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(decode)
    control = [p for p, _, k in sp.pieces if k in (CONTROL, UNKNOWN)]
    user = [p for p, _, k in sp.pieces if k == USER_DEFINED]
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in control])
    if user:
        tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in user])
    bos = sp.pieces[sp.bos_id][0] if sp.bos_id >= 0 else None
    eos = sp.pieces[sp.eos_id][0] if sp.eos_id >= 0 else None
    pad = sp.pieces[sp.pad_id][0] if sp.pad_id >= 0 else None
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, sp.bos_id)]
        )
    config = _config(bos, eos, unk, max_len, tok, pad=pad)
    return Converted(tok.to_str(), config, SENTENCEPIECE, _special_map(bos, eos, unk, pad))


# --- common --------------------------------------------------------------------------------------


def _special_map(
    bos: str | None, eos: str | None, unk: str | None, pad: str | None = None
) -> dict[str, str]:
    names = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
    return {k: v for k, v in names.items() if v}


def _config(
    bos: str | None, eos: str | None, unk: str | None, max_len: int | None, tok: Any, pad=None
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **_special_map(bos, eos, unk, pad),
    }
    if max_len:
        config["model_max_length"] = max_len
    return config


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
            return Tokenizer.from_str(_read_bounded(path).decode("utf-8")), HF_JSON
        except Exception as e:
            raise TokenizerError(f"{path} is not a tokenizer.json that loads: {e}") from None
    converted = convert_model_file(path)
    return Tokenizer.from_str(converted.tokenizer_json), converted.source_kind
