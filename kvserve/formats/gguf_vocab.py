"""A ``tokenizers`` backend rebuilt from a GGUF file's vocabulary metadata (llama.cpp's
``tokenizer.ggml.*`` keys), so a GGUF needs no tokenizer file of its own: byte-level BPE vocabularies
(``gpt2``) with the pre-tokenizer their ``tokenizer.ggml.pre`` names, and SentencePiece BPE (``llama``).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(1, 7)

# ---- Pre-tokenizers for byte-level (tokenizer.ggml.model == "gpt2") vocabularies -------------------
# Keyed by tokenizer.ggml.pre; the regexes are the ones llama.cpp (llama-vocab.cpp) and the models'
# own tokenizer.json files use.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp splits digits one by one (\p{N}) before the GPT-2 regex for these; SmolLM2's tokenizer.json
# says the same with Digits(individual_digits=True) + ByteLevel(use_regex=True).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_GPT2_ONLY = ("gpt-2", "gpt2", "mpt", "olmo", "jais")
_LLAMA3_LIKE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3")
_QWEN2_LIKE = ("qwen2", "deepseek-r1-qwen")


def _byte_level_pre_tokenizer(pre: str | None) -> tuple[Any, Any, bool]:
    """(normalizer, pre_tokenizer, ignore_merges) for a GGUF ``tokenizer.ggml.pre`` name."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return (
            None,
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
            False,
        )
    if pre in _LLAMA3_LIKE or pre in _QWEN2_LIKE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_LIKE else _QWEN2_SPLIT
        pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if pre in _QWEN2_LIKE:
            return normalizers.NFC(), pre_tokenizer, False
        return (
            None,
            pre_tokenizer,
            True,
        )  # llama.cpp sets ignore_merges for llama3, as its tokenizer.json does
    if pre not in _GPT2_ONLY and pre not in (None, "default"):
        logger.warning(
            "unknown GGUF pre-tokenizer %r; using the GPT-2 split, which may tokenize differently", pre
        )
    return None, byte_level, False


def byte_level_backend(meta: dict[str, Any], tokens: list[str]) -> BackendTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    normalizer, pre_tokenizer, ignore_merges = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = BackendTokenizer(
        models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    )
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_backend(
    meta: dict[str, Any], tokens: list[str], token_types: list[int]
) -> BackendTokenizer:
    """A llama.cpp "llama" (SentencePiece BPE) vocabulary, rebuilt the way transformers' LlamaTokenizer does."""
    vocab = {token: i for i, token in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        mergeable = [
            t
            for t, kind in zip(tokens, token_types, strict=False)
            if kind in (TOKEN_NORMAL, TOKEN_USER_DEFINED)
        ]
        merges = _merges_from_scores(vocab, {t: scores[vocab[t]] for t in mergeable})
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = BackendTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best-scored token first (the order transformers and llama.cpp use)."""
    merges: list[tuple[float, int, int, str, str]] = []
    for token, score in scores.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((-score, len(left), len(right), left, right))
    merges.sort(key=lambda m: (m[0], -m[1], -m[2], vocab[m[3]], vocab[m[4]]))
    return [(m[3], m[4]) for m in merges]
