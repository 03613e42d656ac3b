"""Completions with ``echo``: the prompt before the completion, and with logprobs the prompt's tokens' logprobs
first, as evaluation harnesses (lm-evaluation-harness's loglikelihood requests) read them through the official
client; and vLLM's ``prompt_logprobs`` field on completions and chat. The values are the engine's own prompt
logprobs."""

from __future__ import annotations

import openai
import pytest

from kvserve import LLM, SamplingParams
from tests.server.conftest import LLM_KWARGS

PROMPT = "The paged KV cache stores keys and values in blocks, so that"


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm() -> LLM:
    """An offline engine of the server's settings."""
    return LLM(**LLM_KWARGS)


@pytest.fixture(scope="module")
def offline(llm: LLM) -> tuple[list[int], list, list]:
    """The prompt's ids, prompt logprobs (top 2) and the prompt tokens' ranks offline."""
    output = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    return output.prompt_token_ids, output.prompt_logprobs, output.prompt_token_ranks


def test_an_echoed_prompts_logprobs_are_the_engines_as_a_harness_reads_them(client, offline) -> None:
    ids, expected, _ = offline
    answer = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2,
                                       echo=True)  # type: ignore[arg-type]
    choice = answer.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    logprobs = choice.logprobs
    assert logprobs is not None and len(logprobs.tokens) == len(ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(ids)):
        entry = expected[position]
        assert abs(logprobs.token_logprobs[position] - entry[ids[position]]) < 1e-4
        assert len(logprobs.top_logprobs[position]) == 2
    # What a harness sums for the prompt's likelihood given its first token.
    assert sum(logprobs.token_logprobs[1:len(ids)]) == pytest.approx(
        sum(expected[i][ids[i]] for i in range(1, len(ids))), abs=1e-3)
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)


def test_every_sample_of_a_prompt_shows_its_prompt_logprobs(client, offline) -> None:
    """The first sample computes them (expand_n: the others ask for none); every choice shows them."""
    ids, expected, _ = offline
    answer = client.completions.create(model=None, prompt=PROMPT, max_tokens=2, temperature=0.8, seed=3, n=3,
                                       logprobs=1, echo=True, extra_body={"prompt_logprobs": 2})  # type: ignore
    assert len(answer.choices) == 3
    first = answer.choices[0]
    for choice in answer.choices:
        assert choice.logprobs.token_logprobs[:len(ids)] == first.logprobs.token_logprobs[:len(ids)]
        assert choice.model_extra["prompt_logprobs"] == first.model_extra["prompt_logprobs"]
    assert first.logprobs.token_logprobs[1] == pytest.approx(expected[1][ids[1]], abs=1e-4)


