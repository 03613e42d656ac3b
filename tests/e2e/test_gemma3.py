"""Gemma 3: greedy output equals transformers token for token in float32, on a tiny random model whose window
is shorter than the prompts (prefix cache on and off, chunked prefill, preemption, kernels on and off) and on
the real Gemma 3 270M GGUF with a prompt longer than its 512-key window."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_kernels import load_cpu_kernels
from tests.e2e.conftest import LONG_DOCUMENT, hf_greedy, installed_model
from tests.support.tiny_models import TINY_GEMMA3_WINDOW, make_tiny_model
from tests.support.transformers_gguf import hf_from_gguf

MAX_TOKENS = 12
# Most prompts are longer than the tiny model's window: its sliding layers must hide their first keys.
TINY_PROMPTS = [[5, 17, 230, 4000, 12], list(range(100, 161)), [9] * 23, list(range(3000, 3200, 3))]


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gemma_hf(tmp_path_factory):
    import transformers

    model_dir = make_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3", tie=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert hf.config.sliding_window == TINY_GEMMA3_WINDOW < max(len(p) for p in TINY_PROMPTS)
    return model_dir, hf


@pytest.fixture(scope="module")
def tiny_gemma(tiny_gemma_hf):
    model_dir, hf = tiny_gemma_hf
    return model_dir, [hf_greedy(hf, p, MAX_TOKENS) for p in TINY_PROMPTS]


@pytest.mark.parametrize("cpu_kernels", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(load_cpu_kernels() is None, reason="the C++ kernels did not build")),
], ids=["torch-reference", "cpu-kernels"])
def test_tiny_gemma3_with_a_binding_window_matches_transformers(tiny_gemma, cpu_kernels: bool) -> None:
    model_dir, reference = tiny_gemma
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    # Blocks of 4 and 24-token steps: chunked prefill, mixed batches, decodes whose window starts mid-block.
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=24,
              enable_prefix_caching=True, cpu_kernels=cpu_kernels)
    first = llm.generate(prompts, _greedy())
    assert _ids(first) == reference
    assert max(o.metrics.num_prefill_chunks for o in first) > 1
    again = llm.generate(prompts, _greedy())  # the prompts now start from cached blocks
    assert _ids(again) == reference and sum(o.num_cached_tokens for o in again) > 0
    llm.engine.check_invariants()


def test_tiny_gemma3_frees_its_window_pages_as_it_decodes(tiny_gemma_hf) -> None:
    """The sliding layers keep KV pages for the last window only, step after step; the global layer keeps all
    of its own; the output is still transformers' token for token."""
    model_dir, hf = tiny_gemma_hf
    prompts, max_tokens = TINY_PROMPTS[1:], 40
    reference = [hf_greedy(hf, p, max_tokens) for p in prompts]
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=24,
              enable_prefix_caching=False)
    engine = llm.engine
    layout, kv = engine.kv_layout, engine.kv_manager
    assert layout.is_grouped and layout.windowed == (False, True, True)
    requests = [engine.add_request({"prompt_token_ids": p}, _greedy(max_tokens)) for p in prompts]
    # A step's queries read at most the window and a 24-token chunk behind them: 9 blocks of 4, and one
    # more where the window starts mid-block.
    most_window_pages = -(-(TINY_GEMMA3_WINDOW + 24) // 4) + 1
    peak_pages = peak_blocks = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
        running = [r for r in requests if r.block_ids]
        for request in running:
            for table in request.group_block_ids[1:]:
                assert sum(page != 0 for page in table) <= most_window_pages
        peak_pages = max(peak_pages, kv.pool.num_used)
        peak_blocks = max(peak_blocks, sum(len(r.block_ids) for r in running))
    assert [r.output_token_ids for r in requests] == reference
    # With one table for every layer the pool would have held 3 pages per block at the peak.
    assert peak_pages < 3 * peak_blocks * 0.75, (peak_pages, peak_blocks)


def test_tiny_gemma3_preempted_without_prefix_cache_matches_transformers(tiny_gemma) -> None:
    model_dir, reference = tiny_gemma
    # 30 blocks of 4 cannot hold the four requests (about 45 blocks when done) at once.
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=30, max_num_batched_tokens=256,
              enable_prefix_caching=False)
    assert _ids(llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], _greedy())) == reference
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.heavy  # transformers' GGUF loader alone takes a minute on this file
def test_real_gemma3_270m_matches_transformers() -> None:
    path = installed_model("gemma-3-270m")
    llm = LLM(model="gemma-3-270m", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=256)
    tok = llm.get_tokenizer()
    assert tok.chat_template is None and tok.add_bos_token
    texts = ["The capital of France is", "def fibonacci(n):\n    ", LONG_DOCUMENT + "\nSummary:"]
    prompt_ids = [tok.encode(t) for t in texts]
    assert len(prompt_ids[-1]) > 512  # past the sliding window
    hf = hf_from_gguf(path)
    reference = [hf_greedy(hf, ids, MAX_TOKENS) for ids in prompt_ids]
    assert _ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], _greedy())) == reference


def test_tiny_gemma3_with_kv_tiers_keeps_one_table_for_every_layer(tiny_gemma) -> None:
    # The tiers store whole blocks of every layer, so the window layers then keep all their blocks.
    model_dir, reference = tiny_gemma
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128, kv_host_gb=0.01)
    assert not llm.engine.kv_layout.is_grouped
    assert _ids(llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], _greedy())) == reference
