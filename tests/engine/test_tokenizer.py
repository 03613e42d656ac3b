"""kvserve.tokenizer: GGUF-built tokenizer, chat template, incremental detokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.errors import InvalidRequest
from kvserve.model.loader import resolve_model_path
from kvserve.tokenizer import LONG_TEXT_CHARS, Tokenizer
from tests.support.tiny_models import smollm2_tokenizer

TRICKY = [
    "Hello, world!",
    "héllo wörld — naïve café",
    "emoji 🤗🎉 and a family 👨‍👩‍👧‍👦",
    "中文字符和日本語のテキスト、한국어",
    "digits 12345 and 3.14159 and 1,000,000",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "\t\ttabs\n\n\nand   spaces   ",
    "I'm sure they'll say we've done it",
    "x² + y² = z²; ½ ¼ Ⅻ ٣٤٥",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "",
]

# Where transformers' GGUF tokenizer and ours disagree. transformers rebuilds a "smollm" GGUF vocabulary
# as a plain GPT-2 ByteLevel tokenizer and drops the Digits(individual_digits=True) step that SmolLM2's
# own tokenizer.json and llama.cpp (\p{N} split first) apply. The two only differ when a space
# precedes a non-ASCII numeric character (ASCII digits never merge with a space in this vocabulary).
KNOWN_DIFFERENCES = {
    "x² + y² = z²; ½ ¼ Ⅻ ٣٤٥",
    " ½",
    "Roman Ⅻ",
    "arabic ٣٤٥",
}
COMPARE = [
    *TRICKY,
    *KNOWN_DIFFERENCES,
    "The quick brown fox jumps over the lazy dog.",
    " 12345",
    "a1b22c333",
    "192.168.0.1:8080",
    "version 2.0.1-rc3",
    "$100.00 (USD)",
    "¹²³",
    "０１２３",
    "CAPS'S AND 'QUOTES'",
    "Ünïcödé ßtraße",
    "```python\nprint('hi')\n```",
    "a  b   c    d",
    "trailing  ",
    "  leading",
    "\u00a0nbsp and zero\u200bwidth",
    "Ωmega μ π",
    "<|endoftext|><repo_name>kvserve<file_sep>",
    "mixed<|im_end|>text",
    "https://example.com/path?q=1&r=2",
    "SELECT * FROM users WHERE id = 42;",
    "🎉🎉🎉",
    "\r\nwindows\r\nline endings",
    "1+1=2",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def default_path() -> Path:
    return resolve_model_path(None)


# ---- basics ------------------------------------------------------------------------------------------


def test_special_ids_and_vocab(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == (2,)  # <|im_end|>: the EOS and the template's end-of-turn token
    assert tok.add_bos_token is False  # tokenizer.ggml.add_bos_token = false
    assert set(range(17)) == set(tok.all_special_ids)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize("text", TRICKY)
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_special_tokens_encode_whole_and_skip_on_decode(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>") == [1]
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1
    assert tok.decode(ids) == "user\nHi"
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]


def test_digits_are_split_one_by_one(tok: Tokenizer) -> None:
    ids = tok.encode("12345")
    assert tok.convert_ids_to_tokens(ids) == ["1", "2", "3", "4", "5"]
    # Digits(individual_digits) runs before the GPT-2 split: a space never joins a numeric char.
    assert tok.convert_ids_to_tokens(tok.encode(" ½")) == ["Ġ", "Â½"]


def test_pre_tokenizer_matches_smollm2_tokenizer_json(tok: Tokenizer) -> None:
    """SmolLM2's tokenizer.json: Sequence[Digits(individual_digits=True), ByteLevel(False, use_regex=True)]."""
    pre = json.loads(tok.backend.to_str())["pre_tokenizer"]
    assert pre["type"] == "Sequence"
    digits, byte_level = pre["pretokenizers"]
    assert digits == {"type": "Digits", "individual_digits": True}
    assert byte_level["type"] == "ByteLevel"
    assert byte_level["add_prefix_space"] is False and byte_level["use_regex"] is True


@pytest.mark.slow
def test_ids_match_transformers_gguf_tokenizer(default_path: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(
        str(default_path.parent), gguf_file=default_path.name
    )
    differences = []
    for text in COMPARE:
        ours, theirs = tok.encode(text), reference.encode(text, add_special_tokens=True)
        if ours != theirs:
            differences.append(text)
            # Both still spell the same text.
            assert tok.decode(ours, skip_special_tokens=False) == reference.decode(theirs)
    assert set(differences) == KNOWN_DIFFERENCES


# ---- chat template -----------------------------------------------------------------------------------


def test_chat_template_with_default_system_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(text)
    assert ids.count(1) == 3 and ids.count(2) == 2


def test_chat_template_explicit_system_and_no_generation_prompt(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n"
    )
    assert messages[1]["content"][0] == {"type": "text", "text": "a"}  # caller's list untouched


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        ["not a dict"],
    ],
)
def test_malformed_messages_are_invalid_requests(tok: Tokenizer, messages) -> None:
    with pytest.raises(InvalidRequest):
        tok.apply_chat_template(messages)


