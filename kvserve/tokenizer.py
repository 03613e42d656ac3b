"""Tokenizer and chat template (the incremental detokenizer is in detokenizer.py).

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` built either from a Hugging Face ``tokenizer.json`` or
from GGUF metadata (vocabulary, merges, token types, pre-tokenizer name), so a GGUF needs no other file.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

from kvserve.errors import ConfigError, InvalidRequest, ModelLoadError, ModelNotFound, UnsupportedModel
from kvserve.formats.gguf import read_gguf_header
from kvserve.formats.gguf_vocab import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    byte_level_backend,
    sentencepiece_backend,
)
from kvserve.formats.hf_config import read_hf_json
from kvserve.reasoning import Phase, ReasoningMarkers, phase_of_reply

logger = logging.getLogger(__name__)

# Texts longer than this are tokenized without holding the GIL (Tokenizer.encode); the server also moves
# them off its event loop.
LONG_TEXT_CHARS = 4096


# Tokens that end an assistant turn in common chat formats. One counts as a stop token when it is a
# special token of the vocabulary and the chat template writes it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


# Byte-level pre-tokenizers llama.cpp adds BOS for when a GGUF does not say (llama-vocab.cpp).
_BOS_BY_DEFAULT_PRE_TOKENIZERS = ("llama3", "llama-v3", "llama-bpe", "falcon3")

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
        token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        if model == "gpt2":
            backend = byte_level_backend(meta, tokens)
        elif model == "llama":
            backend = sentencepiece_backend(meta, tokens, token_types)
        else:
            raise UnsupportedModel(f"{path}: GGUF tokenizer model {model!r} is not supported (gpt2, llama)")

        control = [tok for tok, kind in zip(tokens, token_types, strict=False) if kind == TOKEN_CONTROL]
        user_defined = [
            tok for tok, kind in zip(tokens, token_types, strict=False) if kind == TOKEN_USER_DEFINED
        ]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        if user_defined:
            backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

        def token_at(key: str) -> str | None:
            token_id = meta.get(f"tokenizer.ggml.{key}")
            return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

        bos_token, eos_token = token_at("bos_token_id"), token_at("eos_token_id")
        # Without the key, llama.cpp's default: BOS for SentencePiece vocabularies and for the byte-level ones
        # of Llama 3 and its kin (their pre-tokenizer names).
        add_bos = meta.get("tokenizer.ggml.add_bos_token",
                           model == "llama" or meta.get("tokenizer.ggml.pre") in _BOS_BY_DEFAULT_PRE_TOKENIZERS)
        if add_bos and bos_token is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_token}:0 $A:0",
                pair=f"{bos_token}:0 $A:0 $B:1",
                special_tokens=[(bos_token, int(meta["tokenizer.ggml.bos_token_id"]))],
            )
        extra_eos = [meta.get(f"tokenizer.ggml.{k}") for k in ("eot_token_id", "eom_token_id")]
        if not add_bos and bos_token in END_OF_TURN_TOKENS:
            # A BOS never prepended that reads as an end token (Qwen's <|endoftext|>) separates documents:
            # the model writes it when a completion ends, and its generation config stops there.
            extra_eos.append(meta["tokenizer.ggml.bos_token_id"])
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

    def describe(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer elsewhere (``from_description``), as JSON-able data: a
        gateway tokenizes exactly as its replicas do without reading the model file."""
        return {
            "tokenizer": self._backend.to_str(),
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "chat_template": self._chat_template,
            "eos_token_ids": list(self._eos_token_ids),
        }

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> Tokenizer:
        try:
            backend = BackendTokenizer.from_str(description["tokenizer"])
            return cls(backend, bos_token=description.get("bos_token"), eos_token=description.get("eos_token"),
                       chat_template=description.get("chat_template"),
                       extra_eos_token_ids=description.get("eos_token_ids") or ())
        except Exception as e:  # tokenizers raises a bare Exception on malformed data
            raise ModelLoadError(f"not a tokenizer description: {e}") from None

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

    def with_chat_template(self, template: str) -> Tokenizer:
        """The same tokenizer rendering chats with ``template`` (the template's end-of-turn token ends outputs
        too, as the model's own template's does)."""
        return Tokenizer(self._backend, bos_token=self._bos_token, eos_token=self._eos_token, chat_template=template,
                         extra_eos_token_ids=self._eos_token_ids)

    # ---- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) stay whole.

        With ``add_special_tokens`` a BOS is prepended when the model asks for one, but never a
        second one when the text already starts with the BOS token (as rendered chat templates do).
        """
        if len(text) > LONG_TEXT_CHARS:
            # encode_batch lets go of the GIL while it works (encode holds it): other threads, the engine
            # stepping and the HTTP loop serving streams, run meanwhile. Same ids, at some cost in time
            # (benchmarks/host_side_costs.py).
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
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's own template (as transformers does).

        Content may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined with
        newlines). With ``continue_final_message`` the text ends where the final message's content does, open
        for the model to continue it: the template's end of turn after it is cut off, as transformers does.
        ``variables`` (a client's ``chat_template_kwargs``, any names) and ``template_kwargs`` are the template's
        further variables. Raises ``InvalidRequest`` when there is no template, a message is malformed, or the template rejects the
        conversation.
        """
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest("continue_final_message continues the last message: it takes add_generation_prompt "
                                 "false", param="continue_final_message")
        if self._chat_template is None:
            raise InvalidRequest("this model has no chat template; use the completions API", param="messages")
        checked = _check_messages(messages)
        if continue_final_message:  # marked where its content ends, to cut there once rendered
            final = checked[-1]
            if not isinstance(final.get("content"), str):
                raise InvalidRequest("continue_final_message: the final message has no content to continue",
                                     param="messages")
            checked[-1] = {**final, "content": final["content"] + _OPEN_END}
        template = self._compiled_template
        if template is None:
            try:
                template = self._compiled_template = _compile_template(self._chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise InvalidRequest(f"the model's chat template does not compile: {e}") from None
        context: dict[str, Any] = {**(variables or {}), **template_kwargs}  # variables: a client's, any name
        context.update(
            messages=checked,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token or "",
            eos_token=self._eos_token or "",
        )
        if tools is not None:
            context["tools"] = tools
        for name in ("tools", "documents"):  # defined, as transformers passes them: a template may test `is none`
            context.setdefault(name, None)
        try:
            text = template.render(context)  # a dict: a variable may be named "self"
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"chat template error: {e}", param="messages") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
            raise InvalidRequest(
                f"the chat template cannot render these messages: {type(e).__name__}: {e}", param="messages"
            ) from None
        if not continue_final_message:
            return text
        if text.count(_OPEN_END) != 1:
            raise InvalidRequest("continue_final_message: the chat template changes the final message's content, "
                                 "so it cannot be left open", param="messages")
        return text[:text.index(_OPEN_END)]


