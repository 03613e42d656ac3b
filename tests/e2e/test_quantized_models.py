"""Quantised weights run in their GGUF blocks against the same file dequantised: perplexity on a fixed text
(tests/data/perplexity.txt, code and prose) within 1% of the float32 dequantised model's, with int16
activations (the default) and, where the build has the interleaved kernels, int8 ones; greedy output
agreeing with the bf16 dequantised run on most prompts, and the weights held in about the file's size.

The quantised runs are bf16 (the quantised kernels take bf16 activations); the perplexities and the greedy
agreement are printed (pytest -s) for the record.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.backends.base import PrefillChunk, StepRows
from kvserve.model.loader import iter_weights, read_arch_config
from kvserve.model.quantized import KERNEL_TYPES, QuantizedWeight, type_name
from kvserve.model_store import KNOWN_MODELS, known_model
from kvserve.runner.draft_vocab import DraftVocabulary
from tests.e2e.conftest import installed_model

TEXT = (Path(__file__).parents[1] / "data" / "perplexity.txt").read_text()
BLOCK_SIZE = 16
AGREEMENT_PROMPTS = json.loads((Path(__file__).parents[1] / "data" / "agreement_prompts.json").read_text())
AGREEMENT_TOKENS = 32
# The known models that take int8 activations by default: the two tests below check each with them.
INT8_CHECKED = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m")


def perplexity(llm: LLM, text: str) -> float:
    """exp(mean negative log-likelihood) of the text's tokens, each given the ones before it, in one prefill."""
    engine = llm.engine
    ids = engine.tokenizer.encode(text)
    num_tokens = len(ids)
    blocks = list(range(math.ceil(num_tokens / BLOCK_SIZE)))
    rows = StepRows(BLOCK_SIZE, torch.arange(num_tokens), prefills=[PrefillChunk(0, num_tokens, num_tokens, blocks)],
                    written_block_ids=blocks)
    model = engine.model
    tokens = torch.tensor(ids)
    with torch.no_grad(), model.thread_scope:
        meta = engine.backend.build_metadata(rows)
        hidden = model.forward(tokens, torch.arange(num_tokens), meta, engine.runner.kv_caches)
        nll = 0.0
        for start in range(0, num_tokens - 1, 256):  # logits a slice at a time: [rows, vocab] is large
            end = min(start + 256, num_tokens - 1)
            logits = model.compute_logits(hidden[start:end]).float()
            nll -= torch.log_softmax(logits, dim=-1).gather(1, tokens[start + 1:end + 1, None]).sum().item()
    return math.exp(nll / (num_tokens - 1))


def engine_for(model: str, quantization: str, dtype: str, activations: str = "int16") -> LLM:
    # Every layer's KV in one page table (window_pages off): perplexity() writes the text's blocks itself.
    num_blocks = math.ceil(len(TEXT) / BLOCK_SIZE) // 2 + 64  # ~2 characters a token, at the least
    return LLM(model=model, quantization=quantization, dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
               max_num_batched_tokens=4096, enable_prefix_caching=False, quantized_activations=activations,
               window_pages=False)


def check_perplexity(model: str) -> None:
    path = installed_model(model)
    ppl_float32 = perplexity(engine_for(str(path), "none", "float32"), TEXT)
    for activations in ("int16", "int8"):
        quantized = engine_for(str(path), "gguf", "bfloat16", activations)
        if quantized.engine.backend.quantized_types:  # else this machine dequantises at load: bf16 against float32
            assert "GGUF blocks" in quantized.engine.model.weight_summary()
        if activations == "int8" and "int8 activations" not in quantized.engine.backend.description:
            continue  # no interleaved kernels here: int8 activations fall back to int16
        ppl_quantized = perplexity(quantized, TEXT)
        del quantized
        print(f"\n{model}: perplexity quantised (bf16, {activations} activations) {ppl_quantized:.4f}, dequantised "
              f"float32 {ppl_float32:.4f}, ratio {ppl_quantized / ppl_float32:.4f}")
        assert abs(ppl_quantized / ppl_float32 - 1) < 0.01


@pytest.mark.heavy  # CI keeps the quantised kernels' greedy agreement checks below; this one's figure is a benchmark's too
def test_smollm2_q4_1_perplexity_is_within_one_percent_of_float32() -> None:
    check_perplexity("smollm2-135m")


@pytest.mark.heavy
@pytest.mark.parametrize("model", INT8_CHECKED)
def test_q4_k_m_perplexity_is_within_one_percent_of_float32(model: str) -> None:
    check_perplexity(model)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(AGREEMENT_PROMPTS, params)]


