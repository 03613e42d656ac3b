"""Speculative decoding with a draft model on tiny random models: greedy output equals transformers' plain
greedy decoding of the target token for token, batched, chunked, preempted and on prefix-cache hits; seeded
sampling draws what it draws without speculation, unseeded sampled drafts pass rejection sampling; a draft that cannot draft for
the target is refused at start-up, naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError
from kvserve.model.quantized import QuantizedWeight, type_name
from kvserve.model_store.token_map import TokenMap, vocabulary_digest
from kvserve.runner.draft_model import DraftModelProposer
from kvserve.runner.sampler import SamplingState
from tests.e2e.conftest import hf_greedy
from tests.support.tiny_models import gguf_from_tiny_model, make_tiny_model, smollm2_tokenizer

PROMPTS = [[5, 17, 230, 4000, 12], list(range(100, 161)), [9] * 23, list(range(3000, 3200, 3))]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft-models")
    return {
        "target": make_tiny_model(root, "qwen2", tie=False),
        # Another model, smaller: one layer, other weights. It proposes what it proposes; verification decides.
        "draft": make_tiny_model(root, "qwen2", tie=False, seed=5, num_hidden_layers=1),
    }


@pytest.fixture(scope="module")
def reference(models) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def speculating(models: dict[str, Path], draft: str, **options) -> LLM:
    options.setdefault("block_size", 4)
    options.setdefault("num_kv_blocks", 128)
    config = {"method": "draft_model", "model": str(models[draft]), "num_speculative_tokens": 3}
    config.update(options.pop("speculative", {}))
    return LLM(str(models["target"]), dtype="float32", speculative_config=config, **options)


def greedy_ids(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def drain(llm: LLM) -> None:
    """One more step hands the runner the finished requests: the draft releases their KV."""
    llm.engine.step()
    assert llm.engine.draft_kv is not None and llm.engine.draft_kv.num_requests == 0
    llm.engine.draft_kv.check_invariants()
    llm.engine.check_invariants()


@pytest.mark.parametrize("draft", ["draft", "target"], ids=["smaller-draft", "target-as-its-own-draft"])
@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed"])
def test_batched_and_chunked_greedy_equals_transformers(models, reference, draft: str, adaptive: bool) -> None:
    # A token budget of 24 splits the prompts into chunks and mixes them with decodes and their drafts.
    llm = speculating(models, draft, max_num_batched_tokens=24, speculative={"adaptive": adaptive})
    assert greedy_ids(llm) == reference
    stats = llm.engine.stats()
    assert stats.spec_method == "draft_model"
    if not adaptive:  # the adaptive lengths follow measured timings: they may choose no drafts at all
        assert stats.num_draft_tokens > 0
    if draft == "target":  # the target drafting for itself: every draft is accepted
        assert stats.num_accepted_draft_tokens == stats.num_draft_tokens
    drain(llm)


def test_preempted_requests_catch_up_in_the_draft(models, reference) -> None:
    # 24 blocks of 4 cannot hold the four requests at their full length at once.
    llm = speculating(models, "target", num_kv_blocks=24, speculative={"adaptive": False})
    assert greedy_ids(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().num_accepted_draft_tokens > 0
    drain(llm)


def test_prefix_cache_hits_in_target_and_draft(models) -> None:
    import transformers

    shared = list(range(500, 541))
    prompts = [shared + [7 + i, 900 + i] for i in range(3)]
    model = transformers.AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    llm = speculating(models, "draft", speculative={"adaptive": False})  # drafts every step, however few accepted
    assert greedy_ids(llm, prompts[:1]) == expected[:1]  # caches the shared blocks in both models
    drain(llm)
    assert greedy_ids(llm, prompts) == expected
    assert llm.engine.stats().prefix_cache_hits >= 2 * 40
    assert llm.engine.draft_kv is not None and llm.engine.draft_kv.num_cached_tokens >= 2 * 40
    drain(llm)


def test_a_new_requests_onboarding_is_what_the_drafts_prefix_cache_lacks(models) -> None:
    shared = list(range(500, 541))  # ten full blocks of 4 and one token
    llm = speculating(models, "draft")
    proposer = llm.engine.runner.proposer
    assert isinstance(proposer, DraftModelProposer)
    new = SamplingState(SamplingParams(max_tokens=4), [*shared, 7, 900], [])
    assert proposer.onboarding_tokens("first", new) == 43  # nothing cached in the draft yet
    proposer.kv.prepare("other", [*shared, 8, 901], num_ahead=1)
    proposer.kv.computed("other", [])  # the shared blocks enter the draft's prefix cache
    assert proposer.onboarding_tokens("second", new) == 3  # its own two tokens and the shared prefix's last
    assert proposer.onboarding_tokens("other", new) == 0  # held: its catch-up is a decode row, not a prefill


def recording_drafts(llm: LLM) -> list[int]:
    """Every draft token the engine's draft model proposes from now on."""
    proposer = llm.engine.runner.proposer
    assert isinstance(proposer, DraftModelProposer)
    proposed: list[int] = []
    propose = proposer.propose

    def recording(requests):
        drafts = propose(requests)
        proposed.extend(token for request_drafts in drafts for token in request_drafts)
        return drafts

    proposer.propose = recording  # type: ignore[method-assign]
    return proposed


