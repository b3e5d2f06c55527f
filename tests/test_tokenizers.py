"""Tokenizers as users have them: Llama 3's tiktoken ``tokenizer.model``, SentencePiece models and
Hugging Face folders, exported so that ``AutoTokenizer`` loads them offline with the same ids."""

from __future__ import annotations

import json
import subprocess
import sysconfig
from pathlib import Path

import pytest

from conftest import cli, run_train
from dcpkit.convert.tokenizer import LLAMA3_PATTERN, LLAMA3_SPECIAL_TOKENS, write_tiktoken
from dcpkit.train.data import train_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SAMPLES = [
    "Hello, world!",
    "def __init__(self, x):\n    return x**2  # a comment\n\n",
    "  leading spaces,   runs of   spaces and a tab\tend  ",
    "Ünïcödé — 日本語 🙂 and emoji",
    "I'm sure they'll've done it: 12345678 + 3.14159",
    "<|begin_of_text|> in the text, <|eot_id|> too",
    (STDLIB / "json" / "decoder.py").read_text()[:4000],
    (STDLIB / "textwrap.py").read_text()[2000:6000],
]


def _to_hf(ckpt: Path, out: Path, tokenizer: Path) -> subprocess.CompletedProcess:
    return cli(
        "to-hf",
        str(ckpt),
        str(out),
        *("--model", "llama3", "--flavor", "debugmodel", "--tokenizer", str(tokenizer)),
    )


def _auto(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory) -> Path:
    """A Llama 3-style tiktoken file made from a byte-level BPE trained here."""
    files = [STDLIB / n for n in ("argparse.py", "json/encoder.py", "textwrap.py", "shlex.py")]
    bpe = train_tokenizer(files, 1500)
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.model"
    assert write_tiktoken(bpe.to_str(), path) == 1498  # the two special tokens are left out
    return path


def _tiktoken_reference(path: Path):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(path))  # tiktoken's own reader of the file
    specials = {s: len(ranks) + i for i, s in enumerate(LLAMA3_SPECIAL_TOKENS)}
    return tiktoken.Encoding(
        "llama3-test", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )


def test_tiktoken_tokenizer_model_exports_with_identical_ids(stopped_run, tiktoken_file, tmp_path):
    out = tmp_path / "hf"
    proc = _to_hf(stopped_run / "checkpoint" / "step-10", out, tiktoken_file)
    assert proc.returncode == 0, proc.stderr
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not (out / "tokenizer.model").exists()  # a tiktoken file would mislead loaders
    ref, hf = _tiktoken_reference(tiktoken_file), _auto(out)
    for text in SAMPLES:
        ids = ref.encode(text, allowed_special="all")
        assert hf(text, add_special_tokens=False).input_ids == ids, text
        assert hf.decode(ids) == text
    # Llama 3's special tokens sit after the ranks; BOS is prepended as Llama 3's HF tokenizer does
    assert hf.convert_tokens_to_ids("<|eot_id|>") == 1498 + 9
    assert hf.convert_tokens_to_ids("<|reserved_special_token_246|>") == 1498 + 255
    assert hf("hi").input_ids[0] == hf.bos_token_id == 1498
    assert hf.eos_token == "<|end_of_text|>"
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1498, 1499)


def _train_sentencepiece(folder: Path, kind: str) -> Path:
    import sentencepiece as spm

    corpus = folder / "corpus.txt"
    corpus.write_text(
        "".join((STDLIB / n).read_text() for n in ("argparse.py", "json/decoder.py"))[:150_000]
    )
    options = {"model_type": kind, "vocab_size": 700, "minloglevel": 2}
    if kind == "bpe":  # as Llama 2's: byte fallback, no normalization, whitespace kept
        options |= {
            "byte_fallback": True,
            "normalization_rule_name": "identity",
            "remove_extra_whitespaces": False,
            "split_digits": True,
        }
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "sp"), **options)
    model = folder / "tokenizer.model"
    (folder / "sp.model").rename(model)
    return model


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_sentencepiece_tokenizer_model_exports_with_identical_ids(stopped_run, tmp_path, kind):
    import sentencepiece as spm

    model = _train_sentencepiece(tmp_path, kind)
    out = tmp_path / "hf"
    proc = _to_hf(stopped_run / "checkpoint" / "step-10", out, model)
    assert proc.returncode == 0, proc.stderr
    sp, hf = spm.SentencePieceProcessor(model_file=str(model)), _auto(out)
    for text in SAMPLES:
        assert hf(text, add_special_tokens=False).input_ids == sp.encode(text), text
    assert hf("hi").input_ids == [sp.bos_id(), *sp.encode("hi")]
    assert (hf.bos_token, hf.eos_token, hf.unk_token) == ("<s>", "</s>", "<unk>")
    assert (out / "tokenizer.model").read_bytes() == model.read_bytes()


def test_folder_with_tokenizer_model_keeps_its_chat_template(stopped_run, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _train_sentencepiece(src, "bpe")
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    out = tmp_path / "hf"
    proc = _to_hf(stopped_run / "checkpoint" / "step-10", out, src)
    assert proc.returncode == 0, proc.stderr
    hf = _auto(out)
    text = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "[user] hi\n"


def test_hostile_tokenizer_files_fail_naming_the_file(stopped_run, tiktoken_file, tmp_path):
    ckpt = stopped_run / "checkpoint" / "step-10"
    bad_tiktoken = tmp_path / "bad" / "tokenizer.model"
    bad_tiktoken.parent.mkdir()
    lines = tiktoken_file.read_text().splitlines()
    lines[300] = "not-base64!! 300"
    bad_tiktoken.write_text("\n".join(lines) + "\n")
    proc = _to_hf(ckpt, tmp_path / "out1", bad_tiktoken)
    assert proc.returncode == 2
    assert f"{bad_tiktoken}:301" in proc.stderr
    assert not (tmp_path / "out1").exists()

    model = _train_sentencepiece(tmp_path, "unigram")
    cut = tmp_path / "cut" / "tokenizer.model"
    cut.parent.mkdir()
    cut.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    proc = _to_hf(ckpt, tmp_path / "out2", cut)
    assert proc.returncode == 2
    assert str(cut) in proc.stderr and "not a valid SentencePiece model" in proc.stderr
    assert not (tmp_path / "out2").exists()

    huge_field = tmp_path / "huge" / "tokenizer.model"
    huge_field.parent.mkdir()
    huge_field.write_bytes(b"\x0a\xff\xff\xff\xff\x0f" + b"x" * 64)  # claims a 4 GiB piece
    proc = _to_hf(ckpt, tmp_path / "out3", huge_field)
    assert proc.returncode == 2 and str(huge_field) in proc.stderr


@pytest.mark.dist
def test_trainer_trains_with_a_tiktoken_tokenizer_model(tiktoken_file, tmp_path):
    dump = tmp_path / "run"
    run_train(
        1,
        dump,
        "--model.tokenizer_path",
        str(tiktoken_file),
        "--training.steps",
        "2",
        "--checkpoint.enable",
        "false",
    )
    from tokenizers import Tokenizer

    used = Tokenizer.from_file(str(dump / "tokenizer.json"))
    ref = _tiktoken_reference(tiktoken_file)
    for text in SAMPLES:
        assert used.encode(text, add_special_tokens=False).ids == ref.encode(
            text, allowed_special="all"
        )
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