def test_template_errors_and_missing_template(tmp_path: Path, tok: Tokenizer) -> None:
    tok.save(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}{% generation %}assistant:{% endgeneration %}{% endif %}"
    )
    config_path.write_text(json.dumps(config))
    custom = Tokenizer.from_model_path(tmp_path)
    assert custom.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>user: x\nassistant:"
    with pytest.raises(InvalidRequest, match="no tools here"):
        custom.apply_chat_template([{"role": "tool", "content": "x"}])

    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(InvalidRequest, match="no chat template"):
        Tokenizer.from_model_path(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_tools_and_documents_are_defined_without_them_as_transformers_defines_them(tmp_path: Path,
                                                                                  tok: Tokenizer) -> None:
    """A template testing ``tools is not none`` rendered its tools block for a request without tools."""
    tok.save(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = ("{% if tools is not none %}[TOOLS {{ tools | length }}]{% endif %}"
                               "{% if documents is not none %}[DOCS]{% endif %}"
                               "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    config_path.write_text(json.dumps(config))
    custom = Tokenizer.from_model_path(tmp_path)
    assert custom.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == "Hi"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert custom.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False,
                                      tools=[tool]) == "[TOOLS 1]Hi"


def test_save_and_reload_round_trip(tmp_path: Path, tok: Tokenizer) -> None:
    tok.save(tmp_path)
    again = Tokenizer.from_model_path(tmp_path)
    for text in TRICKY:
        assert again.encode(text) == tok.encode(text)
    assert again.eos_token_ids == tok.eos_token_ids
    assert again.bos_token_id == tok.bos_token_id
    assert again.chat_template == tok.chat_template
    assert again.all_special_ids == tok.all_special_ids


def test_saved_tokenizer_loads_in_transformers(tmp_path: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    tok.save(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TRICKY:
        assert reference.encode(text) == tok.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(messages)
    )


# ---- SentencePiece ("llama") GGUF vocabularies ------------------------------------------------------


def _write_sentencepiece_gguf(path: Path) -> None:
    pieces = [
        "▁",
        "a",
        "b",
        "c",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "▁h",
        "he",
        "ll",
        "▁he",
        "llo",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
        "▁a",
        "ab",
        "abc",
        "▁ab",
    ]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), *pieces]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf_matches_transformers(tmp_path: Path) -> None:
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    path = tmp_path / "sp.gguf"
    _write_sentencepiece_gguf(path)
    tok = Tokenizer.from_model_path(path)
    architecture, tokenizer_dict, _ = mapping.get_gguf_tokenizer(str(path))
    reference, _ = mapping.convert_gguf_tokenizer(architecture, tokenizer_dict)
    assert tok.add_bos_token and tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    for text in ["hello world", "abc ab a", "hello\nworld", "héllo wörld 中", "  two"]:
        ids = tok.encode(text)
        assert ids[0] == 1
        assert ids[1:] == reference.encode(text).ids, text  # the reference backend adds no BOS
        assert tok.decode(ids) == reference.decode(ids[1:])
    assert tok.convert_ids_to_tokens(tok.encode("hello world")) == ["<s>", "▁hello", "▁world"]
    assert tok.encode("<s>hello")[:2] == [1, tok.token_to_id("he")]  # no second BOS


def test_long_texts_tokenize_as_short_ones_do(tok: Tokenizer) -> None:
    """Past LONG_TEXT_CHARS the text goes through encode_batch (which releases the GIL): same ids."""
    text = ("<|im_start|>user\n" + MULTIBYTE + " 12345 ") * 120
    assert len(text) > LONG_TEXT_CHARS
    for special in (False, True):
        assert tok.encode(text, add_special_tokens=special) == tok.backend.encode(text, add_special_tokens=special).ids


def test_token_bytes_are_each_tokens_own_bytes(tok: Tokenizer, tmp_path: Path) -> None:
    """OpenAI's logprobs ``bytes``: a token that is part of a character decodes alone to U+FFFD, but its
    bytes are its own; a prompt's tokens' bytes concatenate to the prompt's UTF-8."""
    for text in ("🌞🌞 日本語", MULTIBYTE, " hello<|im_end|>"):
        ids = tok.encode(text, add_special_tokens=False)
        assert any("\ufffd" in tok.decode([i], skip_special_tokens=False) for i in ids) or text.startswith(" ")
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    path = tmp_path / "sp.gguf"
    _write_sentencepiece_gguf(path)
    sentencepiece = Tokenizer.from_model_path(path)
    ids = sentencepiece.encode("hé", add_special_tokens=False)  # "é" is two byte-fallback tokens
    assert [sentencepiece.token_bytes(i) for i in ids][-2:] == [b"\xc3", b"\xa9"]


# ---- incremental detokenizer ------------------------------------------------------------------------


def _stream(
    tok: Tokenizer, ids: list[int], chunk: int = 1, **kwargs
) -> tuple[list[str], IncrementalDetokenizer]:
    prompt = tok.encode("<|im_start|>assistant\n")
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas, detok


MULTIBYTE = "naïve 🤗 emoji, 中文字符, 👨‍👩‍👧‍👦 and ½ — done."


def test_deltas_concatenate_to_decode_one_token_at_a_time(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE)
    # The point of the test: some tokens are fragments of a character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas, detok = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE
    assert detok.text == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) > len(deltas) // 2  # streamed, not all at the end


