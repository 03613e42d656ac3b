"""Tool calls and results in a conversation, as a chat template without tool support gets them (plain text)."""

from __future__ import annotations

from kvserve.server import protocol as p
from kvserve.server.tools import template_messages, tool_request
from kvserve.structured.tool_calls import HermesToolFormat

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_content_parts_of_calls_and_results_are_written_as_their_text() -> None:
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}], "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]}]
    body = p.ChatCompletionRequest.model_validate({"messages": messages, "tools": TOOLS})
    fmt = HermesToolFormat(special_tags=False)
    out = template_messages(body.message_dicts(), tool_request(body, None), fmt, template_has_tools=False)
    assert out[2] == {"role": "assistant", "content": "Let me check.\n" + fmt.render_calls([("f", {})])}
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
