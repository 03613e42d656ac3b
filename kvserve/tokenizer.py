"""Tokenizer, chat template and incremental (UTF-8 safe) detokenizer.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` built either from a Hugging Face ``tokenizer.json`` or
from GGUF metadata (vocabulary, merges, token types, pre-tokenizer name), so a GGUF needs no other file.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from kvserve.errors import InvalidRequest, ModelLoadError, ModelNotFound, UnsupportedModel
from kvserve.model.gguf_file import read_gguf_header

logger = logging.getLogger(__name__)

# Texts longer than this are tokenized without holding the GIL (Tokenizer.encode); the server also moves
# them off its event loop.
LONG_TEXT_CHARS = 4096

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE = range(1, 7)

# Tokens that end an assistant turn in common chat formats. One counts as a stop token when it is a
# special token of the vocabulary and the chat template writes it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

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


class Tokenizer:
    """Text <-> token ids, plus the model's chat template.

    Build it with ``Tokenizer.from_model_path`` (a GGUF file or a Hugging Face directory).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._chat_template = chat_template
        self._bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        ) | {i for i in (self._bos_token_id, eos_id) if i is not None}
        self._eos_token_ids = self._find_eos_ids(eos_id, extra_eos_token_ids)
        probe = backend.encode("a", add_special_tokens=True).ids
        self._add_bos_token = self._bos_token_id is not None and probe[:1] == [self._bos_token_id]
        self._compiled_template: jinja2.Template | None = None

    def _find_eos_ids(self, eos_id: int | None, extra: Iterable[int]) -> tuple[int, ...]:
        """The EOS id, ids the model files name as end tokens, and the template's end-of-turn token."""
        ids = [i for i in (eos_id, *extra) if i is not None]
        for token in END_OF_TURN_TOKENS:
            token_id = self._backend.token_to_id(token)
            if token_id in self._special_ids and self._chat_template and token in self._chat_template:
                ids.append(token_id)
        return tuple(dict.fromkeys(int(i) for i in ids))

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_model_path(cls, path: Path) -> Tokenizer:
        path = Path(path)
        if path.is_dir():
            return cls._from_hf_dir(path)
        if not path.exists():
            raise ModelNotFound(f"model path does not exist: {path}")
        return cls._from_gguf(path)

    @classmethod
    def _from_gguf(cls, path: Path) -> Tokenizer:
        meta = read_gguf_header(path).metadata
        model = meta.get("tokenizer.ggml.model")
        tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError(f"{path} has no tokenizer in its metadata (tokenizer.ggml.tokens)")
        token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
        if model == "gpt2":
            backend = _byte_level_backend(meta, tokens)
        elif model == "llama":
            backend = _sentencepiece_backend(meta, tokens, token_types)
        else:
            raise UnsupportedModel(f"{path}: GGUF tokenizer model {model!r} is not supported (gpt2, llama)")

        control = [tok for tok, kind in zip(tokens, token_types, strict=False) if kind == _TOKEN_CONTROL]
        user_defined = [
            tok for tok, kind in zip(tokens, token_types, strict=False) if kind == _TOKEN_USER_DEFINED
        ]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        if user_defined:
            backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

        def token_at(key: str) -> str | None:
            token_id = meta.get(f"tokenizer.ggml.{key}")
            return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

        bos_token, eos_token = token_at("bos_token_id"), token_at("eos_token_id")
        add_bos = meta.get("tokenizer.ggml.add_bos_token", model == "llama")
        if add_bos and bos_token is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_token}:0 $A:0",
                pair=f"{bos_token}:0 $A:0 $B:1",
                special_tokens=[(bos_token, int(meta["tokenizer.ggml.bos_token_id"]))],
            )
        extra_eos = [meta.get(f"tokenizer.ggml.{k}") for k in ("eot_token_id", "eom_token_id")]
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            chat_template=meta.get("tokenizer.chat_template"),
            extra_eos_token_ids=[i for i in extra_eos if i is not None],
        )

    @classmethod
    def _from_hf_dir(cls, model_dir: Path) -> Tokenizer:
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelNotFound(f"{model_dir} has no tokenizer.json")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"cannot read {tokenizer_file}: {e}") from None
        config = _read_json_if_exists(model_dir / "tokenizer_config.json")
        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
            by_name = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
            chat_template = by_name.get("default")
        template_file = model_dir / "chat_template.jinja"
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        if chat_template is None:
            chat_template = _read_json_if_exists(model_dir / "chat_template.json").get("chat_template")

        extra_eos: list[int] = []
        for name in ("config.json", "generation_config.json"):
            eos = _read_json_if_exists(model_dir / name).get("eos_token_id")
            extra_eos += eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            chat_template=chat_template,
            extra_eos_token_ids=extra_eos,
        )

    def save(self, directory: Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (readable by us and by transformers)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "add_bos_token": self._add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if self._chat_template is not None:
            config["chat_template"] = self._chat_template
        (directory / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        )

    # ---- properties -----------------------------------------------------------------------------

    @property
    def backend(self) -> BackendTokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the EOS token and the chat template's end-of-turn token."""
        return self._eos_token_ids

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos_token

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    # ---- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) stay whole.

        With ``add_special_tokens`` a BOS is prepended when the model asks for one, but never a
        second one when the text already starts with the BOS token (as rendered chat templates do).
        """
        if len(text) > LONG_TEXT_CHARS:
            # encode_batch lets go of the GIL while it works (encode holds it): other threads, the engine
            # stepping and the HTTP loop serving streams, run meanwhile. Same ids, ~15% more time.
            ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self._bos_token_id
        if add_special_tokens and self._add_bos_token and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """No token decodes to more characters than this (a byte-level piece has one stand-in character per
        byte, so its length bounds its text's): a text longer than max_model_len times this cannot fit."""
        pieces = self._backend.get_vocab(with_added_tokens=True)
        return max((len(piece) for piece in pieces), default=1)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs ``bytes``). A token that is only part of a
        character (a byte-level BPE piece of an emoji, a SentencePiece ``<0xE6>``) decodes on its own to
        U+FFFD; its bytes come from the vocabulary entry instead."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self._backend.id_to_token(int(token_id)) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        byte_of = _unicode_to_byte()
        if piece and all(ch in byte_of for ch in piece):  # a byte-level BPE piece
            return bytes(byte_of[ch] for ch in piece)
        return text.encode("utf-8")

    # ---- chat template --------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's own template (as transformers does).

        Content may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined with
        newlines). Raises ``InvalidRequest`` when there is no template, a message is malformed, or the
        template rejects the conversation.
        """
        if self._chat_template is None:
            raise InvalidRequest("this model has no chat template; use the completions API", param="messages")
        checked = _check_messages(messages)
        template = self._compiled_template
        if template is None:
            try:
                template = self._compiled_template = _compile_template(self._chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise InvalidRequest(f"the model's chat template does not compile: {e}") from None
        context: dict[str, Any] = dict(template_kwargs)
        context.update(
            messages=checked,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token or "",
            eos_token=self._eos_token or "",
        )
        if tools is not None:
            context["tools"] = tools
        try:
            return template.render(**context)
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"chat template error: {e}", param="messages") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
            raise InvalidRequest(
                f"the chat template cannot render these messages: {type(e).__name__}: {e}", param="messages"
            ) from None


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE's alphabet, reversed: the printable stand-in character of each of the 256 bytes.
    Printable Latin-1 bytes stand for themselves; the other 68 map, in byte order, to code points from 256."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    stand_in = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in stand_in):
        stand_in[b] = chr(256 + extra)
    return {ch: b for b, ch in stand_in.items()}


def _token_content(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _read_json_if_exists(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _byte_level_backend(meta: dict[str, Any], tokens: list[str]) -> BackendTokenizer:
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


def _sentencepiece_backend(
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
            if kind in (_TOKEN_NORMAL, _TOKEN_USER_DEFINED)
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


# ---- chat template helpers ---------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Copies of the messages with text-part lists flattened; InvalidRequest on malformed input."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object with 'role' and 'content'", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"{where} has no 'role'", param="messages")
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = "\n".join(_text_part(part, where) for part in content)
        elif content is None and not message.get("tool_calls"):
            raise InvalidRequest(f"{where} has no 'content'", param="messages")
        elif content is not None and not isinstance(content, str):
            raise InvalidRequest(
                f"{where}.content must be a string or a list of text parts", param="messages"
            )
        checked.append(message)
    return checked


def _text_part(part: Any, where: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise InvalidRequest(f"{where}.content: only text parts are supported", param="messages")


# ---- incremental detokenizer ---------------------------------------------------------------------

# Prompt tokens decoded in front of the output so that the first output token decodes in context
# (SentencePiece drops the leading space of a sequence's first token).
_PROMPT_CONTEXT_TOKENS = 5
_TRIM_AFTER = 64  # drop consumed ids once this many precede the decode window


class IncrementalDetokenizer:
    """Turns a request's output tokens into text deltas, one call per engine step.

    Each call decodes only a small window of recent tokens (as vLLM and TGI do)::

        ids:   ... | prefix_offset ......... read_offset ........ end
                     '-- already emitted --'  '-- new tokens --'
        delta = decode(ids[prefix:]) minus decode(ids[prefix:read])

    A delta never ends in a partial UTF-8 character: while the decoded window ends in U+FFFD the
    tokens are held back. With stop strings, text that could begin one is held back until it is
    clear whether it does; on a match ``stopped`` names the string and the text ends before it (or
    after it with ``include_stop_str_in_output``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""  # output text decoded so far, complete characters only, cut at a stop string
        self._num_emitted = 0  # characters of _text already returned as deltas
        self._finished = False
        self.stopped: str | None = None

    @property
    def text(self) -> str:
        """All output text so far (including text held back for a possible stop string)."""
        return self._text

    def add_tokens(self, new_ids: Sequence[int], check_stop: bool = True) -> str:
        """Append sampled tokens; return the text they add that is now safe to show. ``check_stop=False``
        (the output is still short of ``min_tokens``): no stop string ends it yet, though text that could
        begin one is still held back, so a string completed once the check is on is cut cleanly."""
        if self.stopped is not None or self._finished or not new_ids:
            return ""
        self._ids.extend(int(i) for i in new_ids)
        return self._append(self._decode_pending(final=False), final=False, check_stop=check_stop)

    def flush(self) -> str:
        """At the end of the request: everything still held back (nothing once a stop string matched)."""
        if self.stopped is not None or self._finished:
            return ""
        self._finished = True
        return self._append(self._decode_pending(final=True), final=True)

    def _decode_pending(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)
        full_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""  # nothing new, or a character is still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset >= _TRIM_AFTER:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full_text[len(prefix_text) :]

    def _append(self, new_text: str, final: bool, check_stop: bool = True) -> str:
        previous_len = len(self._text)
        self._text += new_text
        hold = 0
        if self._stop:
            match = self._find_stop(previous_len) if check_stop else None
            if match is not None:
                index, stop = match
                self.stopped = stop
                self._text = self._text[: index + len(stop) if self._include_stop else index]
                return self._emit(len(self._text))
            if not final:
                hold = self._partial_stop_len()
        return self._emit(max(self._num_emitted, len(self._text) - hold))

    def _emit(self, end: int) -> str:
        delta = self._text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return delta

    def _find_stop(self, previous_len: int) -> tuple[int, str] | None:
        """The earliest stop string in the text; only matches that end in the new text are new."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self._text.find(stop, max(0, previous_len - len(stop) + 1))
            if index >= 0 and (
                best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1]))
            ):
                best = (index, stop)
        return best

    def _partial_stop_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        text = self._text
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
