"""Tool calls in Llama 3's JSON format, found from the chat template (a tiny random model with a Llama 3.2-style
template that asks for ``{"name": ..., "parameters": ...}``), over HTTP through the official ``openai`` client:
the grammar holds each call to an offered tool and its schema, the reply comes back as ``tool_calls``,
streamed or not, and earlier calls go back to the template as objects."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvserve.config import EngineConfig, ModelConfig
from kvserve.server.serving import BackgroundServer
from tests.support.tiny_models import make_tiny_model

TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n'
    "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ '{\"name\": \"' + c.function.name + '\", \"parameters\": ' + (c.function.arguments | tojson) + '}' }}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {
        # bounded values: a random model's digits and strings would run on to max_tokens
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"],
        "additionalProperties": False}}},
]
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("llama3-tools"), "llama")
    server = BackgroundServer(EngineConfig(model=ModelConfig(str(model_dir), dtype="float32", chat_template=TEMPLATE)))
    yield server
    server.stop()


def test_required_calls_come_back_as_tool_calls(server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"add": {"a", "b"}, "get_weather": {"city"}}[call.function.name]

    named = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=120, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           logprobs=True)
    (add,) = named.choices[0].message.tool_calls
    assert add.function.name == "add" and set(json.loads(add.function.arguments)) == {"a", "b"}
    # the reply as the model wrote it: Llama 3's JSON, not hermes's tags (the format read from the template)
    written = "".join(t.token for t in named.choices[0].logprobs.content)  # then the end token
    assert json.JSONDecoder().raw_decode(written)[0] == {"name": "add",
                                                        "parameters": json.loads(add.function.arguments)}

    stream = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=120,
                                            temperature=0, tool_choice={"type": "function", "function": {"name": "add"}},
                                            stream=True)
    names, arguments_text, content = [], "", ""
    for chunk in stream:
        for delta_choice in chunk.choices:
            content += delta_choice.delta.content or ""
            for call_delta in delta_choice.delta.tool_calls or []:
                names += [call_delta.function.name] if call_delta.function.name else []
                arguments_text += call_delta.function.arguments or ""
    assert names == ["add"] and json.loads(arguments_text) == json.loads(add.function.arguments) and not content


def test_earlier_calls_reach_the_template_as_objects(server) -> None:
    turn = [*QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    rendered = httpx.post(server.base_url + "/tokenize", json={"messages": turn, "tools": TOOLS,
                                                               "return_token_strs": False}).json()
    text = server.engine.tokenizer.decode(rendered["tokens"], skip_special_tokens=False)
    assert '{"name": "add", "parameters": {"a": 2, "b": 3}}' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n5" in text
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=turn, tools=TOOLS,
                                           tool_choice="none", max_tokens=8, temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content is not None


def test_a_response_format_beside_tools_is_a_400_where_calls_are_json_objects(server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=client.models.list().data[0].id, messages=QUESTION, tools=TOOLS,
                                       response_format={"type": "json_object"}, max_tokens=8)
    assert raised.value.body["param"] == "response_format" and "cannot be told" in raised.value.body["message"]
