"""A draft's pruned vocabulary: which ids it keeps (the ids below a size, or a token map's leading ids with the
special tokens, filled to whole groups of sixteen), and token maps: counted from a corpus, written, read back,
refused when malformed or counted with another vocabulary, and made by `kvserve models token-map`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.cli import main
from kvserve.errors import ConfigError
from kvserve.model_store.token_map import TokenMap, corpus_texts, vocabulary_digest
from kvserve.runner.draft_vocab import kept_ids
from tests.support.tiny_models import smollm2_tokenizer


def test_without_a_token_map_the_ids_below_the_size_are_kept() -> None:
    assert kept_ids(100, None, None) is None
    assert kept_ids(100, 100, None) is None and kept_ids(100, 500, None) is None
    assert kept_ids(100, 10, None) == list(range(10))


def test_a_token_maps_leading_ids_and_the_special_tokens_are_kept_filled_to_whole_groups() -> None:
    ranked = [50, 3, 7, 99, 1, 2, 120]  # 120: past this vocabulary
    kept = kept_ids(100, 3, ranked, always=[0, 98, 300])
    assert kept is not None and len(kept) == 16 and kept == sorted(kept)
    # The three leading ids and the specials, then the next ranked ones, then the lowest ids left.
    assert set(kept) == {50, 3, 7, 0, 98, 99, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12}
    # The whole map (no size): its ids and the specials, filled with the lowest ids left.
    whole = kept_ids(100, None, ranked, always=[0])
    assert whole is not None and len(whole) == 16 and {50, 3, 7, 99, 1, 2, 0} <= set(whole)
    assert kept_ids(16, None, list(range(10))) is None  # the whole vocabulary: nothing pruned


def test_a_token_map_ranks_a_corpus_ids_by_frequency_and_reads_back(tmp_path: Path) -> None:
    tokenizer = smollm2_tokenizer()
    texts = ["the cat and the dog", "the end"]
    token_map = TokenMap.count(tokenizer, texts)
    counted = [i for text in texts for i in tokenizer.encode(text, add_special_tokens=False)]
    assert token_map.corpus_tokens == len(counted) and set(token_map.token_ids) == set(counted)
    ranks = [(-counted.count(i), i) for i in token_map.token_ids]
    assert ranks == sorted(ranks) and ranks[0][0] == -2  # the most frequent first, ties by id
    path = tmp_path / "map.json"
    token_map.write(path)
    assert TokenMap.read(path) == token_map
    token_map.check_vocabulary(tokenizer)
    with pytest.raises(ConfigError, match="another tokenizer") as info:
        TokenMap("0" * 16, token_map.token_ids, 1).check_vocabulary(tokenizer)
    assert info.value.param == "draft_token_map"


@pytest.mark.parametrize("content", [None, "not json", json.dumps([1, 2, 3]),
                                     json.dumps({"format": "other", "vocabulary": "x", "token_ids": [1]}),
                                     json.dumps({"format": "kvserve-token-map", "vocabulary": "x", "token_ids": [1, 1]}),
                                     json.dumps({"format": "kvserve-token-map", "vocabulary": "x", "token_ids": [-1]}),
                                     json.dumps({"format": "kvserve-token-map", "vocabulary": "x", "token_ids": []})],
                         ids=["missing", "not-json", "a-list", "another-format", "duplicates", "negative", "empty"])
def test_a_file_that_is_not_a_token_map_is_refused_naming_the_field(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "map.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as info:
        TokenMap.read(path)
    assert info.value.param == "draft_token_map"


def test_the_corpus_is_every_text_file_under_its_directories_up_to_a_size(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b" / "c.txt").write_text("hello\n")
    (tmp_path / "b" / "d.bin").write_bytes(b"\xff\xfe\x00binary")
    assert list(corpus_texts([tmp_path], 1000)) == ["x = 1\n", "hello\n"]
    assert list(corpus_texts([tmp_path], 6)) == ["x = 1\n"]
    assert list(corpus_texts([tmp_path], 1000, pattern="*.txt")) == ["hello\n"]
    assert list(corpus_texts([tmp_path], 1000, exclude=["b"])) == ["x = 1\n"]
    assert list(corpus_texts([tmp_path / "b"], 1000, exclude=["b"])) == ["hello\n"]  # below the directory only
    (tmp_path / "e.txt").write_text("né")  # 3 bytes: a cut inside the é drops it, not the file
    assert list(corpus_texts([tmp_path / "e.txt"], 2)) == ["n"]
    with pytest.raises(FileNotFoundError):
        list(corpus_texts([tmp_path / "missing"], 1000))


def test_the_models_token_map_command_writes_a_map_for_the_models_tokenizer(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 3)
    output = tmp_path / "map.json"
    assert main(["models", "token-map", "smollm2-135m", str(corpus), "-o", str(output)]) == 0
    token_map = TokenMap.read(output)
    assert token_map.vocabulary == vocabulary_digest(smollm2_tokenizer())
    assert token_map.corpus_tokens == len(smollm2_tokenizer().encode(corpus.read_text(), add_special_tokens=False))
    assert "token ids ranked" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["models", "token-map", "smollm2-135m", str(empty), "-o", str(output)]) == 2
    assert main(["models", "token-map", "smollm2-135m", str(tmp_path / "missing"), "-o", str(output)]) == 2
