"""Training data that needs no download, and a loader whose state survives a change of world size.

The default corpus is the Python standard library's own source, read in a fixed order. A byte-level
BPE tokenizer is trained on it (cached). The token stream is cut into samples of ``seq_len + 1``
tokens; the sample order is one global, seeded permutation per epoch, and every data-parallel rank
takes its slice of each global batch. The loader's whole state is therefore the number of samples
consumed, which means the same thing at any world size.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dcpkit.config import ConfigError

logger = logging.getLogger(__name__)

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
_EOS_NAMES = (EOS, "</s>", "<|endoftext|>", "<eos>")
DEFAULT_CORPUS_BYTES = 6_000_000
_TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".toml"}


def cache_dir() -> Path:
    """Where tokenizers and token streams are cached (``$DCPKIT_CACHE`` or ``~/.cache/dcpkit``)."""
    root = os.environ.get("DCPKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dcpkit"
    )
    return Path(root)


def corpus_files(
    dataset_path: str | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES
) -> list[Path]:
    """The text files of the corpus, in a fixed order.

    Without ``dataset_path``: the standard library's ``.py`` files sorted by relative path, up to
    ``max_bytes``. With it: that file, or every text file under that folder, sorted, all of them.
    """
    if dataset_path:
        root = Path(dataset_path).expanduser()
        if root.is_file():
            return [root]
        if not root.is_dir():
            raise FileNotFoundError(
                f"[training] dataset_path {str(root)!r} does not exist; point it at a text file "
                "or a folder of text files, or leave it empty to train on the Python standard "
                "library"
            )
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
        if not files:
            raise ConfigError(
                f"[training] dataset_path {str(root)!r} holds no text files "
                f"({', '.join(sorted(_TEXT_SUFFIXES))})"
            )
        return files
    files, total = [], 0
    for path in _stdlib_sources():
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        files.append(path)
        total += size
    return files


def _stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path: the default corpus."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        (p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts),
        key=lambda p: p.relative_to(stdlib).as_posix(),
    )


def held_out_files(min_bytes: int = 200_000) -> list[Path]:
    """Standard-library files the default corpus never holds (those after its
    ``DEFAULT_CORPUS_BYTES``), at least ``min_bytes`` of them: text from the same source that
    a run on the default corpus never trained on, to evaluate it."""
    sources = _stdlib_sources()
    start = len(corpus_files())
    files, total = [], 0
    for path in sources[start:]:
        files.append(path)
        total += path.stat().st_size
        if total >= min_bytes:
            break
    return files


def _read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _fingerprint(files: list[Path], vocab_size: int, tokenizer: str = "") -> str:
    digest = hashlib.sha256(f"v1 vocab={vocab_size}".encode())
    if tokenizer:  # the trained tokenizer's cache keys stay as they were
        digest.update(b"tokenizer:" + tokenizer.encode())
    for path in files:
        digest.update(str(path).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def train_tokenizer(files: list[Path], vocab_size: int):
    """Train a byte-level BPE tokenizer (``tokenizers``) on ``files``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((_read_text(p) for p in files), trainer=trainer)
    return tokenizer


@dataclass
class Corpus:
    """A tokenized corpus: the tokenizer (as JSON) and one stream of token ids."""

    tokenizer_json: str
    tokens: np.ndarray
    files: int
    fingerprint: str


def _given_tokenizer(path: str, vocab_size: int) -> Any:
    from dcpkit.convert.tokenizer import load_tokenizer

    tokenizer, kind = load_tokenizer(path)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ConfigError(
            f"[model] tokenizer_path {path} ({kind}) has {size} tokens, more than the model's "
            f"vocabulary of {vocab_size}; use a flavor with a vocabulary that large"
        )
    return tokenizer


