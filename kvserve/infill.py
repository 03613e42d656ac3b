"""Fill-in-the-middle prompts for code models trained on them (Qwen2.5-Coder, StarCoder's family).

A completion request with a ``suffix`` asks for the text between its prompt and the suffix, as an editor's code
completion does. The model is shown the two as it was trained to see a gap: its prefix token, the text before,
its suffix token, the text after, its middle token; what it writes next is the middle, ended by its end-of-text
token (or by one of the tokens that would open another file or gap).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import InvalidRequest
from kvserve.tokenizer import Tokenizer

# The FIM tokens of the code models that have them, prefix / suffix / middle, prefix-suffix-middle order.
FIM_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
)
# Tokens after which a middle is complete: the end of the text, or the start of another file, repository or gap.
INFILL_END_TOKENS = ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>",
                     "<fim_pad>", "<file_sep>", "<reponame>", "<filename>")


@dataclass(frozen=True, slots=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    ends: tuple[int, ...]  # besides the model's own end-of-sequence tokens

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> FimTokens | None:
        """The model's FIM tokens: each a special token of its vocabulary, or None where it has none."""
        special = tokenizer.all_special_ids
        for spelling in FIM_SPELLINGS:
            ids = [tokenizer.token_to_id(token) for token in spelling]
            if all(i is not None and i in special for i in ids):
                prefix, suffix, middle = (int(i) for i in ids)  # type: ignore[arg-type]
                ends = (tokenizer.token_to_id(token) for token in INFILL_END_TOKENS)
                return cls(prefix, suffix, middle,
                           tuple(dict.fromkeys(int(i) for i in ends if i is not None and i in special)))
        return None

    def prompt(self, tokenizer: Tokenizer, before: str, after: str) -> list[int]:
        """The token ids of the gap between ``before`` and ``after``, prefix-suffix-middle, with the BOS token
        first where the model's tokenizer adds one."""
        bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token and tokenizer.bos_token_id is not None else []
        return [*bos, self.prefix, *tokenizer.encode(before, add_special_tokens=False), self.suffix,
                *tokenizer.encode(after, add_special_tokens=False), self.middle]


def fim_tokens_or_error(tokenizer: Tokenizer, model_name: str) -> FimTokens:
    """The model's FIM tokens, or a 400 naming ``suffix`` where it has none."""
    fim = FimTokens.of(tokenizer)
    if fim is None:
        raise InvalidRequest(f"suffix: the model {model_name} has no fill-in-the-middle tokens; infilling takes a "
                             "code model trained for it (e.g. qwen2.5-coder-0.5b)", param="suffix")
    return fim
