"""Token maps: a tokenizer's ids ranked by how often they occur in a corpus, most frequent first.

A draft model proposes only from the map's leading ids (``speculative_config.draft_token_map``), as FR-Spec
prunes a draft's vocabulary by frequency: a small draft's output projection is a large share of what it reads
a token, and most of its rows are tokens a reply rarely uses. Ranking by a corpus of the traffic's kind keeps
the tokens that traffic uses, where a BPE tokenizer's own order (its lowest ids, its earliest merges) keeps
the tokens of the tokenizer's training mix. `kvserve models token-map` writes one; the file names the
vocabulary it was counted with, so that a map is never applied to another tokenizer's ids.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import ConfigError
from kvserve.tokenizer import Tokenizer

FORMAT = "kvserve-token-map"


def vocabulary_digest(tokenizer: Tokenizer) -> str:
    """A short digest of the tokenizer's vocabulary (every token and its id, added tokens included)."""
    vocab = sorted(tokenizer.backend.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    return hashlib.blake2b(json.dumps(vocab).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class TokenMap:
    vocabulary: str  # vocabulary_digest of the tokenizer it was counted with
    token_ids: tuple[int, ...]  # every id the corpus holds, most frequent first (ties: the lower id first)
    corpus_tokens: int

    @classmethod
    def count(cls, tokenizer: Tokenizer, texts: Iterable[str]) -> TokenMap:
        counts: Counter[int] = Counter()
        for text in texts:
            counts.update(tokenizer.encode(text, add_special_tokens=False))
        ranked = sorted(counts, key=lambda token_id: (-counts[token_id], token_id))
        return cls(vocabulary_digest(tokenizer), tuple(ranked), sum(counts.values()))

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({"format": FORMAT, "vocabulary": self.vocabulary,
                                    "corpus_tokens": self.corpus_tokens, "token_ids": list(self.token_ids)}) + "\n")

    @classmethod
    def read(cls, path: str | Path, field: str = "draft_token_map") -> TokenMap:
        """The map in ``path``; a ConfigError naming ``field`` if it is missing or not a token map."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{field}: cannot read the token map {str(path)!r}: {exc}", field) from None
        ids = data.get("token_ids") if isinstance(data, dict) else None
        if (not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("vocabulary"), str)
                or not isinstance(ids, list) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
                or len(set(ids)) != len(ids)):
            raise ConfigError(f"{field}: {str(path)!r} is not a token map (`kvserve models token-map` writes one)",
                              field)
        corpus_tokens = data.get("corpus_tokens", 0)
        if not isinstance(corpus_tokens, int) or isinstance(corpus_tokens, bool):
            raise ConfigError(f"{field}: {str(path)!r} is not a token map (corpus_tokens {corpus_tokens!r})", field)
        return cls(data["vocabulary"], tuple(ids), corpus_tokens)

    def check_vocabulary(self, tokenizer: Tokenizer, field: str = "draft_token_map") -> None:
        if self.vocabulary != vocabulary_digest(tokenizer):
            raise ConfigError(f"{field}: the token map was counted with another tokenizer's vocabulary", field)


def corpus_texts(paths: Iterable[Path], max_bytes: int, pattern: str = "*", exclude: Iterable[str] = ()
                 ) -> Iterator[str]:
    """The UTF-8 text of each file, directories walked in name order for the files whose names match
    ``pattern`` and none of whose path parts below the directory is named in ``exclude``, up to ``max_bytes``
    in all (the last one cut there); files that are not UTF-8 text are skipped, a path that does not exist is
    a FileNotFoundError."""
    remaining = max_bytes
    excluded = frozenset(exclude)
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"no such corpus file or directory: {path}")
        files = ([p for p in sorted(path.rglob(pattern))
                  if p.is_file() and not excluded.intersection(p.relative_to(path).parts)]
                 if path.is_dir() else [path])
        for file in files:
            if remaining <= 0:
                return
            try:
                data = file.read_bytes()
                text = data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if len(data) > remaining:
                text = data[:remaining].decode("utf-8", errors="ignore")  # a character cut at the end is dropped
            remaining -= len(data)
            yield text
