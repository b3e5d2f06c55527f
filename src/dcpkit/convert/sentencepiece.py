"""SentencePiece ``tokenizer.model`` files, read by a protobuf wire-format reader of its own
(no protobuf runtime, every length checked against the bytes) and rebuilt as a ``tokenizers``
tokenizer with the same pieces, scores, normalization, byte fallback and ids."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from dcpkit.convert.tokenizer_files import (
    SENTENCEPIECE,
    Converted,
    TokenizerError,
    read_bounded,
    special_map,
    tokenizer_config,
)

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
    for number, value in _Proto(read_bounded(path), path).fields():
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
    config = tokenizer_config(bos, eos, unk, max_len, tok, pad=pad)
    return Converted(tok.to_str(), config, SENTENCEPIECE, special_map(bos, eos, unk, pad))
