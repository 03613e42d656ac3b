"""Reasoning models: thoughts apart from the answer, a thinking budget that forces the end marker, and a
structured output's grammar that starts after the thoughts. A tiny random Qwen3 with a template that opens a
``<think>`` block as DeepSeek-R1's distills do (``</think>`` is several tokens in its vocabulary), checked
token for token against transformers and over HTTP through the official ``openai`` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig, ModelConfig
from kvserve.errors import ConfigError
from kvserve.reasoning import Phase, ReasoningMarkers, count_reasoning_tokens, split_reasoning
from kvserve.router.prompt_tokens import PromptTokens, template_defaults
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server.serving import BackgroundServer
from kvserve.serving_config import ServerConfig
from kvserve.tokenizer import Tokenizer
from tests.e2e.conftest import hf_greedy
from tests.support.tiny_models import make_tiny_model, with_renamed_tokens

# Qwen3's layout: the generation prompt opens the thoughts, or writes an empty block for enable_thinking false;
# an earlier reply's thoughts come back from reasoning_content.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
# Qwen3's hybrid layout: the model decides itself whether to open a block.
HYBRID_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
QUESTION = [{"role": "user", "content": "Is 7 a prime number?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("reasoning"), "qwen3", tie=False)


@pytest.fixture(scope="module")
def think_token_dir(model_dir, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model with <think> and </think> as single (ordinary) tokens, as Qwen3's vocabulary holds them:
    two of SmolLM2's unused special tokens renamed."""
    return with_renamed_tokens(model_dir, tmp_path_factory.mktemp("think-tokens") / "model",
                               {"<gh_stars>": "<think>", "<issue_start>": "</think>"}, special=False)


