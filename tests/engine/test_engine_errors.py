"""Bad input gets a clear typed error and leaves nothing behind."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import (
    ContextLengthExceeded,
    EmptyPrompt,
    InvalidRequest,
    InvalidSamplingParams,
    ModelLoadError,
    ModelNotFound,
)
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)


def assert_clean(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_manager.pool.num_used == 0
    llm.engine.check_invariants()


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(EmptyPrompt):
        llm.generate("")
    with pytest.raises(EmptyPrompt):
        llm.generate({"prompt_token_ids": []})
    assert_clean(llm)


def test_over_long_prompt_is_refused_at_add_request(llm: LLM) -> None:
    with pytest.raises(ContextLengthExceeded, match="256"):
        llm.generate({"prompt_token_ids": [1] * 300})
    with pytest.raises(ContextLengthExceeded) as info:
        llm.generate({"prompt_token_ids": [1] * 200}, SamplingParams(max_tokens=100))
    assert info.value.param == "max_tokens"
    assert_clean(llm)


def test_one_bad_prompt_in_a_batch_adds_nothing(llm: LLM) -> None:
    with pytest.raises(ContextLengthExceeded):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1] * 300}])
    assert_clean(llm)


def test_token_ids_outside_the_vocabulary(llm: LLM) -> None:
    with pytest.raises(InvalidRequest, match="token ids"):
        llm.generate({"prompt_token_ids": [1, 10**9]})
    with pytest.raises(InvalidRequest):
        llm.generate({"prompt_token_ids": [1, -5]})
    with pytest.raises(InvalidSamplingParams, match="vocabulary") as info:
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(logit_bias={10**9: 1.0}))
    assert info.value.param == "logit_bias"
    assert_clean(llm)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 50}, "prompt_logprobs"),
        ({"n": 0}, "n"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_bad_sampling_parameters_name_the_parameter(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)


def test_unknown_model_path() -> None:
    with pytest.raises(ModelNotFound, match="/no/such/model"):
        LLM("/no/such/model")


def test_a_context_past_the_models_is_refused_before_the_weights_load(monkeypatch) -> None:
    from kvserve import engine

    def no_loading(*args, **kwargs):
        raise AssertionError("the weights began to load")

    monkeypatch.setattr(engine.Engine, "_load_model", no_loading)
    with pytest.raises(InvalidRequest, match="max_model_len 999999 exceeds the model's context length 8192"):
        LLM(max_model_len=999999)


def test_truncated_gguf(tmp_path) -> None:
    from kvserve.model.loader import resolve_model_path

    source = resolve_model_path(None).read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(source[: len(source) // 3])
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        LLM(str(broken))


def test_n_samples_with_seeds(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    (output,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # seeds 7, 8, 9 differ
    again = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]
    assert_clean(llm)


def test_stop_string_on_the_last_allowed_token_finishes_with_stop(llm: LLM) -> None:
    """The string completes on the token that also reaches max_tokens: "stop" wins over "length" (as vLLM)."""
    prompt = {"prompt_token_ids": [11, 12, 13]}
    ids = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0].token_ids
    tok = llm.get_tokenizer()
    for k in range(1, len(ids)):
        text, before = tok.decode(ids[:k]), tok.decode(ids[: k - 1])
        stop = text[max(0, len(before) - 1):]  # completed only by token k
        if len(text) > len(before) and stop.strip() and text.find(stop) == len(text) - len(stop):
            break
    else:
        pytest.fail("no token ends a usable stop string")
    params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True, stop=[stop])
    completion = llm.generate(prompt, params)[0].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.text == text[: len(text) - len(stop)]
    assert_clean(llm)


def test_stop_strings_wait_for_min_tokens(llm: LLM) -> None:
    """As in vLLM, a stop string ends the output only past min_tokens, where a stop token may end it too (the
    tiny model repeats one word: the sixth copy is the first that may stop it)."""
    prompt = {"prompt_token_ids": [11, 12, 13]}
    word = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0].outputs[0].text
    assert word.strip() and word.count(word.strip()) == 1
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[word], min_tokens=5)
    completion = llm.generate(prompt, params)[0].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", word)
    assert len(completion.token_ids) == 6 and completion.text == word * 5
    assert_clean(llm)


def test_an_abort_sends_text_held_back_for_a_stop_string(llm: LLM) -> None:
    """The tiny model repeats one word; with that word plus more as a stop string, each copy is held back
    as a possible start of it. Aborted, the request sends what it held: the deltas add up to its text."""
    prompt = {"prompt_token_ids": [11, 12, 13]}
    word = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0].outputs[0].text
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[word + "!?"]),
                       request_id="held")
    deltas = [o.delta_text for _ in range(4) for o in engine.step() if o.request_id == "held"]
    aborted = engine.abort_request("held")
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].text.endswith(word) and aborted.delta_text.endswith(word)
    assert "".join(deltas) + aborted.delta_text == aborted.outputs[0].text
    assert_clean(llm)


def test_stop_string_trims_text_and_finishes(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate({"prompt_token_ids": [11, 12, 13]}, greedy)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "generated text too short to pick a stop string from"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    completion = llm.generate({"prompt_token_ids": [11, 12, 13]}, params)[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full[: full.index(stop)]
    assert_clean(llm)


def test_the_stop_token_that_ends_the_output_is_in_its_ids_but_not_its_text(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate({"prompt_token_ids": [11, 12, 13]}, greedy)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    stop_id = full.token_ids[0]
    at = 0
    assert tokenizer.decode([stop_id]).strip(), "a stop token without text proves nothing here"
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id],
                                include_stop_str_in_output=include)
        completion = llm.generate({"prompt_token_ids": [11, 12, 13]}, params)[0].outputs[0]
        assert completion.token_ids == full.token_ids[: at + 1] and completion.stop_reason == stop_id
        assert completion.text == tokenizer.decode(full.token_ids[: at + 1 if include else at])
    assert_clean(llm)
