"""Corpus, tokenizer and the reshardable loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcpkit.config import ConfigError
from dcpkit.train.data import (
    EOS,
    GlobalBatchLoader,
    TokenSamples,
    corpus_files,
    prepare_corpus,
)


def _samples(n_tokens=10_000, seq_len=16):
    return TokenSamples(np.arange(n_tokens, dtype=np.int32) % 997, seq_len)


def _global_batches(world, steps, start_state=None, global_batch=8):
    """The concatenation of every rank's batch, for each step."""
    loaders = [GlobalBatchLoader(_samples(), global_batch, r, world, seed=3) for r in range(world)]
    if start_state:
        for loader in loaders:
            loader.load_state_dict(start_state)
    out = []
    for _ in range(steps):
        out.append(torch.cat([loader.next_batch()[0] for loader in loaders]))
    return out, loaders[0].state_dict()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_world_size_sees_the_same_global_batches(world):
    ref, _ = _global_batches(1, 5)
    got, _ = _global_batches(world, 5)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_resume_at_another_world_size_continues_the_stream():
    ref, _ = _global_batches(2, 6)
    _, state = _global_batches(2, 3)
    assert state["samples_consumed"] == 24
    rest, _ = _global_batches(4, 3, start_state=state)
    for a, b in zip(ref[3:], rest):
        assert torch.equal(a, b)


def test_labels_are_inputs_shifted_and_epochs_reshuffle():
    samples = _samples(n_tokens=16 * 100 + 1)
    loader = GlobalBatchLoader(samples, 4, seed=1)
    x, y = loader.next_batch()
    assert torch.equal(x[:, 1:], y[:, :-1])
    epoch0 = [loader.sample_index(p) for p in range(100)]
    epoch1 = [loader.sample_index(p) for p in range(100, 200)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(100))
    assert epoch0 != epoch1
    other = GlobalBatchLoader(samples, 4, seed=2)
    assert [other.sample_index(p) for p in range(100)] != epoch0


def test_mismatched_data_refuses_to_resume():
    loader = GlobalBatchLoader(_samples(seq_len=16), 8)
    other = GlobalBatchLoader(_samples(seq_len=32), 8)
    with pytest.raises(ConfigError, match="would not continue where it stopped"):
        other.load_state_dict(loader.state_dict())


def test_bad_batch_sizes_name_the_option():
    with pytest.raises(ConfigError, match="global_batch_size"):
        GlobalBatchLoader(_samples(), 6, 0, 4)


def test_stdlib_corpus_is_fixed_order_and_tokenizer_round_trips(tmp_path, monkeypatch):
    files = corpus_files(max_bytes=300_000)
    assert files and files == corpus_files(max_bytes=300_000)
    assert all(f.suffix == ".py" for f in files)
    monkeypatch.setenv("DCPKIT_CACHE", str(tmp_path))
    corpus = prepare_corpus(512, dataset_path=str(files[0].parent / files[0].name))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(corpus.tokenizer_json)
    assert tok.get_vocab_size() <= 512
    assert corpus.tokens.max() < 512
    text = files[0].read_text()
    assert tok.decode(tok.encode(text).ids) == text
    assert corpus.tokens[-1] == tok.token_to_id(EOS)
    # Second call reads the cache.
    again = prepare_corpus(512, dataset_path=str(files[0]))
    assert np.array_equal(np.asarray(again.tokens), np.asarray(corpus.tokens))
    assert any(tmp_path.iterdir())


def test_dataset_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset_path"):
        corpus_files(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no text files"):
        corpus_files(str(tmp_path / "empty"))
