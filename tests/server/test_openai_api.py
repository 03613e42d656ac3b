"""The OpenAI API of a real server process, through the official ``openai`` client (sync and async)."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import numpy as np
import openai
import pytest

from tests.server.conftest import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPTS,
    QUESTIONS,
    chat,
    metric_value,
)

pytestmark = pytest.mark.slow

def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def async_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_sixteen_concurrent_requests_match_offline_generate(base_url, offline_texts) -> None:
    offline_chats, offline_completions = offline_texts

    async def run() -> tuple[list[str], list[str]]:
        async with async_client(base_url) as c:
            chat_calls = [c.chat.completions.create(model=None, messages=chat(q), max_tokens=MAX_TOKENS,
                                                    temperature=0) for q in QUESTIONS]
            completion_calls = [c.completions.create(model=None, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
                                for p in PROMPTS]
            results = await asyncio.gather(*chat_calls, *completion_calls)
        chats = [r.choices[0].message.content for r in results[: len(QUESTIONS)]]
        completions = [r.choices[0].text for r in results[len(QUESTIONS):]]
        return chats, completions

    chats, completions = asyncio.run(run())
    assert chats == offline_chats
    assert completions == offline_completions


def test_speculative_steps_stream_several_tokens_and_count_each(base_url) -> None:
    """The shared server speculates: on a repetitive prompt accepted drafts arrive several tokens to a chunk,
    and usage still counts every token, streamed or not."""
    c = client(base_url)
    prompt = "The rain in Spain falls mainly on the plain. " * 2 + "The rain in Spain"
    kwargs = dict(model=None, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    ngram = 'method="ngram"'
    accepted_before = metric_value(base_url, "kvserve:spec_decode_num_accepted_tokens_total", ngram)
    whole = c.completions.create(**kwargs)
    chunks = list(c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text_chunks = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in text_chunks) == whole.choices[0].text
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 40
    assert len(text_chunks) < 20, "accepted drafts should arrive several tokens to a chunk"
    accepted = metric_value(base_url, "kvserve:spec_decode_num_accepted_tokens_total", ngram)
    verified = metric_value(base_url, "kvserve:spec_decode_num_draft_tokens_total", ngram)
    assert accepted > accepted_before
    assert verified >= accepted
    assert metric_value(base_url, "kvserve:spec_decode_num_rejected_tokens_total", ngram) == verified - accepted
    assert metric_value(base_url, "kvserve:spec_decode_acceptance_rate", ngram) == pytest.approx(accepted / verified)
    steps = metric_value(base_url, "kvserve:spec_decode_num_drafts_total", ngram)
    assert metric_value(base_url, "kvserve:spec_decode_mean_accepted_length", ngram) == pytest.approx(accepted / steps)
    assert metric_value(base_url, "kvserve:spec_decode_num_proposed_tokens_total", ngram) >= verified
    # Every n-gram draft is prompt lookup's.
    assert metric_value(base_url, "kvserve:spec_decode_num_lookup_draft_tokens_total", ngram) == verified
    assert metric_value(base_url, "kvserve:spec_decode_num_lookup_accepted_tokens_total", ngram) == accepted


def test_chat_non_streaming_and_streaming_agree(base_url) -> None:
    c = client(base_url)
    messages = chat("Explain a KV cache in one sentence.")
    full = c.chat.completions.create(model=None, messages=messages, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = full.usage
    assert usage.completion_tokens <= 12 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens is not None

    chunks = list(c.chat.completions.create(model=None, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == choice.message.content
    finished = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finished == [choice.finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == usage.completion_tokens
    assert last.usage.prompt_tokens == usage.prompt_tokens
    assert last.usage.prompt_tokens_details.cached_tokens >= BLOCK_SIZE  # the same prompt was just served
    assert all(ch.usage is None for ch in chunks[:-1])
    # vLLM's continuous_usage_stats: every chunk carries the usage so far, the completion tokens growing to the
    # whole count.
    chunks = list(c.chat.completions.create(
        model=None, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == usage.completion_tokens and len(chunks) > 3
    assert {ch.usage.prompt_tokens for ch in chunks} == {usage.prompt_tokens}
    # Each choice's chunks count its own tokens (vLLM's); the last chunk, the request's whole usage.
    chunks = list(c.completions.create(
        model=None, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=2, seed=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True}))
    for index in (0, 1):
        own = [ch.usage.completion_tokens for ch in chunks if ch.choices and ch.choices[0].index == index]
        assert own == sorted(own) and own[-1] == 6
    assert chunks[-1].usage.completion_tokens == 12


def test_completions_async_streaming_and_token_id_prompts(base_url) -> None:
    async def run() -> None:
        async with async_client(base_url) as c:
            full = await c.completions.create(model=None, prompt="The capital of France is", max_tokens=6,
                                              temperature=0)
            assert full.object == "text_completion" and full.choices[0].text
            stream = await c.completions.create(model=None, prompt="The capital of France is", max_tokens=6,
                                                temperature=0, stream=True)
            text = "".join([chunk.choices[0].text async for chunk in stream])
            assert text == full.choices[0].text
            # Token ids, and a list of token-id lists: one choice per prompt.
            many = await c.completions.create(model=None, prompt=[[504, 3575, 282], [19556, 30]], max_tokens=3,
                                              temperature=0)
            assert [ch.index for ch in many.choices] == [0, 1]
            assert many.usage.prompt_tokens == 5 and many.usage.completion_tokens == 6

    asyncio.run(run())


def test_list_of_prompts_with_n_merges_choices(base_url) -> None:
    c = client(base_url)
    resp = c.completions.create(model=None, prompt=["Hello", "Goodbye"], n=2, max_tokens=3, temperature=0.8,
                                seed=7)
    assert sorted(ch.index for ch in resp.choices) == [0, 1, 2, 3]
    single = c.completions.create(model=None, prompt=["Hello", "Goodbye"], max_tokens=1)
    assert resp.usage.prompt_tokens == single.usage.prompt_tokens  # counted once per prompt, as OpenAI does
    assert 4 <= resp.usage.completion_tokens <= 12
    chat_resp = c.chat.completions.create(model=None, messages=chat("Pick a random animal."), n=3, max_tokens=3,
                                          temperature=1.0, seed=1)
    assert [ch.index for ch in chat_resp.choices] == [0, 1, 2]
    chunks = list(c.chat.completions.create(model=None, messages=chat("Pick a random animal."), n=3, max_tokens=3,
                                            temperature=1.0, seed=1, stream=True))
    streamed = {i: "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices[0].index == i)
                for i in range(3)}
    assert streamed == {ch.index: ch.message.content for ch in chat_resp.choices}  # seeded: reproducible


def test_cached_tokens_cold_then_warm(base_url) -> None:
    c = client(base_url)
    nonce = uuid.uuid4().hex
    document = f"Document {nonce}. " + " ".join(
        f"Paragraph {i}: a paged KV cache keeps keys and values in blocks of sixteen tokens." for i in range(20)
    )
    # A prompt that ends inside a block whatever the nonce's tokens (the check below is of that case).
    if (len(httpx.post(f"{base_url}/tokenize", json={"prompt": document}, timeout=60).json()["tokens"]) - 1) \
            % BLOCK_SIZE == 0:
        document += " More."
    cold = c.completions.create(model=None, prompt=document, max_tokens=1, temperature=0)
    assert cold.usage.prompt_tokens > 300
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = c.completions.create(model=None, prompt=document, max_tokens=1, temperature=0)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    # Every prompt token but the last, which is computed for its logits: the full blocks, then the first
    # tokens of the partly filled block the cold request left (not a multiple of the block size).
    assert (warm.usage.prompt_tokens - 1) % BLOCK_SIZE != 0
    assert cached == warm.usage.prompt_tokens - 1
    assert warm.choices[0].text == cold.choices[0].text


def test_stop_strings_logprobs_and_extensions(base_url) -> None:
    c = client(base_url)
    full = c.completions.create(model=None, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    assert " 6," in full.choices[0].text
    stopped = c.completions.create(model=None, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 6"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full.choices[0].text.split(" 6")[0]
    # vLLM's stop_reason: the string or id that ended it; null for EOS and length, and on chunks before the last.
    assert stopped.choices[0].model_extra["stop_reason"] == " 6" and full.choices[0].model_extra["stop_reason"] is None
    streamed_stop = [chunk.choices[0] for chunk in c.completions.create(
        model=None, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 6"], stream=True) if chunk.choices]
    assert [choice.model_extra["stop_reason"] for choice in streamed_stop] == [None] * (len(streamed_stop) - 1) + [" 6"]

    lp = c.completions.create(model=None, prompt="1, 2, 3, 4,", max_tokens=3, temperature=0, logprobs=2)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == 3 and "".join(logprobs.tokens) == lp.choices[0].text
    assert all(x <= 0 for x in logprobs.token_logprobs)
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    # Streamed, the offsets are the whole answer's, also where text is held back for a possible stop string.
    body = {"prompt": "1, 2, 3, 4,", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    whole = c.completions.create(model=None, **body)
    streamed = c.completions.create(model=None, stream=True, stop=[" 6, 7, 8, 9"], **body)  # " 6" waits
    offsets = [o for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
               for o in chunk.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset

    resp = c.chat.completions.create(model=None, messages=chat("Hi"), max_tokens=3, temperature=0, logprobs=True,
                                     top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 3
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob for t in content)

    # A stop string that ends on the last allowed token: "stop", not "length" (as vLLM).
    ends_at_6 = c.completions.create(model=None, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0)
    assert ends_at_6.choices[0].text.endswith(" 6,") and ends_at_6.choices[0].finish_reason == "length"
    last = c.completions.create(model=None, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0, stop=[" 6,"])
    assert (last.choices[0].finish_reason, last.choices[0].text) == ("stop", ends_at_6.choices[0].text[:-3])

    # min_tokens holds stop strings back too (as in vLLM), not only EOS and stop token ids.
    held = c.completions.create(model=None, prompt="The cat sat on the mat and the dog", max_tokens=40,
                                temperature=0, stop=[" the"], extra_body={"min_tokens": 20})
    assert held.usage.completion_tokens >= 20 and held.choices[0].finish_reason in ("stop", "length")

    # Logprob bytes are each token's own, also for tokens that are a piece of an emoji (alone they decode
    # to U+FFFD): together they are the text's UTF-8.
    resp = c.chat.completions.create(model=None, messages=chat("Write three sun emojis: 🌞🌞🌞"), max_tokens=9,
                                     temperature=0, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert "🌞" in resp.choices[0].message.content and any("\ufffd" in t.token for t in content)
    assert b"".join(bytes(t.bytes) for t in content) == resp.choices[0].message.content.encode("utf-8")

    # logit_bias (OpenAI's: token id strings to [-100, 100]). In SmolLM2's vocabulary 17 is "!" and digits
    # are single tokens, 37 being "5": +100 makes greedy pick "!" every time; -100 keeps "5" out of a
    # continuation that has it without the bias.
    forced = c.completions.create(model=None, prompt="1, 2, 3, 4,", max_tokens=4, temperature=0,
                                  logit_bias={"17": 100})
    assert forced.choices[0].text == "!!!!"
    assert "5" in full.choices[0].text
    banned = c.completions.create(model=None, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                  logit_bias={"37": -100})
    assert "5" not in banned.choices[0].text and banned.choices[0].text != full.choices[0].text
    # response_format "text" is the plain output: accepted (JSON modes are refused, test_failures.py).
    plain = c.chat.completions.create(model=None, messages=chat("Hi"), max_tokens=3, temperature=0,
                                      response_format={"type": "text"})
    assert plain.choices[0].finish_reason in ("stop", "length")

    # ignore_eos + min_tokens (extensions, sent as extra body fields) and an unknown field (ignored).
    resp = c.chat.completions.create(model=None, messages=chat("Say OK."), max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True, "min_tokens": 8, "repetition_penalty": 1.1,
                                                 "no_such_field": 1})
    assert resp.usage.completion_tokens == 8 and resp.choices[0].finish_reason == "length"


def test_allowed_tokens_bad_words_truncation_and_cache_salt(base_url) -> None:
    """vLLM's request extensions, through the shared server (which drafts n-grams: refused drafts are rejected
    as any other). In SmolLM2's vocabulary 17 is "!", 37 "5" and 216 a space."""
    c = client(base_url)
    full = c.completions.create(model=None, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    assert full.startswith(" 5, 6, 7")
    only = c.completions.create(model=None, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                extra_body={"allowed_token_ids": [17, 37]})
    assert only.usage.completion_tokens == 12 and set(only.choices[0].text) <= {"!", "5"}
    sampled = c.completions.create(model=None, prompt="1, 2, 3, 4,", max_tokens=12, temperature=1.0, n=4, seed=3,
                                   extra_body={"allowed_token_ids": [17, 37, 216], "ignore_eos": True})
    assert all(set(choice.text) <= {"!", "5", " "} for choice in sampled.choices)
    no_five = c.completions.create(model=None, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                   extra_body={"bad_words": ["5"]}).choices[0].text
    assert "5" not in no_five and no_five != full
    # A word of several tokens: only its last is refused, and only after the others.
    no_five_six = c.completions.create(model=None, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                       extra_body={"bad_words": ["5, 6"]}).choices[0].text
    assert no_five_six.startswith(" 5, ") and "5, 6" not in no_five_six

    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = httpx.post(f"{base_url}/tokenize", json={"prompt": prompt}, timeout=60).json()["tokens"]
    cut = c.completions.create(model=None, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                               extra_body={"truncate_prompt_tokens": 4})
    direct = c.completions.create(model=None, prompt=ids[-4:], max_tokens=5, temperature=0, echo=True)
    assert cut.usage.prompt_tokens == 4 and len(ids) > 4
    assert cut.choices[0].text == direct.choices[0].text  # the echo is the prompt the model saw
    chat_cut = c.chat.completions.create(model=None, messages=chat(prompt), max_tokens=2, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 6})
    assert chat_cut.usage.prompt_tokens == 6

    # A salt's requests share cached KV with each other only.
    document = f"Notes {uuid.uuid4().hex}. " + " ".join(f"Item {i}: keys and values in blocks." for i in range(12))

    def cached(salt: str | None) -> tuple[int, int, str]:
        resp = c.completions.create(model=None, prompt=document, max_tokens=4, temperature=0,
                                    extra_body={} if salt is None else {"cache_salt": salt})
        return resp.usage.prompt_tokens_details.cached_tokens, resp.usage.prompt_tokens, resp.choices[0].text

    first = cached("tenant-a")
    again, other, unsalted, unsalted_again = cached("tenant-a"), cached("tenant-b"), cached(None), cached(None)
    assert first[0] == other[0] == unsalted[0] == 0
    # All but the last token, or the full blocks only where the first request's output filled the block its
    # prompt ended in (the document's length varies with its random name).
    full_blocks = (first[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again[0] == unsalted_again[0] in (first[1] - 1, full_blocks) and again[0] > 100
    assert len({first[2], again[2], other[2], unsalted[2], unsalted_again[2]}) == 1

    # return_tokens_as_token_ids: logprob entries name their tokens by id; the offsets stay the text's.
    body = {"prompt": "Write three sun emojis: 🌞🌞🌞", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    as_text = c.completions.create(model=None, **body).choices[0]
    as_ids = c.completions.create(model=None, **body, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    ids = [int(token.removeprefix("token_id:")) for token in as_ids.logprobs.tokens]
    assert all(token.startswith("token_id:") for token in as_ids.logprobs.tokens)
    assert httpx.post(f"{base_url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"] == as_text.text
    assert as_ids.logprobs.text_offset == as_text.logprobs.text_offset
    streamed = c.completions.create(model=None, **body, stream=True, extra_body={"return_tokens_as_token_ids": True})
    assert [o for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
            for o in chunk.choices[0].logprobs.text_offset] == as_text.logprobs.text_offset
    assert all(len(top) == 2 and all(key.startswith("token_id:") for key in top)
               for top in as_ids.logprobs.top_logprobs)
    chat_ids = c.chat.completions.create(model=None, messages=chat("Hi"), max_tokens=3, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    assert all(t.token.startswith("token_id:") and all(top.token.startswith("token_id:") for top in t.top_logprobs)
               for t in chat_ids.choices[0].logprobs.content)


def test_default_max_tokens_16_for_completions_and_the_rest_of_the_context_for_chat(base_url) -> None:
    """OpenAI's and vLLM's defaults: 16 tokens for a completion without max_tokens; with an explicit null, and for
    chat, only the context limit stops a request that ignores EOS (a prompt near the limit keeps it short)."""
    resp = httpx.post(f"{base_url}/v1/completions", json={"prompt": "Once upon a time", "ignore_eos": True,
                                                          "temperature": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 16
    prompt_ids = [504] * (MAX_MODEL_LEN - 5)
    resp = httpx.post(f"{base_url}/v1/completions", json={"prompt": prompt_ids, "ignore_eos": True, "max_tokens": None,
                                                          "temperature": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"
    words = " ".join(["word"] * (MAX_MODEL_LEN - 80))
    resp = httpx.post(f"{base_url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": words}], "ignore_eos": True, "temperature": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN and usage["completion_tokens"] > 16


def test_timings_body_flag_and_header(base_url) -> None:
    body = {"messages": chat("Count to three."), "max_tokens": 4, "temperature": 0, "return_timings": True}
    resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    t = resp.json()["timings"]
    assert t["queued_ms"] >= 0 and t["prefill"]["ms"] > 0
    assert t["first_token_ms"] == pytest.approx(t["queued_ms"] + t["prefill"]["ms"], abs=0.01)
    assert t["finished_ms"] >= t["first_token_ms"]
    assert t["decode"]["steps"] == resp.json()["usage"]["completion_tokens"] - 1
    assert t["prefill"]["tokens_computed"] + t["cache_lookup"]["cached_tokens"] == resp.json()["usage"]["prompt_tokens"]
    assert t["preemptions"] == 0 and t["prefill"]["chunks"] == 1
    assert "timings" not in httpx.post(f"{base_url}/v1/chat/completions", json={**body, "return_timings": False},
                                       timeout=60).json()

    stream_body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=stream_body, headers={"X-KVServe-Timings": "1"},
                      timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [httpx.Response(200, content=e).json() for e in events[:-1]]
    assert "timings" in chunks[-1] and all("timings" not in ch for ch in chunks[:-1])
    assert chunks[-1]["timings"]["decode"]["steps"] == 2


def test_models_health_and_metrics(base_url) -> None:
    c = client(base_url)
    models = c.models.list().data
    assert len(models) == 1 and models[0].id
    assert c.models.retrieve(models[0].id) == models[0]  # OpenAI's route for one model's card
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")
    # The served name is accepted; so is no name at all.
    resp = c.completions.create(model=models[0].id, prompt="Hi", max_tokens=1)
    assert resp.model == models[0].id
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{base_url}/metrics").text
    for name in ("kvserve:time_to_first_token_seconds_bucket", "kvserve:time_per_output_token_seconds_bucket",
                 "kvserve:inter_token_latency_seconds_bucket", "kvserve:e2e_request_latency_seconds_bucket",
                 "kvserve:request_queue_time_seconds_bucket", "kvserve:prompt_tokens_total",
                 "kvserve:prompt_tokens_cached_total", "kvserve:generation_tokens_total",
                 "kvserve:reasoning_tokens_total", "kvserve:prefix_cache_queries_total", "kvserve:prefix_cache_hits_total",
                 "kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_blocks_used",
                 "kvserve:kv_blocks_cached", "kvserve:kv_blocks_free", "kvserve:num_preemptions_total",
                 'kvserve:request_success_total{finished_reason="length"}'):
        assert name in text, name
    assert metric_value(base_url, "kvserve:prompt_tokens_total") > 0
    assert metric_value(base_url, "kvserve:prefix_cache_hits_total") > 0
    assert metric_value(base_url, "kvserve:engine_alive") == 1


def test_embeddings_are_the_last_tokens_hidden_state(base_url) -> None:
    """/v1/embeddings: one unit vector of the hidden size per input, the same for a text and its token ids,
    whether sent alone or in a batch; a generation on the same prompt afterwards finds its KV cached."""
    c = client(base_url)
    model = c.models.list().data[0].id
    text = "def fibonacci(n):\n    \"\"\"The n-th Fibonacci number, computed by a loop.\"\"\"\n"
    one = c.embeddings.create(model=model, input=text)
    vector = np.array(one.data[0].embedding)
    assert vector.shape == (576,) and abs(np.linalg.norm(vector) - 1.0) < 1e-5
    answer = c.completions.create(model=model, prompt=text, max_tokens=2)
    assert one.usage.prompt_tokens == answer.usage.prompt_tokens
    assert answer.usage.prompt_tokens_details.cached_tokens > 0
    batch = c.embeddings.create(model=model, input=["A different sentence about cats.", text])
    assert [d.index for d in batch.data] == [0, 1]
    assert np.allclose(batch.data[1].embedding, vector, atol=1e-4)
    assert not np.allclose(batch.data[0].embedding, vector, atol=1e-2)
    as_floats = httpx.post(f"{base_url}/v1/embeddings", json={"model": model, "input": text,
                                                                "encoding_format": "float"}).json()
    assert np.allclose(as_floats["data"][0]["embedding"], vector, atol=1e-6)  # the client asked for base64
    ids = [28, 1106, 314, 253, 3500, 30]  # token ids, alone and as a list of one (what a gateway sends)
    flat, nested = (c.embeddings.create(model=model, input=x).data for x in (ids, [ids]))
    assert len(flat) == len(nested) == 1 and np.allclose(flat[0].embedding, nested[0].embedding, atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        c.embeddings.create(model=model, input=text, dimensions=8)
    with pytest.raises(openai.BadRequestError, match="input"):
        c.embeddings.create(model=model, input=[])
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="no-such-model", input=text)


@pytest.mark.parametrize("prompt, extra, param, message", [
    ("def f(x):\n", {"suffix": "\nprint(f(2))\n"}, "suffix", "no fill-in-the-middle tokens"),
    ("def f(x):\n", {"suffix": "x", "echo": True}, "echo", "cannot be used together"),
    ([504, 3458], {"suffix": "x"}, "suffix", "takes a text prompt"),
])
def test_a_suffix_the_model_cannot_fill_is_a_400_naming_the_field(base_url, prompt, extra, param, message) -> None:
    with pytest.raises(openai.BadRequestError, match=message) as info:
        client(base_url).completions.create(model=None, prompt=prompt, max_tokens=4,
                                            extra_body=extra)  # type: ignore[arg-type]
    assert info.value.body["param"] == param