def check_agreement(model: str) -> None:
    """The default's greedy output (int8 activations for the models the catalog marks, else int16) against the
    file dequantised to bf16."""
    path = str(installed_model(model))
    default = engine_for(path, "gguf", "bfloat16", "auto")
    description = default.engine.backend.description
    assert ("int8 activations" in description) == (known_model(model).int8_activations and "interleaved" in description)
    quantized = greedy(default)
    del default
    dequantized = greedy(engine_for(path, "none", "bfloat16"))
    agreeing = []
    for q, d in zip(quantized, dequantized, strict=True):
        agreeing.append(next((i for i, (a, b) in enumerate(zip(q, d, strict=True)) if a != b), AGREEMENT_TOKENS))
    full = sum(n == AGREEMENT_TOKENS for n in agreeing)
    print(f"\n{model}: quantised and dequantised greedy outputs agree for {agreeing} tokens "
          f"(of {AGREEMENT_TOKENS}); {full} of {len(agreeing)} prompts all the way")
    assert full > len(agreeing) // 2


@pytest.mark.slow
def test_smollm2_greedy_output_agrees_with_the_dequantised_run_on_most_prompts() -> None:
    check_agreement("smollm2-135m")


# Every model in pytest -m heavy (CI's time): SmolLM2's agreement check above stays in CI, and the 0.5B's Q4_K
# weights run in CI in the int8 check that its output does not depend on the batch or on speculation.
@pytest.mark.parametrize("model", [pytest.param(m, marks=pytest.mark.heavy) for m in INT8_CHECKED])
def test_q4_k_m_greedy_output_agrees_with_the_dequantised_run_on_most_prompts(model: str) -> None:
    check_agreement(model)


def test_the_models_that_take_int8_activations_by_default_are_those_checked_with_them() -> None:
    assert {m.name for m in KNOWN_MODELS if m.int8_activations} == set(INT8_CHECKED)


def test_the_loader_keeps_the_matrices_in_their_blocks_and_nothing_else() -> None:
    path = installed_model("smollm2-135m")
    arch = read_arch_config(path)
    dense = dict(iter_weights(path, arch, torch.float32, show_progress=False))
    kept = dict(iter_weights(path, arch, torch.float32, show_progress=False, quantized_types=KERNEL_TYPES))
    assert dense.keys() == kept.keys()
    quantized = {name for name, w in kept.items() if isinstance(w, QuantizedWeight)}
    assert "model.embed_tokens.weight" in quantized and "model.layers.0.self_attn.q_proj.weight" in quantized
    assert not any(name.endswith("norm.weight") for name in quantized)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight",
                 "model.embed_tokens.weight"):
        # Rows in Hugging Face's order (the Q/K un-permutation applies to the blocks) and values as gguf's.
        weight = kept[name]
        assert isinstance(weight, QuantizedWeight)
        assert torch.equal(weight.dequantize(), dense[name])


def test_the_weights_are_held_in_about_the_file_size() -> None:
    path = installed_model("smollm2-135m")
    llm = LLM(model=str(path), num_kv_blocks=16, quantization="gguf")
    if not llm.engine.backend.quantized_types:
        pytest.skip("this machine's backend dequantises quantised weights at load")
    held = llm.engine.model.weight_nbytes()
    assert abs(held / path.stat().st_size - 1) < 0.10, (held, path.stat().st_size)
    # The default keeps the blocks where the backend's plan says they are not slower under load.
    default = LLM(model=str(path), num_kv_blocks=16)
    in_blocks = "GGUF blocks" in default.engine.model.weight_summary()
    assert in_blocks == default.engine.backend.quantized_by_default, default.engine.model.weight_summary()


