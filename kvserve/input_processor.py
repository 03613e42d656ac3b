"""Validate and tokenise a request once, on the caller's side, before anything is queued.

Bad input raises a typed error here, in the caller's thread (the HTTP handler's, or ``LLM.generate``'s), and
the engine loop only ever sees a ``ProcessedPrompt`` it can queue as it is.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvserve.errors import ContextLengthExceeded, EmptyPrompt, InvalidRequest, InvalidSamplingParams
from kvserve.request import ProcessedPrompt
from kvserve.sampling_params import SamplingParams
from kvserve.structured.grammar import GrammarCompiler
from kvserve.tokenizer import Tokenizer

PromptType = str | list[int] | dict[str, Any]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, grammars: GrammarCompiler,
                 eos_token_ids: tuple[int, ...] = (), priority_scheduling: bool = False) -> None:
        self.tokenizer = tokenizer
        self.priority_scheduling = priority_scheduling  # requests may set a priority other than 0
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids or tuple(tokenizer.eos_token_ids)  # what ends an output

    def process(self, prompt: PromptType, params: SamplingParams, compile_grammar: bool = True) -> ProcessedPrompt:
        """Check the parameters against this model, tokenise the prompt and check that it fits; compile its
        structured-output constraint (waiting for it at most the compile timeout) unless ``compile_grammar`` is
        False: the caller compiles it apart (the server does, off its event loop)."""
        params = self.resolve_params(params)
        # A prompt to be cut to its last tokens may be longer than the context: tokenized whole, then cut.
        token_ids, text = self.tokenize_prompt(prompt, check_fits=params.truncate_prompt_tokens is None)
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = max(1, self.max_model_len - (params.max_tokens or 1))
        if keep is not None and len(token_ids) > keep:
            token_ids, text = token_ids[-keep:], None  # the text no longer says what the prompt is
        self.check_context(len(token_ids), params.max_tokens)
        spec = params.structured_outputs
        grammar = self.grammars.compile(spec) if spec is not None and compile_grammar else None
        return ProcessedPrompt(token_ids, text, params, grammar)

    def check_text_fits(self, text: str) -> None:
        """Refuse, before tokenizing it, a text too long to fit the context however it tokenizes: megabytes
        of prompt took seconds to tokenize only to be refused. The factor 4 leaves room for normalizers
        that compose characters (NFC) before the tokens are cut."""
        limit = self.max_model_len
        most = 4 * limit * self.tokenizer.max_token_chars
        if len(text) > most:
            raise ContextLengthExceeded(
                f"the prompt has {len(text)} characters; this model's maximum context length is {limit} tokens, "
                f"and no more than {most} characters can fit in them"
            )

    def tokenize_prompt(self, prompt: PromptType, check_fits: bool = True) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPrompt()
            if check_fits:
                self.check_text_fits(prompt)
            token_ids = self.tokenizer.encode(prompt)
            self.check_ids_in_vocabulary(token_ids)
            return token_ids, prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"], check_fits)
            else:
                raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        else:
            token_ids = prompt
        token_ids = list(token_ids)
        if not token_ids:
            raise EmptyPrompt()
        vocab = self.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        return token_ids, None

    def check_ids_in_vocabulary(self, token_ids: list[int]) -> None:
        """A tokenizer may know tokens past the model's embedding rows (added ones); such an id would end the
        engine at its lookup."""
        if token_ids and max(token_ids) >= self.vocab_size:
            raise InvalidRequest(f"the prompt holds token id {max(token_ids)}, which its tokenizer knows and this "
                                 f"model's vocabulary of {self.vocab_size} does not", "prompt")

    def resolve_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` checked against this model (token ids within its vocabulary) with what needs its tokenizer
        filled in (the bad words' tokens). Idempotent: the parameters it returns come back unchanged."""
        if params.priority != 0 and not self.priority_scheduling:  # it would be ignored
            raise InvalidSamplingParams("priority: requests are ordered by a priority of theirs only under the "
                                        "priority scheduling policy (--scheduling-policy priority, or "
                                        "scheduling_policy='priority'); leave it out", param="priority")
        vocab = self.vocab_size
        for param, ids in (("logit_bias", [token for token, _ in params.logit_bias]),
                           ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = [token for token in ids if token >= vocab]
            if outside:
                raise InvalidSamplingParams(f"{param} token ids must be < {vocab} (the vocabulary size), got "
                                            f"{outside[0]}", param=param)
        if params.bad_words and not params.bad_words_token_ids:
            words = bad_words_token_ids(self.tokenizer, params.bad_words)
            if any(not word for word in words):  # a normalizer that drops every character of it
                raise InvalidSamplingParams("a bad word tokenizes to no tokens", param="bad_words")
            if any(token >= vocab for word in words for token in word):
                raise InvalidSamplingParams("a bad word tokenizes to a token past this model's vocabulary",
                                            param="bad_words")
            params = replace(params, bad_words_token_ids=words)
        self._check_some_token_allowed(params)
        return params

    def _check_some_token_allowed(self, params: SamplingParams) -> None:
        """Refuse allowed_token_ids that bad words of one token, and (before min_tokens) the end tokens, leave
        empty: every token of the first step would be refused."""
        if params.allowed_token_ids is None:
            return
        refused = {word[0] for word in params.bad_words_token_ids if len(word) == 1}
        if params.min_tokens > 0:
            refused |= {*self.eos_token_ids, *params.stop_token_ids}
        if refused.issuperset(params.allowed_token_ids):
            raise InvalidSamplingParams("allowed_token_ids holds only tokens that bad_words refuse or, before "
                                        "min_tokens, end the output: no token could be sampled",
                                        param="allowed_token_ids")

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise ContextLengthExceeded(
                f"the prompt has {num_prompt_tokens} tokens but this model's maximum context length is {limit} "
                f"tokens, which must also fit at least one generated token"
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {limit} tokens; the prompt has {num_prompt_tokens} "
                f"tokens and max_tokens asks for {max_tokens} more ({num_prompt_tokens + max_tokens} in total)",
                param="max_tokens",
            )


def bad_words_token_ids(tokenizer: Tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each word's tokens as it begins the text, and as it follows a space where that is another token of the
    same length (a word inside a sentence, for tokenizers that mark a word's start), as vLLM reads its
    bad_words."""
    found: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        found.append(alone)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if alone and spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            found.append(spaced)
    return tuple(dict.fromkeys(found))