def read_chat_template(value: str) -> str:
    """``--chat-template``'s value: a Jinja template written out, or a file's path (as vLLM reads it)."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"chat_template is neither a Jinja template nor a file that can be read ({path}): {exc}",
                          "chat_template") from None


def chat_reply_phase(tokenizer: Tokenizer, rendered: str, messages: list[dict[str, Any]], markers: ReasoningMarkers,
                     *, add_generation_prompt: bool = True, continue_final_message: bool = False,
                     tools: list[dict[str, Any]] | None = None, variables: Mapping[str, Any] | None = None) -> Phase:
    """Where ``rendered`` (``messages`` through the chat template) leaves a reasoning model's reply: read from
    what the generation prompt adds, found by rendering the conversation without it (a ``<think>`` inside a
    message says nothing of the reply); a continued final message, from its own text."""
    if continue_final_message:
        return phase_of_reply(rendered, None, markers, continued=message_text(messages[-1]))
    without = rendered if not add_generation_prompt else tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, tools=tools, variables=variables)
    return phase_of_reply(rendered, without, markers)


# Appended to a continued message's content before rendering: where the text is cut. Searching for the content
# itself can match elsewhere (a message "end" inside "<|im_end|>").
_OPEN_END = "KVSERVEOPENEND7f3a9c"


def message_text(message: dict[str, Any]) -> str:
    """A message's content as the template gets it: a string, or its text parts joined with newlines."""
    content = message.get("content")
    if isinstance(content, list):
        return _joined_parts(content, "the message")
    return content or ""


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
    return read_hf_json(path) if path.is_file() else {}


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
            message["content"] = _joined_parts(content, where)
        elif content is None and not message.get("tool_calls"):
            raise InvalidRequest(f"{where} has no 'content'", param="messages")
        elif content is not None and not isinstance(content, str):
            raise InvalidRequest(
                f"{where}.content must be a string or a list of text parts", param="messages"
            )
        checked.append(message)
    return checked


def _joined_parts(parts: list[Any], where: str) -> str:
    return "\n".join(_text_part(part, where) for part in parts)


def _text_part(part: Any, where: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise InvalidRequest(f"{where}.content: only text parts are supported", param="messages")


def tokenizer_mismatch(target: Tokenizer, draft: Tokenizer) -> str | None:
    """Why ``draft``'s token ids would not mean the same text as ``target``'s (None: they do): a draft model
    proposes ids, and the target reads them as its own."""
    target_vocab = target.backend.get_vocab(with_added_tokens=True)
    draft_vocab = draft.backend.get_vocab(with_added_tokens=True)
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda item: item[1])
        token, token_id = differing[0]
        return (f"the vocabularies differ ({len(target_vocab):,} and {len(draft_vocab):,} tokens; first difference: "
                f"{token!r} at id {token_id})")
    if target.all_special_ids != draft.all_special_ids:
        ids = sorted(target.all_special_ids ^ draft.all_special_ids)
        return f"the special tokens differ (ids {ids[:5]})"
    if target.bos_token_id != draft.bos_token_id:
        return f"the BOS tokens differ ({target.bos_token_id} and {draft.bos_token_id})"
    return None