def test_deltas_with_chunks_and_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hi 👋<|im_end|>\n<|im_start|>x")
    deltas, _ = _stream(tok, ids, chunk=3)
    assert "".join(deltas) == tok.decode(ids) == "Hi 👋\nx"
    deltas, _ = _stream(tok, ids, chunk=2, skip_special_tokens=False)
    assert "".join(deltas) == "Hi 👋<|im_end|>\n<|im_start|>x"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=40), chunk=st.integers(1, 4))
def test_deltas_concatenate_property(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas, _ = _stream(tok, ids, chunk=chunk, skip_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=False)
    # A character the output ends inside of is left out, never shown as U+FFFD (as vLLM).
    assert "".join(deltas) == full.rstrip("\ufffd")
    # SmolLM2's vocabulary lacks 21 byte tokens (0xC0, 0xF1, 0x04, ...): text using them loses bytes
    # and decodes with U+FFFD. Otherwise no delta may carry one.
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def _real_tokenizer(name: str) -> Tokenizer:
    from tests.e2e.conftest import installed_model

    return Tokenizer.from_model_path(installed_model(name))


def _streamed(tok: Tokenizer, prompt: list[int], output: list[int]) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add_tokens([token]) for token in output]
    deltas.append(detok.flush())
    return deltas, detok


def test_a_prompt_context_never_begins_inside_a_character() -> None:
    """Gemma's byte-fallback vocabulary decodes a run of byte tokens together: five prompt tokens of context
    began inside the prompt's last character, and the whole run, the output's first character with it,
    decoded as U+FFFD."""
    tok = _real_tokenizer("gemma-3-270m")
    prompt = tok.encode("Write: 𝔘𝔘")  # each 𝔘 four byte tokens
    output = tok.encode("𝔫 ok", add_special_tokens=False)
    deltas, detok = _streamed(tok, prompt, output)
    assert "".join(deltas) == detok.text == tok.decode(output) == "𝔫 ok"


def test_an_output_ending_inside_a_character_leaves_it_out_and_keeps_the_text_before() -> None:
    """U+FFFD ended the text of an output cut inside a character (max_tokens, a stop token); and where the
    prompt ends inside one, the output that completes it has it, with the rest of the unfinished token's text
    (here the space before the emoji), as tokenizers' DecodeStream gives it."""
    tok = _real_tokenizer("qwen2.5-coder-0.5b")
    party = tok.encode(" ok 🎉", add_special_tokens=False)  # the emoji is three byte-level tokens
    deltas, detok = _streamed(tok, tok.encode("Say"), party[:-1])
    assert "".join(deltas) == detok.text == " ok "
    prompt = tok.encode("Say:") + party[:-2]  # token ids cut inside the emoji
    deltas, detok = _streamed(tok, prompt, [party[-2], party[-1], *tok.encode(" yes", add_special_tokens=False)])
    assert "".join(deltas) == detok.text == " 🎉 yes"
    # An output that does not finish it: the unfinished character stays the prompt's, out of the text.
    deltas, detok = _streamed(tok, prompt, tok.encode(" yes", add_special_tokens=False))
    assert "".join(deltas) == detok.text == " yes"


def test_stop_string_split_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 42. STOP here and more")
    deltas, detok = _stream(tok, ids, stop=("STOP",))
    assert detok.stopped == "STOP"
    assert "".join(deltas) == detok.text == "The answer is 42. "
    # Tokens of "STOP" arrive one by one: "S", "T", ... are held back, never emitted.
    assert not any("S" in d for d in deltas)