@pytest.mark.slow
def test_with_int8_activations_output_does_not_depend_on_the_batch_or_on_speculation() -> None:
    """One int8 level per 32 values at every width: a row's products are the same whatever rows run beside
    it, and so is its decode attention, so greedy output alone, in a batch, and verified from n-gram drafts is
    the same token for token (int16 activations give a batch past the few rows the residual level: their
    outputs may differ by batch, but not by a request's own drafts). The int8 outputs are not the int16 ones
    (the test can tell)."""
    path = str(installed_model("smollm2-135m"))
    params = SamplingParams(temperature=0.0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    # Prompts whose continuations repeat them first, so that drafts are taken before the proposer has seen
    # prompts whose drafts fail (it drafts less after those).
    prompts = ["Count: one, two, three, four, five, six, seven, eight, nine, ten. Again: one, two, three,",
               "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
               "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
               *AGREEMENT_PROMPTS]

    def alone(llm: LLM) -> list[list[int]]:  # a prompt at a time: the batch is the request and its drafts
        return [list(llm.generate([prompt], params)[0].outputs[0].token_ids) for prompt in prompts]

    llm = LLM(model=path, quantized_activations="int8", num_kv_blocks=256, enable_prefix_caching=False)
    if "int8 activations" not in llm.engine.backend.description:
        pytest.skip("int8 activations need the interleaved kernels (AVX512-VNNI)")
    plain = alone(llm)
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)] == plain
    del llm
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    speculated = LLM(model=path, quantized_activations="int8", num_kv_blocks=256, speculative_config=ngram)
    assert alone(speculated) == plain
    assert speculated.engine.stats().num_accepted_draft_tokens > 0  # drafts were verified and taken
    del speculated
    # With int16 activations too, a request's drafts take its own one level: speculation changes no token.
    int16 = alone(LLM(model=path, num_kv_blocks=256))
    assert alone(LLM(model=path, num_kv_blocks=256, speculative_config=ngram)) == int16
    assert int16 != plain


@pytest.mark.parametrize("pruning", ["leading", "gathered"])
def test_a_pruned_draft_vocabulary_over_a_quantised_head_gives_the_heads_logits_at_its_ids(pruning: str) -> None:
    """A draft's pruned vocabulary on an output projection held in its GGUF blocks: the leading rows (a view),
    or rows gathered from anywhere (a copy), and a request's prompt ids (dequantised rows): each column is its
    id's logit through the whole head, within the quantised products' own rounding."""
    llm = LLM(model=str(installed_model("smollm2-135m")), num_kv_blocks=16)
    model = llm.engine.model
    if not isinstance(model.lm_head, QuantizedWeight):
        pytest.skip("this CPU runs the file dequantised")
    kept = list(range(2048)) if pruning == "leading" else list(range(5, 49152, 24))[:2048]
    vocabulary = DraftVocabulary(model, model.arch.vocab_size, kept)
    vocabulary.admit("a", [45001, 10, 45002, 48999])
    hidden = torch.randn(3, model.arch.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad(), model.thread_scope:
        whole = model.compute_logits(hidden).float()
        logits, ids = vocabulary.logits(hidden, ["a"])
    assert ids is not None
    full = vocabulary.full(logits.float(), ids)
    allowed = sorted(set(kept) | {45001, 10, 45002, 48999})
    assert sorted(ids.tolist()) == allowed
    scale = whole.abs().max().item()
    torch.testing.assert_close(full[:, allowed], whole[:, allowed], rtol=0, atol=0.02 * scale)
    assert torch.isinf(full).sum() == 3 * (model.arch.vocab_size - len(allowed))


@pytest.mark.slow
def test_a_draft_quantised_again_to_q4_0_changes_no_token_of_the_output() -> None:
    """SmolLM2 drafting for itself from its matrices quantised again to Q4_0 (the file's Q4_1 and Q8_0):
    greedy output is plain decoding's token for token, a prompt at a time (each request's drafts verified at
    its own activation level); the draft, another approximation of the model, has drafts accepted and
    rejected, and holds every matrix in Q4_0 (its tied embedding table too: the output projection)."""
    path = str(installed_model("smollm2-135m"))
    params = SamplingParams(temperature=0.0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    prompts = AGREEMENT_PROMPTS[:4]
    plain = LLM(model=path, num_kv_blocks=256)
    if not plain.engine.backend.quantized_types:
        pytest.skip("this machine's backend dequantises quantised weights at load")
    want = [list(plain.generate([prompt], params)[0].outputs[0].token_ids) for prompt in prompts]
    del plain
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 4, "adaptive": False,
            "quantization": "q4_0"}
    llm = LLM(model=path, num_kv_blocks=256, speculative_config=spec)
    assert [list(llm.generate([prompt], params)[0].outputs[0].token_ids) for prompt in prompts] == want
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    draft = llm.engine.runner.proposer.model
    assert draft.lm_head is draft.embed_tokens  # tied: the embedding table is multiplied, so it is requantised
    types = {type_name(s.ggml_type) for w in draft.weights() if isinstance(w, QuantizedWeight) for s in w.segments}
    assert types == {"Q4_0"}, types
    assert draft.weight_nbytes() < 0.9 * llm.engine.model.weight_nbytes()
