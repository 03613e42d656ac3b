"""Speculative decoding on the real model (float32, so that batch shape cannot move a greedy tie): sampled
and stopped outputs are exactly those of plain decoding."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.output_processor import OutputProcessor, ProcessedStep
from kvserve.request import StepUpdate
from tests.e2e.conftest import LONG_DOCUMENT

pytestmark = pytest.mark.slow
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}  # drafts every step: the timings-driven lengths could choose none
PROMPTS = [
    LONG_DOCUMENT + "\nRepeat the first section word for word:",
    "Count: one, two, three, four, five, six, seven, eight, nine, ten, one, two, three,",
    "The rain in Spain falls mainly on the plain. The rain in Spain",
]


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    def make(spec: dict | None) -> LLM:
        return LLM(dtype="float32", num_kv_blocks=512, max_num_batched_tokens=512, speculative_config=spec)
    return make(None), make(NGRAM)


@pytest.mark.heavy  # CI runs the same check on a tiny model: tests/runner/test_speculative.py
def test_seeded_sampling_draws_the_same_tokens(engines) -> None:
    plain, spec = engines
    params = [SamplingParams(temperature=0.7, top_p=0.95, seed=11 + i, max_tokens=40, ignore_eos=True)
              for i in range(len(PROMPTS))]
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    before = spec.engine.stats().num_accepted_draft_tokens
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == expected
    assert spec.engine.stats().num_accepted_draft_tokens > before


@pytest.mark.heavy  # CI checks a stop token inside accepted drafts on a tiny model (test_speculative_scheduling.py)
def test_stop_strings_end_the_output_where_plain_decoding_does(engines, monkeypatch) -> None:
    plain, spec = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    texts = [o.outputs[0].text for o in plain.generate(PROMPTS, greedy)]
    # Every word of the greedy outputs as a stop string: some end inside a step's accepted drafts.
    cases = [(prompt, word) for prompt, text in zip(PROMPTS, texts, strict=True)
             for word in dict.fromkeys(text.split()[2:5])]
    prompts = [prompt for prompt, _ in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[word]) for _, word in cases]
    truncations = []  # per cut at a stop string: whether the scheduler had decided an end (length) already
    original = OutputProcessor.process

    def spy(self: OutputProcessor, updates: list[StepUpdate]) -> ProcessedStep:
        step = original(self, updates)
        for before, after in zip(updates, step.updates, strict=True):
            if after.finish is not None and after.finish.num_tokens is not None:
                truncations.append(before.finish is not None)
        return step

    monkeypatch.setattr(OutputProcessor, "process", spy)
    want = plain.generate(prompts, params)
    # Again with max_tokens just past where the string stops plain decoding: a step whose accepted drafts
    # run into max_tokens after the string must still finish with "stop", as plain decoding does.
    longer = [SamplingParams(temperature=0.0, max_tokens=len(w.outputs[0].token_ids) + extra, ignore_eos=True,
                             stop=p.stop) for extra in (1, 2) for w, p in zip(want, params, strict=True)]
    want += plain.generate(prompts * 2, longer)
    prompts, params = prompts * 3, params + longer
    got = spec.generate(prompts, params)
    assert False in truncations, "no stop string ended inside a step's accepted drafts"
    assert True in truncations, "no step ran into max_tokens after a stop string"
    for g, w in zip(got, want, strict=True):
        assert (g.outputs[0].text, g.outputs[0].token_ids, g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (
            w.outputs[0].text, w.outputs[0].token_ids, w.outputs[0].finish_reason, w.outputs[0].stop_reason)
    assert spec.engine.kv_manager.pool.num_used == 0


def test_no_drafts_at_or_above_disable_by_batch_size() -> None:
    llm = LLM(dtype="float32", num_kv_blocks=256, speculative_config=NGRAM | {"disable_by_batch_size": 3})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    short = [*PROMPTS[1:], PROMPTS[2] + " The rain"]  # the short, repetitive prompts: drafts find matches
    llm.generate(short, params)  # three requests, all running until the end
    assert llm.engine.stats().num_draft_tokens == 0
    llm.generate(short[:2], params)  # two
    assert llm.engine.stats().num_accepted_draft_tokens > 0