def prepare_corpus(
    vocab_size: int, dataset_path: str | None = None, tokenizer_path: str | None = None
) -> Corpus:
    """Tokenizer and token stream for the corpus, from the cache when present.

    ``tokenizer_path``: tokenize with that tokenizer (any kind ``load_tokenizer`` reads) instead
    of training one. Safe to call from several processes: results are written atomically, and a
    process that finds them cached reads them. Call it on one rank first, then on the rest after
    a barrier.
    """
    files = corpus_files(dataset_path)
    given = _given_tokenizer(tokenizer_path, vocab_size) if tokenizer_path else None
    key = _fingerprint(files, vocab_size, given.to_str() if given else "")
    folder = cache_dir() / f"corpus-{key}"
    tok_path, ids_path = folder / "tokenizer.json", folder / "tokens.npy"
    if tok_path.exists() and ids_path.exists():
        return Corpus(tok_path.read_text(), np.load(ids_path, mmap_mode="r"), len(files), key)

    from tokenizers import Tokenizer

    if given is not None:
        logger.info(
            "tokenizing %d files with %s (cached in %s)", len(files), tokenizer_path, folder
        )
        tokenizer = given
    else:
        logger.info(
            "training a %d-token BPE tokenizer on %d files (cached in %s)",
            vocab_size,
            len(files),
            folder,
        )
        tokenizer = train_tokenizer(files, vocab_size)
    eos = next(
        (tokenizer.token_to_id(n) for n in _EOS_NAMES if tokenizer.token_to_id(n) is not None),
        None,
    )
    encoded = tokenizer.encode_batch([_read_text(p) for p in files], add_special_tokens=False)
    pieces = []
    for enc in encoded:
        pieces.append(np.asarray(enc.ids, dtype=np.int32))
        if eos is not None:
            pieces.append(np.asarray([eos], dtype=np.int32))
    tokens = np.concatenate(pieces)
    tokenizer_json = tokenizer.to_str()
    Tokenizer.from_str(tokenizer_json)  # fail here, not in a later run, if it does not round-trip
    buf = _npy_bytes(tokens)
    _atomic_write_bytes(ids_path, buf)
    _atomic_write_bytes(tok_path, tokenizer_json.encode())
    return Corpus(tokenizer_json, tokens, len(files), key)


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


class TokenSamples:
    """Non-overlapping windows of ``seq_len + 1`` tokens over one token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if seq_len < 1:
            raise ConfigError(f"[training] seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ConfigError(
                f"the corpus has {len(tokens)} tokens, fewer than one sample of seq_len "
                f"{seq_len} + 1; use more text or a shorter [training] seq_len"
            )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)


class GlobalBatchLoader:
    """Seeded global sample order; each data-parallel rank takes its slice of every global batch.

    Its state is ``samples_consumed`` (global), so it resumes at any data-parallel degree that
    divides ``global_batch_size``, and every degree sees the same samples at every step.
    """

    def __init__(
        self,
        samples: TokenSamples,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        seed: int = 0,
    ) -> None:
        if global_batch_size < 1:
            raise ConfigError(f"[training] global_batch_size must be >= 1, got {global_batch_size}")
        if global_batch_size % dp_degree:
            raise ConfigError(
                f"[training] global_batch_size ({global_batch_size}) must be divisible by the "
                f"data-parallel degree ({dp_degree})"
            )
        self.samples = samples
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.seed = seed
        self.samples_consumed = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_degree

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(len(self.samples))
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def sample_index(self, position: int) -> int:
        """Index of the sample at global position ``position`` of the stream."""
        epoch, offset = divmod(position, len(self.samples))
        return int(self._order(epoch)[offset])

    def global_positions(self) -> range:
        start = self.samples_consumed + self.dp_rank * self.local_batch_size
        return range(start, start + self.local_batch_size)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, labels)`` of the next global batch, ``[local_batch, seq_len]``."""
        rows = [self.samples[self.sample_index(p)] for p in self.global_positions()]
        batch = torch.from_numpy(np.stack(rows))
        self.samples_consumed += self.global_batch_size
        return batch[:, :-1], batch[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "samples_consumed": self.samples_consumed,
            "num_samples": len(self.samples),
            "seq_len": self.samples.seq_len,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ours = self.state_dict()
        for key in ("num_samples", "seq_len", "seed"):
            saved, current = state.get(key), ours[key]
            if saved is not None and saved != current:
                raise ConfigError(
                    f"the checkpoint's dataloader was built with {key}={saved}, this run has "
                    f"{key}={current}: the sample order would not continue where it stopped. "
                    "Use the same data, [training] seq_len and seed, or exclude 'dataloader' "
                    "with [checkpoint] exclude_from_loading to restart the data from the beginning"
                )
        self.samples_consumed = int(state["samples_consumed"])
