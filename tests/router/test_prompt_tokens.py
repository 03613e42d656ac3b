"""The gateway's routing key for chat requests: the conversation rendered as the replica will render it, the
template controls included."""

from __future__ import annotations

from kvserve.router.prompt_tokens import PromptTokens
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
    assert keys.of("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True})