def check_pruned_drafts(llm: LLM, reference: list[list[int]], kept: set[int]) -> None:
    """Greedy output unchanged; every draft among ``kept`` or its request's prompt ids; and, the target being
    its own draft, drafts accepted only where the target's token is one the pruned draft can propose."""
    proposed = recording_drafts(llm)
    assert greedy_ids(llm) == reference
    prompt_ids = {i for p in PROMPTS for i in p}
    assert proposed and set(proposed) <= kept | prompt_ids
    assert set(proposed) & (prompt_ids - kept)  # the prompts' own ids were proposed too
    stats = llm.engine.stats()
    # A row may propose the prompt ids of any request it is drafted beside.
    expected_agreement = sum(token in kept | prompt_ids for ids in reference for token in ids)
    assert 0 < stats.num_accepted_draft_tokens <= expected_agreement < stats.num_draft_tokens
    drain(llm)
    proposer = llm.engine.runner.proposer
    assert isinstance(proposer, DraftModelProposer) and proposer.vocabulary.num_admitted == 0  # released
    # Sampled drafts (penalties over prompt ids past the pruned vocabulary): q is zero there, p is not.
    params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    assert set(proposed) <= kept | prompt_ids
    drain(llm)
    assert proposer.vocabulary.num_admitted == 0


def test_a_pruned_draft_vocabulary_proposes_only_its_ids_and_the_prompts_and_changes_no_token(models,
                                                                                               reference) -> None:
    """The target as its own draft, pruned to the ids below 2,048 (the prompts hold higher ones, which the
    draft proposes for their requests)."""
    llm = speculating(models, "target", speculative={"adaptive": False, "draft_vocab_size": 2048})
    check_pruned_drafts(llm, reference, set(range(2048)))


def test_a_token_maps_leading_ids_are_what_the_draft_proposes_from(models, reference, tmp_path) -> None:
    """A token map (ids ranked by a corpus's counts: here half the reference's tokens first): the draft
    proposes among its leading ids, the special tokens and each request's prompt ids."""
    tokenizer = smollm2_tokenizer()
    ranked = list(dict.fromkeys(t for ids in reference[::2] for t in ids)) + list(range(40000, 41000))
    path = tmp_path / "map.json"
    TokenMap(vocabulary_digest(tokenizer), tuple(ranked), len(ranked)).write(path)
    size = len(ranked) - 1000 + 40
    llm = speculating(models, "target", speculative={"adaptive": False, "draft_token_map": str(path),
                                                      "draft_vocab_size": size})
    proposer = llm.engine.runner.proposer
    assert isinstance(proposer, DraftModelProposer) and proposer.vocabulary.kept is not None
    kept = set(proposer.vocabulary.kept.tolist())
    assert set(ranked[:size]) | set(tokenizer.all_special_ids) <= kept and len(kept) % 16 == 0
    assert len(kept) < size + len(tokenizer.all_special_ids) + 16
    check_pruned_drafts(llm, reference, kept)


