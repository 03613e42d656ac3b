"""The tool-call format a server writes, constrains and reads calls in: by name (``--tool-call-parser``, vLLM's
names) or, under ``auto``, from the words of the model's chat template."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.structured.mistral_named_tools import ARGS_TAG, TOOL_CALLS_TAG, MistralNamedToolFormat
from kvserve.structured.pythonic_tools import PythonicToolFormat
from kvserve.structured.tool_calls import HermesToolFormat, ToolCallFormat
from kvserve.structured.tool_formats import ListToolFormat, Llama3JsonToolFormat, MistralToolFormat
from kvserve.structured.xml_tools import XmlToolFormat

# What a chat template says, in each format's own words, that picks it under ``auto`` (the first that matches).
_TEMPLATE_MARKS = (("mistral", ("[TOOL_CALLS]",)), ("granite", ("<|tool_call|>",)), ("phi4_mini_json", ("functools[",)),
                   ("qwen3_coder", ("<parameter=",)), ("pythonic", ("python list of the calls", "[func_name1(")),
                   ("llama3_json", ("<|python_tag|>", '"parameters": dictionary of argument name')))
GRANITE_TAGS = ("<|tool_call|>", "<tool_call>")  # Granite 3.0's token; 3.1 and later write it as text


def tool_format_for(parser: str, chat_template: str | None,
                    special_token_id: Callable[[str], int | None]) -> ToolCallFormat:
    """The tool-call format ``parser`` names (``--tool-call-parser``); ``auto``: the one whose words the chat
    template holds (Mistral's tags, Granite's and Phi-4-mini's, Qwen3-Coder's parameter blocks, a pythonic list,
    Llama 3's JSON), else hermes. ``special_token_id``: a
    tag's id where it is one special token of the vocabulary, else None."""
    if parser == "auto":
        template = chat_template or ""
        parser = next((name for name, marks in _TEMPLATE_MARKS if any(mark in template for mark in marks)), "hermes")
    if parser == "llama3_json":
        return Llama3JsonToolFormat(special_tag=special_token_id(Llama3JsonToolFormat.open_tag) is not None)
    if parser == "mistral":  # the layout of tokenizer v11 on where the template writes [ARGS]
        tag_id = special_token_id(TOOL_CALLS_TAG)
        if ARGS_TAG in (chat_template or ""):
            return MistralNamedToolFormat(tag_id, special_token_id(ARGS_TAG))
        return MistralToolFormat(tag_id)
    if parser == "granite":
        token_id = special_token_id(GRANITE_TAGS[0])
        return ListToolFormat(GRANITE_TAGS[0], token_id) if token_id is not None else ListToolFormat(GRANITE_TAGS[1])
    if parser == "phi4_mini_json":
        return ListToolFormat("functools")
    if parser == "pythonic":
        return PythonicToolFormat()
    tags = (HermesToolFormat.open_tag, HermesToolFormat.close_tag)
    special_tags = all(special_token_id(tag) is not None for tag in tags)
    return XmlToolFormat(special_tags) if parser == "qwen3_coder" else HermesToolFormat(special_tags)
