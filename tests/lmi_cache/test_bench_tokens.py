"""Token counting sources: a local tokenizer file, the approximation, bad paths."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from click.testing import CliRunner

from lmi_cache.bench.cli import bench
from lmi_cache.bench.client import BenchError
from lmi_cache.bench.fake_server import FakeOpenAiServer
from lmi_cache.bench.tokens import ApproxTokenCounter, LocalTokenCounter
from lmi_cache.bench.workloads import VOCABULARY


def _char_tokenizer(path: Path) -> Path:
    """A tokenizer.json that splits on whitespace and then into single characters."""
    tokenizers = pytest.importorskip("tokenizers")
    alphabet = sorted({c for word in VOCABULARY for c in word})
    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=1))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.Whitespace(), tokenizers.pre_tokenizers.Split("", "isolated")]
    )
    file = path / "tokenizer.json"
    tok.save(str(file))
    return file


def test_local_tokenizer_counts_characters(tmp_path: Path) -> None:
    counter = LocalTokenCounter(str(_char_tokenizer(tmp_path).parent))
    assert asyncio.run(counter.count("ab cde")) == 5
    assert counter.source == "local"


def test_cli_fits_documents_with_local_tokenizer(tmp_path: Path) -> None:
    file = _char_tokenizer(tmp_path)
    out = tmp_path / "out.json"
    with FakeOpenAiServer() as server:
        run = CliRunner().invoke(
            bench,
            ["--url", server.url, "--num-documents", "2", "--document-tokens", "400", "--tokenizer", str(file),
             "--json", str(out)],
        )
    assert run.exit_code == 0, run.output
    import json

    settings = json.loads(out.read_text())["settings"]
    assert settings["token_count_source"] == "local"
    # Characters, not words: a 400-character document has far fewer than 400 words.
    for num_tokens in settings["measured_document_tokens"]:
        assert 400 - max(map(len, VOCABULARY)) < num_tokens <= 400


def test_bad_tokenizer_path_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="--tokenizer"):
        LocalTokenCounter(str(tmp_path / "missing"))
    with FakeOpenAiServer() as server:
        run = CliRunner().invoke(bench, ["--url", server.url, "--tokenizer", str(tmp_path / "missing")])
    assert run.exit_code == 2
    assert "--tokenizer" in run.output and "Traceback" not in run.output


def test_approx_counter_scales_with_words() -> None:
    counter = ApproxTokenCounter()
    assert asyncio.run(counter.count("a b c d e f g h i j")) == 13
    assert asyncio.run(counter.count("")) == 0