@pytest.fixture(scope="module")
def reference(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_budget_forces_the_end_and_the_grammar_starts_after_the_thoughts(model_dir, reference) -> None:
    """Batched, chunked, preempted (a pool too small for all four at once) and speculated (n-gram drafts,
    verified a depth at a time through the gate): each request's thoughts are transformers' greedy tokens up to
    its budget, then the end marker, then the answer transformers gives after them; a JSON schema constrains
    the answer only."""
    llm = LLM(str(model_dir), dtype="float32", chat_template=TEMPLATE, block_size=4, num_kv_blocks=24,
              max_num_batched_tokens=16, enable_prefix_caching=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "adaptive": False})
    tokenizer = llm.get_tokenizer()
    assert llm.engine.reasoning_markers == ReasoningMarkers()  # found in the template (--reasoning-parser auto)
    end_ids = list(llm.engine.reasoning_tokens.end_ids)
    assert len(end_ids) > 1
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("Is 7 a prime number?", "Name a colour.", "What is 2 + 2?", "Say hi.")]
    budgets = [0, 3, 6, None]
    max_tokens = 14
    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                           thinking_token_budget=b) for b in budgets])
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.runner.num_proposed_tokens > 0
    for prompt, budget, output in zip(prompts, budgets, outputs, strict=True):
        if budget is None:
            expected = hf_greedy(reference, prompt, max_tokens)
        else:
            thoughts = hf_greedy(reference, prompt, budget) if budget else []
            answer = hf_greedy(reference, prompt + thoughts + end_ids, max_tokens - budget - len(end_ids))
            expected = thoughts + end_ids + answer
        assert output.outputs[0].token_ids == expected
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], free)] == [
        hf_greedy(reference, p, max_tokens) for p in prompts]

    schema = SamplingParams(temperature=0.0, max_tokens=60, thinking_token_budget=4,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    (constrained,) = llm.generate({"prompt_token_ids": prompts[0]}, schema)
    tokens = constrained.outputs[0].token_ids
    assert tokens[:4] == hf_greedy(reference, prompts[0], 4)  # the thoughts: unconstrained
    assert tokens[4:4 + len(end_ids)] == end_ids
    thoughts, answer = split_reasoning(constrained.outputs[0].text, ReasoningMarkers(), Phase.THINKING)
    assert thoughts == tokenizer.decode(tokens[:4]).strip()
    assert set(json.loads(answer)) == {"ok"} and constrained.outputs[0].finish_reason == "stop"
    llm.engine.check_invariants()


def test_a_prompt_that_closes_the_block_constrains_from_the_first_token(model_dir) -> None:
    """enable_thinking false: the template writes an empty block, the answer (and its grammar) starts at once,
    and a thinking budget changes nothing."""
    llm = LLM(str(model_dir), dtype="float32", chat_template=TEMPLATE)
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(QUESTION, variables={"enable_thinking": False})
    params = SamplingParams(temperature=0.0, max_tokens=60, thinking_token_budget=0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    (output,) = llm.generate(text, params)
    assert set(json.loads(output.outputs[0].text)) == {"ok"}


def test_a_reply_free_to_think_opens_before_its_grammar(think_token_dir) -> None:
    """Qwen3's hybrid layout with one-token markers: under a JSON schema the reply may still open its thoughts
    (the start marker allowed beside the grammar's tokens; here the model is pushed to it by logit_bias), thinks
    to its budget, and the grammar takes the answer after the end marker."""
    llm = LLM(str(think_token_dir), dtype="float32", chat_template=HYBRID_TEMPLATE, reasoning_parser="qwen3")
    tokens = llm.engine.reasoning_tokens
    assert len(tokens.start_ids) == 1 and len(tokens.end_ids) == 1
    (think,), (end,) = tokens.start_ids, tokens.end_ids
    params = SamplingParams(temperature=0.0, max_tokens=60, thinking_token_budget=3, logit_bias={think: 100.0},
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    (output,) = llm.chat([QUESTION], params)
    ids = output.outputs[0].token_ids
    assert ids[:5] == [think, think, think, think, end]  # opened, three thoughts (pushed), the forced end
    assert count_reasoning_tokens(ids, tokens, Phase.OPEN) == 5
    thoughts, answer = split_reasoning(output.outputs[0].text, ReasoningMarkers(), Phase.OPEN)
    assert thoughts == "<think><think><think>" and set(json.loads(answer)) == {"ok"}
    # without the push the model chooses; either way the answer (after any thoughts) holds to the grammar
    (plain,) = llm.chat([QUESTION], SamplingParams(temperature=0.0, max_tokens=60, thinking_token_budget=3,
                                                  structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    assert set(json.loads(split_reasoning(plain.outputs[0].text, ReasoningMarkers(), Phase.OPEN)[1])) == {"ok"}


def test_a_literal_marker_in_the_conversation_says_nothing_of_the_reply(model_dir) -> None:
    """A user's "<think>" is text of the conversation: the reply is read from what the generation prompt adds
    (here nothing), so a budget of 0 forces nothing into a reply that never opened its thoughts."""
    llm = LLM(str(model_dir), dtype="float32", chat_template=HYBRID_TEMPLATE, reasoning_parser="qwen3")
    end_ids = list(llm.engine.reasoning_tokens.end_ids)
    messages = [{"role": "user", "content": "What does a <think> tag do?"}]
    (output,) = llm.chat([messages], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                    thinking_token_budget=0))
    (free,) = llm.chat([messages], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert output.outputs[0].token_ids == free.outputs[0].token_ids
    assert output.outputs[0].token_ids[:len(end_ids)] != end_ids


def test_a_model_without_thoughts_refuses_a_thinking_budget(model_dir) -> None:
    llm = LLM(str(model_dir), dtype="float32")  # SmolLM2's template: no <think>
    assert llm.engine.reasoning_markers is None
    with pytest.raises(Exception, match="thinking_token_budget"):
        llm.generate("Hi", SamplingParams(max_tokens=2, thinking_token_budget=3))


def test_openai_client_reads_thoughts_apart_from_the_answer(model_dir) -> None:
    server = BackgroundServer(EngineConfig(model=ModelConfig(str(model_dir), dtype="float32", chat_template=TEMPLATE)))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        end_tokens = len(server.engine.reasoning_tokens.end_ids)
        body = {"thinking_token_budget": 5, "response_format": {
            "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}
        reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=80, temperature=0,
                                               extra_body=body)
        message = reply.choices[0].message
        thoughts = message.model_extra["reasoning_content"]
        assert thoughts and message.model_extra["reasoning"] == thoughts
        assert set(json.loads(message.content)) == {"ok"} and reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens_details.reasoning_tokens == 5 + end_tokens

        stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=80, temperature=0,
                                                extra_body=body, stream=True,
                                                stream_options={"include_usage": True})
        streamed_thoughts, streamed_content, usage = [], [], None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                delta = choice.delta.model_extra or {}
                streamed_thoughts.append(delta.get("reasoning_content") or "")
                streamed_content.append(choice.delta.content or "")
                assert "</think>" not in streamed_content[-1] and "</think>" not in streamed_thoughts[-1]
        assert "".join(streamed_thoughts) == thoughts and "".join(streamed_content) == message.content
        assert usage is not None and usage.completion_tokens_details.reasoning_tokens == 5 + end_tokens

        # the server's counter: the whole reply's thoughts and the streamed one's
        scraped = httpx.get(server.base_url + "/metrics").text
        counted = next(float(line.split()[-1]) for line in scraped.splitlines()
                       if line.startswith("kvserve:reasoning_tokens_total"))
        assert counted == 2 * (5 + end_tokens)

        hidden = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=80, temperature=0,
                                                extra_body={**body, "include_reasoning": False})
        assert "reasoning_content" not in (hidden.choices[0].message.model_extra or {})
        assert hidden.choices[0].message.content == message.content
        # nor are they in the logprobs, whole or streamed: the answer's tokens are
        shown = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=80, temperature=0,
                                               logprobs=True, extra_body=body).choices[0].logprobs.content
        answer = [entry.token for entry in shown[5 + end_tokens:]]
        hidden = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=80, temperature=0,
                                                logprobs=True, extra_body={**body, "include_reasoning": False})
        assert [entry.token for entry in hidden.choices[0].logprobs.content] == answer
        streamed_tokens = [entry.token for chunk in client.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=80, temperature=0, logprobs=True, stream=True,
            extra_body={**body, "include_reasoning": False}) for choice in chunk.choices
            for entry in (choice.logprobs.content if choice.logprobs else [])]
        assert streamed_tokens == answer

        # The thoughts of an earlier reply go back to the template as reasoning_content, under either name.
        turn = [*QUESTION, {"role": "assistant", "content": message.content, "reasoning": thoughts},
                {"role": "user", "content": "Why?"}]
        rendered = httpx.post(server.base_url + "/tokenize", json={"messages": turn}).json()
        tokenizer = server.engine.tokenizer
        assert rendered["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(
            [*QUESTION, {"role": "assistant", "content": message.content, "reasoning_content": thoughts},
             {"role": "user", "content": "Why?"}]), add_special_tokens=False)

        # A required tool call: its grammar also starts after the thoughts.
        tools = [{"type": "function", "function": {"name": "is_prime", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]
        called = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=80, temperature=0,
                                                tools=tools, tool_choice="required",
                                                extra_body={"thinking_token_budget": 5})
        assert called.choices[0].message.model_extra["reasoning_content"]  # the tools' prompt: other thoughts
        assert called.usage.completion_tokens_details.reasoning_tokens == 5 + end_tokens
        (call,) = called.choices[0].message.tool_calls
        assert call.function.name == "is_prime" and set(json.loads(call.function.arguments)) == {"n"}

        # The Responses API: the thoughts as a reasoning item before the answer's message, whole and streamed.
        response = client.responses.create(model=model, input="Is 7 a prime number?", max_output_tokens=80,
                                           temperature=0, text={"format": {"type": "json_schema", "name": "answer",
                                                                          "schema": SCHEMA}},
                                           extra_body={"thinking_token_budget": 5})
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == thoughts and response.output_text == message.content
        assert response.usage.output_tokens_details.reasoning_tokens == 5 + end_tokens
        events = list(client.responses.create(model=model, input="Is 7 a prime number?", max_output_tokens=80,
                                              temperature=0, stream=True, extra_body={"thinking_token_budget": 5},
                                              include=["message.output_text.logprobs"], top_logprobs=0,
                                              text={"format": {"type": "json_schema", "name": "answer",
                                                               "schema": SCHEMA}}))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thoughts
        final = events[-1].response
        assert [i.type for i in final.output] == ["reasoning", "message"]
        # the answer's logprobs are its own tokens', not the end marker's before them
        streamed = final.output[1].content[0].logprobs
        assert b"".join(bytes(entry.bytes) for entry in streamed) == message.content.encode()
        whole = client.responses.create(model=model, input="Is 7 a prime number?", max_output_tokens=80,
                                        temperature=0, extra_body={"thinking_token_budget": 5},
                                        include=["message.output_text.logprobs"], top_logprobs=0,
                                        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}})
        assert [entry.token for entry in whole.output[1].content[0].logprobs] == [entry.token for entry in streamed]
        # a reasoning item sent back goes to the template as its reply's reasoning_content
        follow_up = client.responses.create(model=model, max_output_tokens=4, temperature=0, input=[
            {"role": "user", "content": "Is 7 a prime number?"}, response.output[0].model_dump(exclude_none=True),
            {"role": "assistant", "content": message.content}, {"role": "user", "content": "Why?"}])
        assert follow_up.usage.input_tokens == len(tokenizer.encode(tokenizer.apply_chat_template(
            [*QUESTION, {"role": "assistant", "content": message.content, "reasoning_content": thoughts},
             {"role": "user", "content": "Why?"}]), add_special_tokens=False))

        with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4,
                                           extra_body={"thinking_token_budget": -1})
    finally:
        server.stop()


