"""Tool calls in Mistral's format, the pythonic one and Qwen3-Coder's XML, each found from a chat template of its layout, over
HTTP through the official ``openai`` client, on tiny random models (not those families' weights): the grammar
holds each call to an offered tool and its schema, replies come back as ``tool_calls``, streamed or not, and
earlier calls go back to the template. Mistral's ``[TOOL_CALLS]`` is a special token of the vocabulary here, as
in Mistral's, and its template refuses call ids that are not nine letters and digits, as Mistral's does."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from kvserve.config import EngineConfig, ModelConfig
from kvserve.server.serving import BackgroundServer
from kvserve.structured.tool_formats import MistralToolFormat
from tests.support.tiny_models import make_tiny_model, with_renamed_tokens

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST] {{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    "{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}, "
    "\"id\": \"{{ c.id }}\"}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}, "
    "\"call_id\": \"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{% else %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)
PYTHONIC_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou have access to the following functions. To call functions, please "
    "respond with a python list of the calls. Respond in the format [func_name1(params_name1=params_value1), "
    "func_name2(params)]\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}[{% for c in m.tool_calls %}"
    "{{ c.function.name }}({% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {
        # bounded values: a random model's digits and strings would run on to max_tokens
        "type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"enum": [4, 5]}, "exact": {"type": "boolean"}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"],
        "additionalProperties": False}}},
]
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
NAMED = {"type": "function", "function": {"name": "add"}}


XML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "If you choose to call a function ONLY reply in the following format:\n<tool_call>\n<function=example_function_name>"
    "\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v if v is string else v | tojson }}"
    "\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def xml_server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("xml-tools"), "qwen3")
    server = BackgroundServer(EngineConfig(model=ModelConfig(str(model_dir), dtype="float32",
                                                             chat_template=XML_TEMPLATE)))
    yield server
    server.stop()


NAMED_TEMPLATE = (  # mistral-common's layout from tokenizer v11 on: [TOOL_CALLS]name[ARGS]{...} per call
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ '[TOOL_CALLS]' + c.function.name + '[ARGS]' + (c.function.arguments | tojson) }}{% endfor %}{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def named_server(tmp_path_factory: pytest.TempPathFactory):
    tiny = make_tiny_model(tmp_path_factory.mktemp("mistral-named-tools"), "mistral")
    model_dir = with_renamed_tokens(tiny, tmp_path_factory.mktemp("named-tokens") / "model",
                                    {"<gh_stars>": "[TOOL_CALLS]", "<issue_start>": "[ARGS]"}, special=True)
    server = BackgroundServer(EngineConfig(model=ModelConfig(str(model_dir), dtype="float32",
                                                             chat_template=NAMED_TEMPLATE)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory: pytest.TempPathFactory):
    tiny = make_tiny_model(tmp_path_factory.mktemp("mistral-tools"), "mistral")
    model_dir = with_renamed_tokens(tiny, tmp_path_factory.mktemp("tool-calls-token") / "model",
                                    {"<gh_stars>": "[TOOL_CALLS]"}, special=True)
    server = BackgroundServer(EngineConfig(model=ModelConfig(str(model_dir), dtype="float32",
                                                             chat_template=MISTRAL_TEMPLATE)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pythonic_server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("pythonic-tools"), "llama")
    server = BackgroundServer(EngineConfig(model=ModelConfig(str(model_dir), dtype="float32",
                                                             chat_template=PYTHONIC_TEMPLATE)))
    yield server
    server.stop()


def _client(server) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    return client, client.models.list().data[0].id


def _streamed_calls(stream) -> tuple[list[str], list[str], dict[int, str], str]:
    """(names, ids, arguments by index, content) of a streamed reply."""
    names, ids, arguments, content = [], [], {}, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                names += [call.function.name] if call.function and call.function.name else []
                ids += [call.id] if call.id else []
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    return names, ids, arguments, content


def _check_arguments(name: str, arguments: str) -> dict[str, Any]:
    parsed = json.loads(arguments)
    if name == "add":
        assert parsed["a"] in (1, 2, 3) and parsed["b"] in (4, 5) and set(parsed) <= {"a", "b", "exact"}
    else:
        assert parsed == {"city": parsed["city"]} and parsed["city"] in ("Oslo", "Paris")
    return parsed


def test_mistral_calls_come_back_as_tool_calls_with_mistral_ids(mistral_server) -> None:
    client, model = _client(mistral_server)
    reply = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0, logprobs=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert len(call.id) == 9 and call.id.isascii() and call.id.isalnum()
        _check_arguments(call.function.name, call.function.arguments)
    # as the model wrote it: the [TOOL_CALLS] token, then the JSON list of the calls
    written = [t.token for t in choice.logprobs.content]
    assert written[0] == "[TOOL_CALLS]"
    listed = json.JSONDecoder().raw_decode("".join(written[1:]).lstrip())[0]
    assert listed == [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                      for c in choice.message.tool_calls]

    names, ids, arguments, content = _streamed_calls(client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, max_tokens=120, temperature=0, stream=True))
    assert names == ["add"] and len(ids[0]) == 9 and not content
    _check_arguments("add", arguments[0])


def test_earlier_calls_reach_mistrals_template_with_ids_it_takes(mistral_server) -> None:
    call_id = "call_0f3c2a9d81b64e7a9c5d2e10"  # OpenAI's form: Mistral's template refuses it as it is
    turn = [*QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 4}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "6"}]
    rendered = httpx.post(mistral_server.base_url + "/tokenize", json={"messages": turn, "tools": TOOLS}).json()
    text = mistral_server.engine.tokenizer.decode(rendered["tokens"], skip_special_tokens=False)
    short = MistralToolFormat().template_call_id(call_id)
    assert len(short) == 9 and short.isalnum()
    assert f'[TOOL_CALLS] [{{"name": "add", "arguments": {{"a": 2, "b": 4}}, "id": "{short}"}}]' in text
    assert f'"call_id": "{short}"}}[/TOOL_RESULTS]' in text
    client, model = _client(mistral_server)
    reply = client.chat.completions.create(model=model, messages=turn, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.tool_calls is None


def test_pythonic_calls_come_back_as_tool_calls(pythonic_server) -> None:
    client, model = _client(pythonic_server)
    reply = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0, logprobs=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content and choice.message.tool_calls
    written = "".join(t.token for t in choice.logprobs.content)
    expected = ", ".join(f"{c.function.name}(" + ", ".join(
        f"{k}={v!r}" for k, v in _check_arguments(c.function.name, c.function.arguments).items()) + ")"
        for c in choice.message.tool_calls)
    assert written.replace("'", '"').startswith(f"[{expected}]".replace("'", '"'))

    names, ids, arguments, content = _streamed_calls(client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, max_tokens=120, temperature=0, stream=True))
    assert names == ["add"] and ids[0].startswith("call_") and not content
    named = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=120, temperature=0)
    assert json.loads(arguments[0]) == json.loads(named.choices[0].message.tool_calls[0].function.arguments)


def test_a_tool_python_cannot_call_is_a_400_and_earlier_calls_reach_the_template(pythonic_server) -> None:
    client, model = _client(pythonic_server)
    hyphenated = [{"type": "function", "function": {"name": "get-weather", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model, messages=QUESTION, tools=hyphenated, max_tokens=8)
    assert raised.value.body["param"] == "tools" and "Python identifier" in raised.value.body["message"]
    turn = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 4}'}}]}]
    rendered = httpx.post(pythonic_server.base_url + "/tokenize", json={"messages": turn, "tools": TOOLS}).json()
    assert "[add(a=2, b=4)]" in pythonic_server.engine.tokenizer.decode(rendered["tokens"])


WEATHER_REPORT = {"type": "json_schema", "json_schema": {"name": "report", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"], "additionalProperties": False}}}


def test_tools_with_a_response_format_reply_with_calls_or_the_answer(mistral_server) -> None:
    client, model = _client(mistral_server)
    tag = mistral_server.engine.tokenizer.token_to_id("[TOOL_CALLS]")
    asked = {"model": model, "messages": QUESTION, "tools": TOOLS, "response_format": WEATHER_REPORT,
             "max_tokens": 120, "temperature": 0}
    answered = client.chat.completions.create(**asked, logit_bias={str(tag): -100})  # no call can open
    choice = answered.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    report = json.loads(choice.message.content)
    assert set(report) == {"city", "sunny"} and report["city"] in ("Oslo", "Paris")

    called = client.chat.completions.create(**asked, logit_bias={str(tag): 100})  # the calls open
    assert called.choices[0].finish_reason == "tool_calls" and not called.choices[0].message.content
    for call in called.choices[0].message.tool_calls:
        _check_arguments(call.function.name, call.function.arguments)

    names, _, arguments, content = _streamed_calls(client.chat.completions.create(
        **asked, logit_bias={str(tag): -100}, stream=True))
    assert not names and json.loads(content) == report

    for response_format, param in [({"type": "json_schema", "json_schema": {"name": "xs", "schema": {
            "type": "array"}}}, "response_format.json_schema.schema")]:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(**{**asked, "response_format": response_format})
        assert raised.value.body["param"] == param and "JSON object" in raised.value.body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**{k: v for k, v in asked.items() if k != "response_format"},
                                       extra_body={"guided_regex": "[a-z]+"})
    assert raised.value.body["param"] == "guided_regex"
    # a call is made whatever the response format says when one is required
    required = client.chat.completions.create(**asked, tool_choice="required")
    assert required.choices[0].message.tool_calls


def test_qwen3_coder_calls_come_back_as_tool_calls(xml_server) -> None:
    client, model = _client(xml_server)
    reply = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           max_tokens=160, temperature=0, logprobs=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content and choice.message.tool_calls
    written = "".join(t.token for t in choice.logprobs.content)
    for call in choice.message.tool_calls:  # as the model wrote it: one <parameter=...> block per argument
        arguments = _check_arguments(call.function.name, call.function.arguments)
        assert f"<function={call.function.name}>\n" in written
        for key, value in arguments.items():
            shown = value if isinstance(value, str) else json.dumps(value)
            assert f"<parameter={key}>\n{shown}\n</parameter>\n" in written

    names, ids, arguments, content = _streamed_calls(client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, max_tokens=160, temperature=0, stream=True))
    named = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=160, temperature=0)
    assert names == ["add"] and not content
    assert json.loads(arguments[0]) == json.loads(named.choices[0].message.tool_calls[0].function.arguments)
    turn = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    rendered = httpx.post(xml_server.base_url + "/tokenize", json={"messages": turn, "tools": TOOLS}).json()
    text = xml_server.engine.tokenizer.decode(rendered["tokens"])
    assert "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>" in text


def test_mistrals_named_layout_comes_back_as_tool_calls(named_server) -> None:
    """Both tags special tokens, as in Mistral's vocabularies: out of the text, which holds name{...}."""
    client, model = _client(named_server)
    reply = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           max_tokens=160, temperature=0, logprobs=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content and choice.message.tool_calls
    written = [t.token for t in choice.logprobs.content]
    expected = []
    for call in choice.message.tool_calls:
        assert len(call.id) == 9 and call.id.isalnum()
        _check_arguments(call.function.name, call.function.arguments)
        expected += ["[TOOL_CALLS]", call.function.name, "[ARGS]", call.function.arguments]
    assert "".join(written).startswith("".join(expected)) and written[0] == "[TOOL_CALLS]"

    names, _, arguments, content = _streamed_calls(client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, max_tokens=160, temperature=0, stream=True))
    assert names == ["add"] and not content
    _check_arguments("add", arguments[0])