def test_a_streamed_echo_sends_the_prompt_first_and_adds_up_to_the_whole(client, offline) -> None:
    ids, _, _ = offline
    whole = client.completions.create(model=None, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    chunks = [c for c in client.completions.create(model=None, prompt=PROMPT, max_tokens=6, temperature=0,
                                                   echo=True, logprobs=0, stream=True,
                                                   extra_body={"ignore_eos": True})  # type: ignore[arg-type]
              if c.choices]
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    first = chunks[0].choices[0].logprobs
    assert first is not None and len(first.tokens) >= len(ids) and first.token_logprobs[0] is None
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == len(ids) + 6
    plain = client.completions.create(model=None, prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    assert whole.choices[0].text == PROMPT + plain.choices[0].text


def test_echo_of_token_ids_and_several_prompts(client) -> None:
    answer = client.completions.create(model=None, prompt=[[504, 3458, 282], [40, 2]], max_tokens=2,
                                       temperature=0, echo=True, logprobs=1)  # type: ignore[arg-type]
    assert len(answer.choices) == 2
    for choice, ids in zip(sorted(answer.choices, key=lambda c: c.index), ([504, 3458, 282], [40, 2]), strict=True):
        assert choice.logprobs is not None and len(choice.logprobs.tokens) == len(ids) + 2
        assert choice.logprobs.token_logprobs[0] is None
        assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs[1:])


def test_a_loglikelihood_request_as_lm_evaluation_harness_sends_it(client, llm) -> None:
    """lm-evaluation-harness's completions loglikelihood: token-id prompts of context + continuation, echo,
    logprobs 1, max_tokens 1; it sums token_logprobs[ctxlen:-1] and calls the continuation greedy when each
    of those equals the largest of its top_logprobs. The model's own greedy continuation must be greedy."""
    context = [504, 3458, 282, 253, 1345]
    greedy = llm.generate({"prompt_token_ids": context},
                          SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0))[0].outputs[0]
    full = context + greedy.token_ids
    continuation_logprobs = [entry[token] for token, entry in zip(greedy.token_ids, greedy.logprobs, strict=True)]
    answer = client.completions.create(model=None, prompt=[full, context + [42, 43]], max_tokens=1, temperature=0,
                                       logprobs=1, echo=True).model_dump()  # type: ignore[arg-type]
    results = []
    for choice in sorted(answer["choices"], key=lambda c: c["index"]):
        logprobs = choice["logprobs"]
        scored = logprobs["token_logprobs"][len(context):-1]
        results.append((sum(scored), all(lp == max(top.values()) for lp, top in
                                         zip(scored, logprobs["top_logprobs"][len(context):-1], strict=True))))
    (likelihood, is_greedy), (_, other_is_greedy) = results
    assert is_greedy and not other_is_greedy
    assert likelihood == pytest.approx(sum(continuation_logprobs), abs=1e-3)