def test_server_wide_template_defaults_turn_thoughts_off_unless_a_request_turns_them_on(model_dir) -> None:
    """--default-chat-template-kwargs '{"enable_thinking": false}': replies begin with the answer (the template
    writes the empty block), unless a request's own chat_template_kwargs say otherwise."""
    server = BackgroundServer(EngineConfig(model=ModelConfig(str(model_dir), dtype="float32", chat_template=TEMPLATE)),
                              ServerConfig(port=0, default_chat_template_kwargs='{"enable_thinking": false}'))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert "reasoning_content" not in (answer.choices[0].message.model_extra or {})
        assert answer.usage.completion_tokens_details.reasoning_tokens == 0
        thinking = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0,
                                                  extra_body={"ignore_eos": True,
                                                              "chat_template_kwargs": {"enable_thinking": True}})
        assert thinking.choices[0].message.model_extra["reasoning_content"]
        assert thinking.usage.completion_tokens_details.reasoning_tokens == 6

        # A gateway keys requests on the prompt as this server renders it, its defaults included.
        description = httpx.get(server.base_url + "/kvserve/tokenizer").json()
        assert description["default_chat_template_kwargs"] == {"enable_thinking": False}
        keys = PromptTokens()
        keys.add(model, Tokenizer.from_description(description), template_defaults(description))
        for variables in ({}, {"chat_template_kwargs": {"enable_thinking": True}}):
            rendered = httpx.post(server.base_url + "/tokenize", json={"messages": QUESTION, **variables}).json()
            assert keys.of("/v1/chat/completions", {"model": model, "messages": QUESTION, **variables}) == tuple(
                rendered["tokens"])
    finally:
        server.stop()
    with pytest.raises(ConfigError, match="messages"):  # refused before any model loads
        ServerConfig(default_chat_template_kwargs='{"messages": []}')
    with pytest.raises(ConfigError, match="JSON object"):
        ServerConfig(default_chat_template_kwargs="[1]")

