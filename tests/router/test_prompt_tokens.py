"""The gateway's routing key: a chat request's conversation rendered as the replica will render it (the template
controls included), a fill-in-the-middle request's gap laid out as the replica lays it out."""

from __future__ import annotations

from kvserve.infill import FimTokens
from kvserve.router.prompt_tokens import PromptTokens
from kvserve.tokenizer import Tokenizer
from tests.e2e.conftest import installed_model
from tests.support.tiny_models import smollm2_tokenizer

MESSAGES = [{"role": "user", "content": "What colour is the sky?"}, {"role": "assistant", "content": "It is"}]


def test_a_continued_message_is_keyed_open_and_a_plain_chat_with_its_generation_prompt() -> None:
    tokenizer = smollm2_tokenizer()
    keys = PromptTokens()
    keys.add("m", tokenizer)

    def rendered(**controls: bool) -> tuple[int, ...]:
        return tuple(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, **controls), add_special_tokens=False))

    continued = {"add_generation_prompt": False, "continue_final_message": True}
    assert keys.of("/v1/chat/completions", {"messages": MESSAGES, **continued}) == rendered(**continued)
    assert keys.of("/v1/chat/completions", {"messages": MESSAGES}) == rendered(add_generation_prompt=True)
    # A body the replica will refuse (both flags) is routed on its bytes, never an error at the gateway.
    refused = keys.of("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True})
    assert refused and refused not in (rendered(**continued), rendered(add_generation_prompt=True))


def test_a_responses_request_is_keyed_on_the_conversation_its_input_items_make() -> None:
    tokenizer = smollm2_tokenizer()
    keys = PromptTokens()
    keys.add("m", tokenizer)
    chat = [{"role": "system", "content": "Be brief."}, *MESSAGES[:1]]
    expected = keys.of("/v1/chat/completions", {"messages": chat})
    assert keys.of("/v1/responses", {"instructions": "Be brief.", "input": MESSAGES[0]["content"]}) == expected
    assert keys.of("/v1/responses", {"instructions": "Be brief.", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": MESSAGES[0]["content"]}]}]}
                   ) == expected
    # One model served under several names: a request naming none is keyed with its tokenizer all the same.
    keys.add("m-alias", tokenizer)
    assert keys.of("/v1/chat/completions", {"messages": chat}) == expected
    # Template variables are the replica's too.
    variables = {"chat_template_kwargs": {"unused": 1}}
    assert keys.of("/v1/chat/completions", {"messages": chat, **variables}) == expected


def test_a_suffix_is_keyed_on_the_gap_the_replica_lays_out() -> None:
    tokenizer = Tokenizer.from_model_path(installed_model("qwen2.5-coder-0.5b"))
    fim = FimTokens.of(tokenizer)
    assert fim is not None
    keys = PromptTokens()
    keys.add("coder", tokenizer)
    before, after = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    assert keys.of("/v1/completions", {"prompt": before, "suffix": after}) == tuple(fim.prompt(tokenizer, before,
                                                                                               after))
    assert keys.of("/v1/completions", {"prompt": [before, "x"], "suffix": after})[0] == fim.prefix
    assert keys.of("/v1/completions", {"prompt": before}) == tuple(tokenizer.encode(before))


def test_token_ids_no_vocabulary_holds_are_routed_on_the_bodys_bytes() -> None:
    keys = PromptTokens()
    for prompt in ([1, float("inf")], [1, -1], [1, 2**32], [[3, 2**40]]):
        key = keys.of("/v1/completions", {"prompt": prompt})  # the replica refuses them; the gateway routes them
        assert key and all(0 <= t < 256 for t in key)
    assert keys.of("/v1/completions", {"prompt": [5, 7, 2**32 - 1]}) == (5, 7, 2**32 - 1)