def test_stop_string_included(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta gamma delta")
    deltas, detok = _stream(tok, ids, stop=("gam",), include_stop_str_in_output=True)
    assert detok.stopped == "gam"
    assert "".join(deltas) == detok.text == "alpha beta gam"


def test_stop_prefix_released_when_not_a_match(tok: Tokenizer) -> None:
    ids = tok.encode("a b ST c STOP d")
    detok = IncrementalDetokenizer(tok, [1], stop=("STOP",))
    emitted = ""
    for i in ids:
        emitted += detok.add_tokens([i])
        if detok.text.endswith(" ST"):
            assert not emitted.endswith("ST")  # held back while it could be the start of STOP
    assert detok.stopped == "STOP"
    assert emitted == detok.text == "a b ST c "
    assert detok.add_tokens(tok.encode(" more")) == "" and detok.flush() == ""


def test_held_back_prefix_is_flushed_at_the_end(tok: Tokenizer) -> None:
    ids = tok.encode("text that ends with ST")
    deltas, detok = _stream(tok, ids, stop=("STOP",))
    assert detok.stopped is None
    assert deltas[-1].endswith("ST")  # released by flush()
    assert "".join(deltas) == "text that ends with ST"


def test_earliest_stop_wins_and_stops_inside_one_token(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four")
    deltas, detok = _stream(tok, ids, chunk=100, stop=("four", "two", "wo t"))
    assert detok.stopped == "two"
    assert "".join(deltas) == "one "
    # A stop string inside a single token ("hello" -> "ell").
    deltas, detok = _stream(tok, tok.encode("say hello"), stop=("ell",))
    assert detok.stopped == "ell" and "".join(deltas) == "say h"


def test_prompt_text_never_matches_stop(tok: Tokenizer) -> None:
    prompt = tok.encode("please STOP")
    detok = IncrementalDetokenizer(tok, prompt, stop=("STOP",))
    out = detok.add_tokens(tok.encode(" now")) + detok.flush()
    assert detok.stopped is None and out == " now"


def test_a_description_rebuilds_the_same_tokenizer(tok: Tokenizer) -> None:
    """What a gateway rebuilds from ``GET /kvserve/tokenizer``: the same ids, template and end tokens."""
    copy = Tokenizer.from_description(json.loads(json.dumps(tok.describe())))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there 123"}]
    text = tok.apply_chat_template(messages)
    assert copy.apply_chat_template(messages) == text
    assert copy.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert copy.encode("plain text") == tok.encode("plain text")
    assert copy.eos_token_ids == tok.eos_token_ids and copy.bos_token_id == tok.bos_token_id


def test_a_malformed_description_is_a_model_load_error() -> None:
    from kvserve.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="not a tokenizer description"):
        Tokenizer.from_description({"tokenizer": "{not json"})


def test_a_continued_final_message_is_left_open_for_the_model(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": [{"type": "text", "text": "My favourite colour is "}]}]
    closed = tok.apply_chat_template(messages, add_generation_prompt=False)
    opened = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert opened.endswith("<|im_start|>assistant\nMy favourite colour is ") and closed.startswith(opened)
    assert closed[len(opened):].startswith("<|im_end|>")
    with pytest.raises(InvalidRequest, match="add_generation_prompt false") as info:
        tok.apply_chat_template(messages, continue_final_message=True)
    assert info.value.param == "continue_final_message"
    # Content that also occurs in the template's own markup ("end" in "<|im_end|>") is cut where it ends.
    short = [messages[0], {"role": "assistant", "content": "end"}]
    assert tok.apply_chat_template(short, add_generation_prompt=False,
                                   continue_final_message=True).endswith("<|im_start|>assistant\nend")


@pytest.mark.parametrize("pre, bos", [("llama-bpe", True), ("smollm", False)])
def test_a_gguf_that_does_not_say_adds_bos_as_llama_cpp_does(tmp_path: Path, pre: str, bos: bool) -> None:
    """Byte-level vocabularies of the Llama 3 kind (by their pre-tokenizer's name) take BOS when the file has
    no tokenizer.ggml.add_bos_token; others do not."""
    from kvserve.formats.gguf import read_gguf_header
    from kvserve.model.loader import resolve_model_path

    meta = read_gguf_header(resolve_model_path(None)).metadata
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = Tokenizer.from_model_path(path)
    assert tok.add_bos_token is bos
    assert (tok.encode("hello")[0] == meta["tokenizer.ggml.bos_token_id"]) is bos