def test_prompt_logprobs_are_the_engines_with_ranks_as_vllm_renders_them(client, offline) -> None:
    ids, expected, ranks = offline
    answer = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})  # type: ignore[arg-type]
    choice = answer.choices[0]
    assert choice.logprobs is None and not choice.text.startswith(PROMPT)  # no echo: only the extension's field
    rendered = choice.model_extra["prompt_logprobs"]
    assert len(rendered) == len(ids) and rendered[0] is None and ranks[0] is None
    outside_top = 0
    for position in range(1, len(ids)):
        entry = {int(t): e for t, e in rendered[position].items()}
        mine = entry[ids[position]]
        assert abs(mine["logprob"] - expected[position][ids[position]]) < 1e-4 and mine["rank"] == ranks[position]
        top = sorted((e for t, e in entry.items() if t != ids[position] or e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in top] == [1, 2] and top[0]["logprob"] >= top[1]["logprob"]
        # The prompt's token is one of the two most likely, or ranked below them with a lower logprob.
        assert mine["rank"] <= 2 or (len(entry) == 3 and mine["logprob"] <= top[1]["logprob"])
        outside_top += mine["rank"] > 2
        assert all(e["decoded_token"] for e in entry.values())
    assert outside_top > 0  # the prompt has tokens the model did not expect: their ranks were computed
    # k = 0: the prompt's token alone at each position, with its rank.
    alone = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": 0})  # type: ignore[arg-type]
    for position, entry in enumerate(alone.choices[0].model_extra["prompt_logprobs"][1:], start=1):
        assert list(entry) == [str(ids[position])] and entry[str(ids[position])]["rank"] == ranks[position]


def test_a_chat_response_carries_its_prompts_logprobs_once(client, base_url) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    answer = client.chat.completions.create(model=None, messages=messages, max_tokens=2, temperature=0, n=2,  # type: ignore[arg-type]
                                            extra_body={"prompt_logprobs": 0})  # type: ignore[arg-type]
    rendered = answer.model_extra["prompt_logprobs"]
    tokenized = openai.OpenAI(base_url=base_url, api_key="unused").post(
        "/tokenize", body={"messages": messages}, cast_to=object)
    assert len(rendered) == tokenized["count"] and rendered[0] is None
    assert all(len(entry) == 1 and entry[str(token)]["logprob"] <= 0
               for entry, token in zip(rendered[1:], tokenized["tokens"][1:], strict=True))
    plain = client.chat.completions.create(model=None, messages=messages, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    assert "prompt_logprobs" not in (plain.model_extra or {})


@pytest.mark.parametrize("extra, param", [({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
                                          ({"prompt_logprobs": -1}, "prompt_logprobs"),
                                          ({"prompt_logprobs": 10**6}, "prompt_logprobs")])
def test_prompt_logprobs_that_cannot_be_served_are_a_400_naming_the_field(client, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=None, prompt=PROMPT, max_tokens=1, extra_body=extra)  # type: ignore[arg-type]
    assert info.value.body["param"] == param


def test_a_chat_reply_continues_a_prefilled_assistant_message_and_echo_puts_it_first(client, base_url) -> None:
    opening = "The colour of the sky on a clear day is"
    messages = [{"role": "user", "content": "What colour is the sky?"}, {"role": "assistant", "content": opening}]
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    reply = client.chat.completions.create(model=None, messages=messages, max_tokens=6, temperature=0,
                                           extra_body=continued)  # type: ignore[arg-type]
    tokenized = openai.OpenAI(base_url=base_url, api_key="unused").post(
        "/tokenize", body={"messages": messages, **continued}, cast_to=object)
    text = openai.OpenAI(base_url=base_url, api_key="unused").post(
        "/detokenize", body={"tokens": tokenized["tokens"]}, cast_to=object)["prompt"]
    assert text.endswith("<|im_start|>assistant\n" + opening) and reply.usage.prompt_tokens == tokenized["count"]
    # The same tokens as a completion of the open text.
    same = client.completions.create(model=None, prompt=tokenized["tokens"], max_tokens=6,
                                     temperature=0)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == same.choices[0].text
    echoed = client.chat.completions.create(model=None, messages=messages, max_tokens=6, temperature=0,
                                            extra_body={**continued, "echo": True})  # type: ignore[arg-type]
    assert echoed.choices[0].message.content == opening + reply.choices[0].message.content
    streamed = client.chat.completions.create(model=None, messages=messages, max_tokens=6, temperature=0,
                                              stream=True, extra_body={**continued, "echo": True})  # type: ignore
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == echoed.choices[0].message.content
    # With a generation prompt after a user message the reply is not of its role: echo adds nothing.
    question = client.chat.completions.create(model=None, messages=messages[:1], max_tokens=6, temperature=0)
    plain = client.chat.completions.create(model=None, messages=messages[:1], max_tokens=6, temperature=0,
                                           extra_body={"echo": True})  # type: ignore[arg-type]
    assert plain.choices[0].message.content == question.choices[0].message.content


def test_a_reply_without_a_generation_prompt_is_of_the_final_messages_role(client) -> None:
    question = [{"role": "user", "content": "What colour is the sky?"}]
    plain = client.chat.completions.create(model=None, messages=question, max_tokens=4, temperature=0)
    assert plain.choices[0].message.role == "assistant"
    without = {"add_generation_prompt": False}
    whole = client.chat.completions.create(model=None, messages=question, max_tokens=4, temperature=0,
                                           extra_body=without)  # type: ignore[arg-type]
    assert whole.choices[0].message.role == "user"
    streamed = list(client.chat.completions.create(model=None, messages=question, max_tokens=4, temperature=0,
                                                   stream=True, extra_body=without))  # type: ignore[arg-type]
    assert streamed[0].choices[0].delta.role == "user"
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content


def test_continuing_a_message_and_adding_a_generation_prompt_is_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt false") as info:
        client.chat.completions.create(model=None, messages=[{"role": "assistant", "content": "Hi"}], max_tokens=2,
                                       extra_body={"continue_final_message": True})  # type: ignore[arg-type]
    assert info.value.body["param"] == "continue_final_message"