@pytest.mark.parametrize("pruning", ["leading", "token-map"])
def test_a_pruned_vocabularys_logits_are_the_whole_heads_at_its_ids(models, tmp_path, pruning: str) -> None:
    """The pruned draft's logits, laid back over the vocabulary, are the unpruned output projection's at the
    kept ids and the drafted requests' prompt ids, and -inf everywhere else: each column is its id's."""
    tokenizer = smollm2_tokenizer()
    spec: dict[str, object] = {"draft_vocab_size": 1000}
    if pruning == "token-map":
        path = tmp_path / "map.json"
        ranked = list(range(49151, 40000, -7))  # not the leading ids: the rows are gathered
        TokenMap(vocabulary_digest(tokenizer), tuple(ranked), len(ranked)).write(path)
        spec["draft_token_map"] = str(path)
    llm = speculating(models, "draft", speculative=spec)
    proposer = llm.engine.runner.proposer
    assert isinstance(proposer, DraftModelProposer)
    vocabulary = proposer.vocabulary
    assert vocabulary.kept is not None
    kept = set(vocabulary.kept.tolist())
    vocabulary.admit("a", [5, 3001, 3002, 48000])
    vocabulary.admit("b", [3002, 3005, 48000])
    hidden = torch.randn(3, vocabulary.model.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = vocabulary.model.compute_logits(hidden)[:, : vocabulary.vocab_size]
    for requests, prompts in [(["a", "b"], {5, 3001, 3002, 3005, 48000}), (["b"], {3002, 3005, 48000}), ([], set())]:
        logits, ids = vocabulary.logits(hidden, requests)
        assert ids is not None and len(set(ids.tolist())) == len(ids)  # one column per id
        full = vocabulary.full(logits, ids)
        allowed = torch.tensor(sorted(kept | prompts))
        assert set(ids.tolist()) == set(allowed.tolist())
        torch.testing.assert_close(full[:, allowed], whole[:, allowed])
        others = torch.ones(vocabulary.vocab_size, dtype=torch.bool)
        others[allowed] = False
        assert torch.isinf(full[:, others]).all()
    vocabulary.forget("a")
    vocabulary.forget("b")
    assert vocabulary.num_admitted == 0


def test_a_token_map_of_another_vocabulary_or_no_token_map_is_refused(models, tmp_path) -> None:
    path = tmp_path / "map.json"
    TokenMap("0" * 16, (1, 2, 3), 3).write(path)
    for file in (path, tmp_path / "missing.json"):
        with pytest.raises(ConfigError) as info:
            speculating(models, "draft", speculative={"draft_token_map": str(file)})
        assert info.value.param == "draft_token_map"


@pytest.mark.parametrize("draft", ["draft", "target"], ids=["smaller-draft", "target-as-its-own-draft"])
def test_prompt_lookup_first_then_the_draft_model_changes_no_token(models, reference, draft: str) -> None:
    """Prompt lookup serves the requests whose tokens repeat (the prompt of nines), the draft model the
    others; chunked, batched and in a pool that preempts, the output is the target's, and the draft's KV of
    requests the lookup served catches up when the model drafts for them again."""
    llm = speculating(models, draft, num_kv_blocks=40, max_num_batched_tokens=24,
                      speculative={"adaptive": False, "prompt_lookup": True})
    assert greedy_ids(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    stats = llm.engine.stats()
    assert 0 < stats.num_lookup_draft_tokens < stats.num_draft_tokens  # both sources drafted
    assert stats.num_lookup_accepted_tokens <= stats.num_lookup_draft_tokens
    proposer = llm.engine.runner.proposer
    assert isinstance(proposer, DraftModelProposer) and proposer.lookup is not None
    drain(llm)


def test_seeded_sampling_draws_the_same_tokens_as_without_speculation(models) -> None:
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(len(PROMPTS))]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(str(models["target"]), dtype="float32", block_size=4, num_kv_blocks=128)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for draft in ("draft", "target"):
        llm = speculating(models, draft, speculative={"adaptive": False})
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.engine.stats().num_draft_tokens > 0


def test_sampled_drafts_of_the_target_itself_are_always_accepted(models) -> None:
    """Unseeded sampled requests get drafts sampled from the draft's distribution q, verified by rejection
    sampling. With the target as its own draft q equals p (the draft's logits are processed as the target's
    are: temperature, filters, penalties), so every draft is accepted."""
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.1, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    llm = speculating(models, "target", speculative={"adaptive": False})
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_draft_tokens == stats.num_draft_tokens
    drain(llm)


def test_a_draft_with_another_vocabulary_is_refused(models, tmp_path) -> None:
    other = tmp_path / "other-tokenizer"
    shutil.copytree(models["draft"], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[1000:1002]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="speculative_config.model: .* the vocabularies differ") as caught:
        LLM(str(models["target"]), dtype="float32", num_kv_blocks=16,
            speculative_config={"method": "draft_model", "model": str(other)})
    assert caught.value.param == "model"


def test_a_draft_larger_than_the_target_is_refused(models, tmp_path) -> None:
    larger = make_tiny_model(tmp_path, "qwen2", tie=False, seed=9, num_hidden_layers=3)
    with pytest.raises(ConfigError, match="speculative_config.model: .* more than the target's") as caught:
        LLM(str(models["target"]), dtype="float32", num_kv_blocks=16,
            speculative_config={"method": "draft_model", "model": str(larger)})
    assert caught.value.param == "model"


def test_a_draft_that_cannot_be_found_is_refused(models, tmp_path) -> None:
    with pytest.raises(ConfigError, match="speculative_config.model: the draft model was not found") as caught:
        LLM(str(models["target"]), dtype="float32", num_kv_blocks=16,
            speculative_config={"method": "draft_model", "model": str(tmp_path / "nowhere")})
    assert caught.value.param == "model"


def test_a_gguf_draft_quantised_again_holds_q4_0_and_the_target_nothing_requantised(models, tmp_path) -> None:
    """The target's own weights as an F32 GGUF, drafting for it with "quantization": "q4_0": the draft holds
    every matrix it multiplies in Q4_0 (its untied embedding table, only looked up, stays dense), the target
    none, and its drafts are verified and taken."""
    draft = gguf_from_tiny_model(models["target"], tmp_path / "target.gguf")
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False,
            "quantization": "q4_0"}
    llm = LLM(str(models["target"]), dtype="bfloat16", num_kv_blocks=128, block_size=4, speculative_config=spec)
    if not llm.engine.backend.quantized_types:
        pytest.skip("this machine's backend has no kernels for quantised blocks")
    assert not llm.engine.model.holds_quantized_weights
    model = llm.engine.runner.proposer.model
    held = [w for w in model.weights() if isinstance(w, QuantizedWeight)]
    assert len(held) == 2 * 4 + 1  # each layer's fused QKV, O, fused gate/up and down projections; the head
    assert {type_name(s.ggml_type) for w in held for s in w.segments} == {"Q4_0"}
    assert not isinstance(model.embed_tokens, QuantizedWeight)
    greedy_ids(llm)
    assert llm.engine.stats().num_accepted_draft_tokens > 0


def test_a_draft_that_cannot_be_quantised_again_is_refused(models, tmp_path) -> None:
    q4_0 = {"method": "draft_model", "quantization": "q4_0"}
    with pytest.raises(ConfigError, match="speculative_config.quantization: 'q4_0' .* a directory of dense") as caught:
        LLM(str(models["target"]), dtype="float32", num_kv_blocks=16, speculative_config=q4_0 | {
            "model": str(models["draft"])})
    assert caught.value.param == "quantization"
    # float32 models run no quantised kernels
    draft = gguf_from_tiny_model(models["draft"], tmp_path / "draft.gguf")
    with pytest.raises(ConfigError, match="speculative_config.quantization: 'q4_0' needs a backend") as caught:
        LLM(str(models["target"]), dtype="float32", num_kv_blocks=16, speculative_config=q4_0 | {"model": str(draft)})
    assert caught.value.param == "quantization"
    with pytest.raises(ConfigError, match="quantization must be 'auto', 'gguf' or 'none'") as caught:
        LLM(str(models["target"]), dtype="float32", num_kv_blocks=16, quantization="q4_0")  # a draft's option only
    assert caught.value.param == "quantization"


def test_the_drafts_costs_are_measured_at_start_up_and_leave_nothing_behind(models) -> None:
    """The draft-length policy starts from the draft's measured forwards (one to five rows, a prefill chunk),
    so no live request's prefill in the draft is spent measuring them; nothing stays in the draft's KV."""
    llm = speculating(models, "draft")
    policy = llm.engine.runner.draft_lengths
    assert policy.draft_cost.has_data and policy._prefill_s_per_token is not None
    draft_kv = llm.engine.draft_kv
    assert draft_kv is not None and draft_kv.num_requests == 0
    assert draft_kv.kv.prefix_cache.num_cached_blocks == 0
    draft_kv.check_invariants()
    assert llm.engine.stats().draft_time_s == 0
